"""``hetpar devices``: the built-in device profiles."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from hetpar.cost_models.devices import DeviceProfile, known_devices
from hetpar.commands.common import console, print_json
from hetpar.vocabulary import Precision


def devices(
    as_json: Annotated[bool, typer.Option("--json", help="Print the profiles as JSON.")] = False,
) -> None:
    """List the device types hetpar knows, with their headline numbers."""
    profiles = known_devices()
    if as_json:
        print_json([
            {"name": p.name, "vendor": p.vendor, "memory_bytes": p.memory_bytes, "peak_flops_per_s": p.peak_flops_per_s,
             "mem_bw_bytes_per_s": p.mem_bw_bytes_per_s, "intra_node_link": p.intra_node_link,
             "intra_node_bw_bytes_per_s": p.node_link_bw_bytes_per_s, "peer_to_peer": p.intra_node_staged_bw_bytes_per_s is None}
            for p in profiles
        ])
        return
    table = Table(title="hetpar device profiles (sources: docs/devices.md)", title_justify="left")
    for column in ("type", "vendor", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "intra-node link"):
        table.add_column(column)
    for p in profiles:
        bf16 = p.peak_flops_per_s.get(Precision.BF16)
        table.add_row(p.name, p.vendor, f"{p.memory_bytes / 2**30:.0f} GiB", f"{bf16 / 1e12:.0f}" if bf16 else "-",
                      f"{p.peak_flops_per_s.get(Precision.FP32, 0) / 1e12:.1f}", f"{p.mem_bw_bytes_per_s / 1e9:.0f}", _link(p))
    console.print(table)


def _link(p: DeviceProfile) -> str:
    """The intra-node link, and "no P2P" where the card's copies go through host memory."""
    if p.intra_node_staged_bw_bytes_per_s is None:
        return p.intra_node_link
    return f"{p.intra_node_link}, no P2P"
