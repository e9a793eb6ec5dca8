"""Trace a model file on the meta device into a ModelGraph of measured layers.

Nothing is allocated: the model is built under ``torch.device("meta")``, traced with
torch.fx (runtime.graph), and each layer is run forward and backward on meta tensors
under torch's FlopCounterMode, with saved-tensor hooks counting what autograd keeps
for backward. The numbers are measured, not guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from cost_models.layers import LayerProfile
from planner.plan import Sharding
from planner.tensor_parallel import check_sharded_shapes, find_sharding, shard_on_meta
from runtime.graph import LayeredGraph, build_stage, record_values, trace_layers
from runtime.model_file import ModelFile, file_fingerprint

_NO_KERNEL_OPS = ("placeholder", "get_attr", "output")
_PROBE_TP = 2  # the degree of the second measurement; see [Note: tensor-parallel scaling]


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    """A model as the planner sees it: measured layers in execution order."""

    file: str
    args: dict[str, Any]
    fingerprint: str
    layers: list[LayerProfile]
    tp_sharding: list[dict[str, Sharding]] = field(default_factory=list)  # per layer
    input_bytes: float = 0.0  # per sample

    @property
    def layer_names(self) -> list[str]:
        return [l.name for l in self.layers]

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)


def trace_model(model_file: ModelFile, leaf_modules: tuple[str, ...] = ()) -> ModelGraph:
    """Build, trace and measure the model of ``model_file`` on the meta device.

    Raises:
        runtime.graph.TraceError: torch.fx cannot trace the model.
        runtime.model_file.ModelFileError: the model file breaks the contract.
    """
    with torch.device("meta"):
        model = model_file.build_model()
    lg = trace_layers(model, leaf_modules)
    example = model_file.example_inputs(1)
    values = record_values(lg, example)
    meta_inputs = tuple(t.to("meta") for t in example)
    layers, shardings = [], []
    for index in range(lg.num_layers):
        profile, sharding = _measure_layer(lg, values, meta_inputs, index)
        layers.append(profile)
        shardings.append(sharding)
    return ModelGraph(
        file=str(model_file.path.resolve()),
        args=dict(model_file.model_args),
        fingerprint=file_fingerprint(model_file.path),
        layers=layers,
        tp_sharding=shardings,
        input_bytes=float(sum(t.numel() * t.element_size() for t in example)),
    )


@dataclass
class _Run:
    fwd_flops: float
    bwd_flops: float
    saved_bytes: float
    outputs: Any


def _run_fwd_bwd(module: torch.nn.Module, inputs: list[torch.Tensor]) -> _Run:
    """Forward and backward on meta tensors counting FLOPs, then a forward counting saved activations."""
    args = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with FlopCounterMode(display=False) as fwd_counter:
        out = module(*args)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]
    with FlopCounterMode(display=False) as bwd_counter:
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return _Run(
        fwd_flops=float(fwd_counter.get_total_flops()),
        bwd_flops=float(bwd_counter.get_total_flops()),
        saved_bytes=_saved_bytes(module, inputs),
        outputs=out,
    )


def _saved_bytes(module: torch.nn.Module, inputs: list[torch.Tensor]) -> float:
    """Bytes autograd keeps for backward, parameters excluded, each storage counted once.

    See [Note: fused attention on meta].
    """
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            saved[storage._cdata] = storage.nbytes()
        return t

    args = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with _FusedAttention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)
    return float(sum(saved.values()))


# [Note: fused attention on meta]
# On the meta device scaled_dot_product_attention always takes the math path, which
# saves the T x T attention matrix. Real devices run a fused kernel (flash attention on
# CUDA and on CPU) that saves only q, k, v, the output and the row log-sum-exp. The
# saved-bytes pass stands in that kernel's footprint; the FLOP pass keeps the math
# path, whose FLOPs equal the fused kernel's.
class _FusedSDPA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        # Fused kernels return (B, T, H, D) memory seen as (B, H, T, D), so the usual
        # transpose(1, 2).reshape(B, T, -1) after attention is a view, not a copy.
        batch, heads, length = q.shape[0], q.shape[1], q.shape[2]
        out = q.new_empty((batch, length, heads, v.shape[-1])).transpose(1, 2)
        logsumexp = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class _FusedAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return _FusedSDPA.apply(*args[:3])
        return func(*args, **(kwargs or {}))


def _measure_layer(lg: LayeredGraph, values: dict, meta_inputs: tuple, index: int) -> tuple[LayerProfile, dict]:
    stage = build_stage(lg, values, index, index)
    inputs = [meta_inputs[i] for i in stage.model_inputs]
    inputs += [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in stage.recv]
    whole = _run_fwd_bwd(stage.module, inputs)
    params = sum(p.numel() for p in stage.module.parameters())
    sharding = find_sharding(stage.module)
    split_fraction, split_params, split_saved, allreduce = 0.0, 0, 0.0, 0.0
    if sharding:
        try:
            sharded = shard_on_meta(stage.module, sharding, _PROBE_TP)
            half = _run_fwd_bwd(sharded, inputs)
            ok = check_sharded_shapes(whole.outputs, half.outputs)
        except (RuntimeError, ValueError):
            ok = False
        if ok and whole.fwd_flops > 0:
            split_fraction = min(1.0, _PROBE_TP / (_PROBE_TP - 1) * (1 - (half.fwd_flops + half.bwd_flops) / (whole.fwd_flops + whole.bwd_flops)))
            split_params = round(_PROBE_TP / (_PROBE_TP - 1) * (params - sum(p.numel() for p in sharded.parameters())))
            split_saved = _PROBE_TP / (_PROBE_TP - 1) * (whole.saved_bytes - half.saved_bytes)
            allreduce = _rowwise_output_bytes(stage.module, inputs, sharding)
        else:
            sharding = {}
    profile = LayerProfile(
        name=lg.layer_names[index],
        fwd_flops=whole.fwd_flops,
        bwd_flops=whole.bwd_flops,
        params=params,
        saved_activation_bytes=whole.saved_bytes,
        boundary_bytes=float(sum(s.nbytes for s in stage.send)),
        num_ops=sum(1 for n in stage.module.graph.nodes if n.op not in _NO_KERNEL_OPS),
        tp_split_flops_fraction=split_fraction,
        tp_split_params=split_params,
        tp_split_saved_bytes=max(0.0, split_saved),
        tp_allreduce_bytes=allreduce,
    )
    return profile, sharding


def _rowwise_output_bytes(module: fx.GraphModule, inputs: list[torch.Tensor], sharding: dict[str, Sharding]) -> float:
    """Bytes of the outputs of rowwise Linears: the payload of the forward all-reduces."""
    rowwise = {p for p, s in sharding.items() if s is Sharding.ROWWISE}
    sizes: list[int] = []
    hooks = [
        module.get_submodule(p).register_forward_hook(lambda m, a, out: sizes.append(out.numel() * out.element_size()))
        for p in rowwise
    ]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return float(sum(sizes))
