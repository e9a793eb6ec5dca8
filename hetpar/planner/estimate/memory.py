"""The memory of an estimated pipeline rank: its training state, and the activations its
schedule keeps in flight at the worst moment."""

from __future__ import annotations

from hetpar.cost_models.memory import (
    WEIGHT_GRAD_ACTIVATION_SHARE,
    MemoryBreakdown,
    activation_bytes_per_microbatch,
    backward_gradient_bytes,
    recompute_workspace_bytes,
    training_state_bytes,
)
from hetpar.planner.estimate.config import EstimateConfig
from hetpar.planner.estimate.step_costs import stage_params
from hetpar.planner.model_graph import ModelGraph
from hetpar.runtime.schedule import Action, Kind
from hetpar.vocabulary import Schedule


def _peak_activations(actions: list[Action], per_mb: dict[int, float], split_weights: bool) -> float:
    """The most activation bytes a rank holds while it runs ``actions``; see [Note: zero-bubble split]."""
    kept_for_w = WEIGHT_GRAD_ACTIVATION_SHARE if split_weights else 0.0
    live = peak = 0.0
    for a in actions:
        if a.kind is Kind.FORWARD:
            live += per_mb[a.stage]
        elif a.kind is Kind.BACKWARD:
            live -= per_mb[a.stage] * (1 - kept_for_w)
        else:
            live -= per_mb[a.stage] * kept_for_w
        peak = max(peak, live)
    return peak


def rank_memory(model: ModelGraph, config: EstimateConfig, bounds, chunks: list[int], actions: list[Action]) -> MemoryBreakdown:
    c = config
    tp = c.tp_of(chunks[0] % c.pp)
    layers = [model.layers[l] for k in chunks for l in range(bounds[k][0], bounds[k][1] + 1)]
    sp = c.sp_of(chunks[0] % c.pp)  # [Note: sequence parallelism costs]
    if sp:
        layers = [l.with_sequence_parallel() for l in layers]
    tied = stage_params(model, tp, [bounds[k] for k in chunks], c.ep) - sum(l.params_at(tp) for l in layers)  # and 1/ep experts
    weights, grads, opt = training_state_bytes(layers, tp=tp, dtype=c.dtype, optimizer=c.optimizer, dp=c.replica_rows,
                                               zero_stage=c.zero_of(chunks[0] % c.pp), extra_params=tied,
                                               offload=c.offload_of(chunks[0] % c.pp))
    per_mb, workspace = {}, 0.0
    for k in chunks:
        first, last = bounds[k]
        inputs = model.layers[first - 1].boundary_bytes if first > 0 else model.input_bytes
        mine = [l.with_sequence_parallel() if sp else l for l in model.layers[first : last + 1]]
        per_mb[k] = activation_bytes_per_microbatch(mine, tp=tp, micro_batch_size=c.micro_batch_size,
                                                    dtype=c.dtype, recompute=c.recompute_of(k), input_bytes=inputs)
        workspace = max(workspace, recompute_workspace_bytes(mine, tp=tp, micro_batch_size=c.micro_batch_size, dtype=c.dtype,
                                                             recompute=c.recompute_of(k)))
    workspace += backward_gradient_bytes(layers, tp=tp, micro_batch_size=c.micro_batch_size, dtype=c.dtype)
    activations = _peak_activations(actions, per_mb, c.schedule == Schedule.ZERO_BUBBLE) + workspace
    return MemoryBreakdown(weights_bytes=weights, gradients_bytes=grads, optimizer_bytes=opt, activations_bytes=activations)
