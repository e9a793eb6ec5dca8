"""Tensor parallelism of the blocks of models whose stages are real modules (runtime.module_stage).

[Note: tensor parallelism of exported graphs]
A Hugging Face model is captured with torch.export: its graph calls no modules, but
every ATen op carries the module it ran in (``nn_module_stack``) and every parameter is
read at its qualified name, so ``aten.linear(x, model.layers.0.self_attn.q_proj.weight)``
is the Linear ``model.layers.0.self_attn.q_proj`` (and GPT-2's Conv1D is
``aten.addmm(bias, x, weight)`` with the weight stored [in, out]). The ILP of
[Note: tensor-parallel ILP] is built on that graph as on a torch.fx one
(``planner.capture.tp_ops.linear_site``; the feature-wise ops in their ATen spelling).

The graph cannot check a solution by running it split: export baked the shapes of its
reshapes (``expand(k, [1, 2, 2, 16, 16])`` names the key heads), so one rank's share of
heads breaks them. The program does not run that graph, though: it runs the block as
the model's own module ([Note: stages of the eager model] in runtime/module_stage.py),
whose reshapes read ``-1`` or the config, and that is what the dry run runs: the block
with each split Linear replaced by one rank's (smaller) Linear, on fake meta tensors.
A failure names the module it happened in; the split Linears inside it may not all be
split (OPT's attention views its projections as ``(batch, -1, num_heads, head_dim)``
with the config's head count, so OPT splits its MLP only), and the model is solved
again. The degrees a layer splits at are those at which the dry run passes (heads and
key heads divide). GPT-2's fused ``c_attn`` is part-laid ([Note: part-laid Linears] in
runtime/parts.py): its parts are read from the exported graph (``aten.split`` of the
``addmm``'s output, through the view that restores [B, T, 3C]: ``tp_ops.find_parts``),
and the copy of the block the dry run runs has its attention's ``split_size`` (and head
count) made local as the program makes them ([Note: local attention attributes] in
runtime/module_stage.py), so the attention splits by heads.

Where the model's config has a ``base_model_tp_plan`` (Llama: ``layers.*.self_attn.q_proj:
colwise``, ...) of the plain colwise/rowwise styles, it is used when it is a valid
layout of the ILP and its dry run passes, and the finder's own answer is kept next to
it (``BlockSharding``), so the two can be compared; a test holds them equal on Llama.
This module splits blocks; the token embedding and ``lm_head`` split over the
vocabulary where they are untied or tied to each other (planner.capture.trace ``_with_vocab_split``, [Note:
vocab-parallel layers] in planner.capture.vocab_parallel). A mixture of experts' experts stay
replicated (Mixtral's are 3-D parameters, not Linears): its attention is split.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from hetpar.planner.capture.measure import Measurement
from hetpar.planner.capture.tp_dry_run import DryRunFailure, solve_checked
from hetpar.planner.capture.tp_ilp import TpCostModel, TpProblem, build_problem, evaluate
from hetpar.planner.capture.tp_meta import local_linear
from hetpar.planner.capture.tp_ops import TpError
from hetpar.vocabulary import Sharding
from hetpar.runtime.capture import failure_site, quiet_torch_logs
from hetpar.runtime.module_stage import DecoderLayout, DecoderStage, hidden_size, localise_attention
from hetpar.runtime.parts import PartError

_STYLES = {style.value: style for style in (Sharding.COLWISE, Sharding.ROWWISE)}  # transformers tp_plan names ours
_RUN_ERRORS = (RuntimeError, ValueError, TypeError, IndexError)


@dataclass(frozen=True, kw_only=True)
class BlockSharding:
    """How one block is split: the finder's answer, the config's plan and the one used."""

    found: dict[str, Sharding]
    config: dict[str, Sharding] | None  # None: no usable base_model_tp_plan
    chosen: dict[str, Sharding]
    source: str  # "finder" or "base_model_tp_plan"
    problem: TpProblem
    choices: dict[str, Sharding | None]  # node -> choice of ``chosen``


def config_plan(model: nn.Module, layout: DecoderLayout, block: int) -> dict[str, Sharding] | None:
    """The config's ``base_model_tp_plan`` for block ``block``, by module path; None when
    the config has none, or uses a style other than colwise and rowwise on a block."""
    plan = getattr(getattr(model.get_submodule(layout.base), "config", None), "base_model_tp_plan", None)
    prefix = f"{layout.blocks}.*."
    out: dict[str, Sharding] = {}
    for key, style in (plan or {}).items():
        if not key.startswith(prefix):
            continue
        if style not in _STYLES:
            return None
        out[f"{layout.block_path(block)}.{key[len(prefix):]}"] = _STYLES[style]
    return out or None


class BlockDryRun:
    """Run one block split as one rank holds it; see [Note: tensor parallelism of exported graphs].

    Args:
        model: the whole model (on the meta device).
        layout: its layout (runtime.module_stage.decoder_layout).
        block: the block's index.
        seq_len: tokens per sample.
        nodes_by_path: the ILP's Linear nodes by module path, to name what failed.
    """

    def __init__(self, model: nn.Module, layout: DecoderLayout, block: int, seq_len: int,
                 nodes_by_path: dict[str, str] | None = None):
        self.model, self.layout, self.block, self.seq_len = model, layout, block, seq_len
        self.nodes_by_path = nodes_by_path or {}

    def __call__(self, sharding: dict[str, Sharding], tp: int) -> DryRunFailure | None:
        path = self.layout.block_path(self.block)
        stage = DecoderStage(self.model, self.layout, self.block + 1, self.block + 1)
        try:
            local = _split_block(stage.get_submodule(path), path, sharding, tp)
        except TpError as exc:
            return DryRunFailure(node="", split_inputs=frozenset(), reason=str(exc))
        container, _, name = path.rpartition(".")
        setattr(stage.get_submodule(container), name, local)
        try:  # the copy's attention attributes, as the program sets them ([Note: local attention attributes])
            localise_attention(stage.get_submodule(path),
                               {p.removeprefix(path + "."): how for p, how in sharding.items()}, tp)
        except PartError as exc:
            where = f"{path}.{exc.node}" if exc.node else path
            return DryRunFailure(node=where, split_inputs=self._culprits(where, path, sharding), reason=str(exc))
        hidden = torch.empty(1, self.seq_len, hidden_size(self.model, self.layout), device="meta")
        try:  # quiet: torch logs each failing meta kernel, and a failure here is an answer
            with quiet_torch_logs(), FakeTensorMode(allow_non_fake_inputs=True):
                out = stage(hidden)[0]
        except _RUN_ERRORS as exc:
            where = failure_site("dry run", exc, stage).module
            return DryRunFailure(node=where or "", split_inputs=self._culprits(where, path, sharding),
                                 reason=f"{type(exc).__name__}: {exc}")
        if out.shape != hidden.shape:
            return DryRunFailure(node=path, split_inputs=frozenset(), reason="a split value reaches the layer's output")
        return None

    def _culprits(self, where: str | None, block_path: str, sharding: dict[str, Sharding]) -> frozenset[str]:
        """The colwise Linears inside the module that failed (their outputs split there);
        none when the block itself failed (then the whole assignment is forbidden)."""
        if not where or where == block_path:
            return frozenset()
        return frozenset(self.nodes_by_path[p] for p, how in sharding.items()
                         if how is Sharding.COLWISE and p.startswith(where + ".") and p in self.nodes_by_path)


def _split_block(block: nn.Module, block_path: str, sharding: dict[str, Sharding], tp: int) -> nn.Module:
    """A meta copy of ``block`` with each split Linear (or Conv1D) as one rank's share."""
    local = copy.deepcopy(block)
    _experts_for_meta(local)
    for path, how in sharding.items():
        relative = path[len(block_path) + 1:]
        owner, _, name = relative.rpartition(".")
        parent = local.get_submodule(owner) if owner else local
        setattr(parent, name, local_linear(getattr(parent, name), how, tp, path))
    return local


