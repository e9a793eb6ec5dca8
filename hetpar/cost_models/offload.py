"""Training state in host memory: what offloading a ZeRO-3 stage moves, frees and costs.

[Note: offload costs]
A stage that offloads keeps its ZeRO-3 shard (weights, gradients, optimizer state; see
[Note: ZeRO stages] in cost_models/memory.py) in host memory, as FSDP2's
``CPUOffloadPolicy`` does ([Note: offload through FSDP2] in runtime/data_parallel.py):

- **Device memory:** none of the shard stays on the device; the gathered working
  buffers of ZeRO-3 (``zero3_buffer_bytes``) and the activations do.
- **Host memory:** the shard, ``params / d * (w + g + o)`` bytes per rank.
- **Per micro-batch:** each all-gather starts from the host, so the shard's weights
  cross the host link before the forward's gather and again before the backward's,
  and the reduce-scattered gradient shard crosses back after the backward:
  ``params / d * w / B_host`` in the forward, ``params / d * (w + g) / B_host`` in the
  backward. They are counted exposed, as ZeRO-3's collectives are.
- **Optimizer step:** on the host CPUs, over the shard: the bytes the device's step
  would move (``OPTIMIZER_BYTES_PER_PARAM``) at the host memory bandwidth one device's
  share of the CPUs reaches (``host_mem_bw_bytes_per_s``): torch's fused CPU AdamW is
  memory-bound, at about the host's streaming rate (benchmarks/cpu_adam_rate.py; its
  measurement in docs/benchmarks/offload_cpu-2core_2026-12-06.md).

Over one data-parallel row (dp 1) the shard is the whole state and ZeRO-3's gathers
cross no link (``zero_runs`` in cost_models/memory.py): the host transfers, the gathered
buffers and the host's optimizer step remain, so one device trains a model whose state
it cannot hold.

``B_host`` is ``host_link_bw_bytes_per_s`` (PCIe, or NVLink-C2C on Grace Hopper). A device
whose profile states no host (no ``host_link_bw_bytes_per_s`` or
``host_mem_bw_bytes_per_s``) is never offloaded, and CPU workers never are: their memory
is the host's already.
"""

from __future__ import annotations

from hetpar.cost_models.compute import dtype_bytes
from hetpar.cost_models.memory import OPTIMIZER_BYTES_PER_PARAM, state_bytes_per_param
from hetpar.vocabulary import Optimizer


def offload_refusal(device) -> str | None:
    """Why a stage on ``device`` (a DeviceProfile) cannot offload its state; None where it can."""
    if device.cpu_host:
        return f"{device.name} workers keep their training state in host memory already"
    missing = [k for k in ("host_link_bw_bytes_per_s", "host_mem_bw_bytes_per_s") if getattr(device, k) is None]
    if missing:
        return f"the {device.name} profile states no host ({' and '.join(missing)}); add them with --profile FILE"
    return None


def offload_transfer_s(shard_params: float, dtype: str, device) -> tuple[float, float]:
    """Seconds one micro-batch's (forward, backward) spend on the host link for a shard of
    ``shard_params`` parameters; see [Note: offload costs]."""
    w = g = dtype_bytes(dtype)
    link = device.host_link_bw_bytes_per_s
    return shard_params * w / link, shard_params * (w + g) / link


def host_optimizer_s(shard_params: float, optimizer: str, device) -> float:
    """Seconds the host CPUs take to step a shard of ``shard_params`` parameters; see [Note: offload costs]."""
    return shard_params * OPTIMIZER_BYTES_PER_PARAM[optimizer] / device.host_mem_bw_bytes_per_s


def host_state_bytes(shard_params: float, dtype: str, optimizer: str = Optimizer.ADAMW) -> float:
    """Host memory one offloading rank holds: its shard's weights, gradients and optimizer state."""
    return shard_params * sum(state_bytes_per_param(dtype, optimizer))
