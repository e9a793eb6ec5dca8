"""The model shard of one rank: its stage cut out of the whole model, tensor parallel
applied, and its slice of each global batch."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from runtime.graph import Stage, build_stage, record_values, trace_layers
from runtime.model_file import ModelFile


class ShardError(Exception):
    """The program does not fit the model it was given (layers or module paths differ)."""


def load_full_state(model: nn.Module, path: Path) -> None:
    """Load a full single-file state_dict (``torch.save``) into the whole model, strictly."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)


def cut_stage(
    model: nn.Module,
    model_file: ModelFile,
    micro_batch_size: int,
    layers: tuple[int, int],
    layer_names: list[str],
    leaf_modules: tuple[str, ...] = (),
) -> Stage:
    """Trace the whole model and cut layers ``layers[0]..layers[1]`` out as this rank's stage.

    The stage module shares its parameters with ``model`` and keeps their qualified
    names (``blocks.0.attn.q.weight``). Shapes of the tensors between stages come from
    the model run on a micro-batch of ``micro_batch_size`` on the meta device.

    Raises:
        ShardError: the model's layers are not the ones the program was compiled for.
    """
    layered = trace_layers(model, leaf_modules)
    if list(layered.layer_names) != list(layer_names):
        raise ShardError(
            f"{model_file.path.name} now has layers {list(layered.layer_names)}, "
            f"the program was compiled for {list(layer_names)}; re-run hetpar plan and compile"
        )
    values = record_values(layered, model_file.example_inputs(micro_batch_size))
    return build_stage(layered, values, layers[0], layers[1])


_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh, tp_sharding: dict[str, str]) -> None:
    """Shard the named submodules over ``mesh`` Megatron-style with DTensor.

    ``colwise`` splits a Linear's output features (its output stays split, as a plain
    local tensor); ``rowwise`` splits its input features and all-reduces the output.
    Every rank already holds identical weights, so each takes its shard locally
    (``src_data_rank=None``) instead of receiving it from rank 0.

    Raises:
        ShardError: a path names no submodule of the stage, or an unknown sharding.
    """
    styles: dict[str, ParallelStyle] = {}
    for path, kind in tp_sharding.items():
        try:
            module.get_submodule(path)
        except AttributeError:
            raise ShardError(f"tp_sharding names {path!r}, which is not a module of this stage") from None
        if kind not in _STYLES:
            raise ShardError(f"tp_sharding of {path!r} is {kind!r}; expected one of {', '.join(_STYLES)}")
        styles[path] = _STYLES[kind]()
    parallelize_module(module, mesh, styles, src_data_rank=None)


Microbatch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def microbatches(
    inputs: tuple[torch.Tensor, ...],
    targets: torch.Tensor,
    *,
    replica: int,
    data_parallel: int,
    num_microbatches: int,
    device: torch.device,
) -> list[Microbatch]:
    """This replica's micro-batches of a global batch.

    Replica d takes rows ``[d*B/dp, (d+1)*B/dp)`` and splits them into
    ``num_microbatches`` consecutive micro-batches of equal size.
    """
    batch = targets.shape[0]
    if batch % (data_parallel * num_microbatches) or any(t.shape[0] != batch for t in inputs):
        raise ShardError(
            f"a global batch of {batch} rows (inputs {[t.shape[0] for t in inputs]}) does not split into "
            f"data_parallel({data_parallel}) * num_microbatches({num_microbatches}) equal micro-batches"
        )
    rows = batch // data_parallel
    size = rows // num_microbatches
    start = replica * rows
    out = []
    for i in range(num_microbatches):
        lo, hi = start + i * size, start + (i + 1) * size
        out.append((tuple(t[lo:hi].to(device) for t in inputs), targets[lo:hi].to(device)))
    return out


__all__ = ["Microbatch", "ShardError", "apply_tensor_parallel", "cut_stage", "load_full_state", "microbatches"]