def _experts_for_meta(block: nn.Module) -> None:
    """Give the mixture-of-experts layers of ``block`` (a copy: its configs are its own) an
    implementation that runs on fake meta tensors. transformers picks ``grouped_mm`` for
    a meta weight, and torch's meta kernel of ``_grouped_mm`` accepts bfloat16 only
    (Mixtral in float32 fails the dry run, though the CPU kernel runs it); ``batched_mm``
    computes the same shapes with plain batched matmuls."""
    for module in block.modules():
        config = getattr(module, "config", None)
        if getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = "batched_mm"


def block_sharding(model: nn.Module, layout: DecoderLayout, block: int, seq_len: int, layer: fx.GraphModule,
                   inputs: list[torch.Tensor], measurement: Measurement | None = None,
                   cost: TpCostModel | None = None) -> BlockSharding:
    """How tensor-parallel ranks split block ``block``; see [Note: tensor parallelism of exported graphs].

    Args:
        model: the whole model, on the meta device.
        layout: its layout.
        block: the block's index.
        seq_len: tokens per sample.
        layer: the block's layer cut from the exported graph.
        inputs: meta tensors ``layer`` runs on (one sample's worth).
        measurement: ``planner.capture.measure.measure(layer, inputs)`` when already taken.
        cost: the cost model; ``TpCostModel.for_device()`` by default.
    """
    problem = build_problem(layer, inputs, cost or TpCostModel.for_device(), measurement)
    check = BlockDryRun(model, layout, block, seq_len, {s.path: s.name for s in problem.linears})
    found = solve_checked(layer, inputs, problem, dry_run_fn=check)
    config = config_plan(model, layout, block)
    if config is not None:
        choices = {s.name: config.get(s.path) for s in problem.linears}
        if set(config) <= {s.path for s in problem.linears} and evaluate(problem, choices) is not None \
                and check(config, problem.tp) is None:
            return BlockSharding(found=found.sharding(problem), config=config, chosen=config,
                                 source="base_model_tp_plan", problem=problem, choices=choices)
        config = None
    return BlockSharding(found=found.sharding(problem), config=config, chosen=found.sharding(problem), source="finder",
                         problem=problem, choices=found.choices)


__all__ = ["BlockDryRun", "BlockSharding", "block_sharding", "config_plan"]
