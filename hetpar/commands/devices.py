"""``hetpar devices``: the built-in device profiles."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from hetpar.cost_models.devices import known_devices
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
             "mem_bw_bytes_per_s": p.mem_bw_bytes_per_s, "intra_node_link": p.intra_node_link}
            for p in profiles
        ])
        return
    table = Table(title="hetpar device profiles (sources: docs/devices.md)", title_justify="left")
    for column in ("type", "vendor", "memory", "bf16 TFLOP/s", "fp32 TFLOP/s", "HBM GB/s", "intra-node link"):
        table.add_column(column)
    for p in profiles:
        bf16 = p.peak_flops_per_s.get(Precision.BF16)
        table.add_row(p.name, p.vendor, f"{p.memory_bytes / 2**30:.0f} GiB", f"{bf16 / 1e12:.0f}" if bf16 else "-",
                      f"{p.peak_flops_per_s.get(Precision.FP32, 0) / 1e12:.1f}", f"{p.mem_bw_bytes_per_s / 1e9:.0f}", p.intra_node_link)
    console.print(table)
