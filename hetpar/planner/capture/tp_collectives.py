"""The collectives a sharded layer issues, as the runtime issues them (runtime.shard), counted
per micro-batch for the cost model."""

from __future__ import annotations

import torch
import torch.fx as fx

from hetpar.planner.capture.tp_ops import linear_site, run_graph, tensor_nbytes
from hetpar.vocabulary import Sharding


def layer_collectives(module: fx.GraphModule, inputs: list[torch.Tensor], sharding: dict[str, Sharding]
                      ) -> tuple[tuple[str, str, float], ...]:
    """The collectives one micro-batch of the layer so sharded issues, as the runtime
    issues them (runtime.shard; [Note: tensor-parallel ILP], the table): forward, one
    per rowwise Linear's output and colwise_gather Linear's output; backward, one
    all-reduce per tensor that colwise Linears read ([Note: one all-reduce per shared
    input] in runtime/shard.py) and one all-gather per rowwise_slice input, where the
    input needs a gradient. Each is (pass, collective, bytes per sample): pass
    "forward" or "backward", collective "all_reduce" or "all_gather", bytes the whole
    tensor's (the all-reduced buffer, the gathered result)."""
    values = run_graph(module, inputs, grad=True)
    out: list[tuple[str, str, float]] = []
    colwise_inputs: dict[str, float] = {}
    for node in module.graph.nodes:
        if node.op == "call_module" and sharding.get(str(node.target)) is Sharding.VOCAB_EMBEDDING:
            out.append(("forward", "all_reduce", float(tensor_nbytes(values[node.name]))))
        site = linear_site(module, node)
        how = sharding.get(site.path) if site is not None else None
        if how is None:
            continue
        x = values[site.input.name]
        input_grad = float(tensor_nbytes(x)) if getattr(x, "requires_grad", False) else 0.0
        output = float(tensor_nbytes(values[node.name]))
        if how in (Sharding.ROWWISE, Sharding.ROWWISE_SLICE):
            out.append(("forward", "all_reduce", output))
        if how is Sharding.COLWISE_GATHER:
            out.append(("forward", "all_gather", output))
        if how in (Sharding.COLWISE, Sharding.COLWISE_GATHER, Sharding.VOCAB_HEAD) and input_grad:
            colwise_inputs[site.input.name] = input_grad
        if how is Sharding.VOCAB_HEAD:  # the cross-entropy's max, sum of exponentials and target logit, per token
            tokens = values[node.name].numel() / values[node.name].shape[-1]
            out.extend([("forward", "all_reduce", 4.0 * tokens)] * 3)
        if how is Sharding.ROWWISE_SLICE and input_grad:
            out.append(("backward", "all_gather", input_grad))
    out.extend(("backward", "all_reduce", nbytes) for nbytes in colwise_inputs.values())
    return tuple(out)


def forward_all_reduces(sharding: dict[str, Sharding]) -> int:
    """All-reduces one forward pass of a layer so sharded runs: one per rowwise Linear."""
    return sum(1 for how in sharding.values() if how in (Sharding.ROWWISE, Sharding.ROWWISE_SLICE))
