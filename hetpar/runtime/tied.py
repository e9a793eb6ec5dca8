"""Weights tied across pipeline stages, kept identical as Megatron keeps its embedding.

[Note: tied weights across stages]
A model may use one parameter in two places far apart: GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``, T5's ``shared.weight`` feeds the encoder, the decoder and
the head. Each rank cuts its stages out of the whole model (built on the meta device)
and makes only their tensors, so when two stages use the parameter, each holds a copy
of its own, and their gradients are only
the part of the whole gradient that their stage's uses contribute. Megatron-LM's
answer for the word embedding of its first and last stages (``_allreduce_word_embedding_grads``
in megatron/core/distributed/finalize_model_grads.py) is the one taken here:

- the tied parameters are found when the stages are cut: a parameter of the whole
  model (by identity; its name is its first one in ``model.named_parameters()``) that
  the modules of two or more stages hold;
- every stage that holds it keeps its copy, and all copies start equal (every rank
  makes it as ``build_model()`` under the same seed does, or reads the same
  ``--init-from``; [Note: building only this rank's tensors] in runtime/materialize.py);
- after the backward of a step and the data-parallel reduction, before the optimizer
  step, the copies' gradients are summed over the ranks that hold them (one
  all-reduce per tied parameter over a group per data-parallel replica and tensor-
  parallel index), so every copy gets the gradient of the whole model;
- equal values, equal gradients and equal optimizer states keep the copies equal
  step after step, so a checkpoint that stores one copy of a key two stages save
  (DCP keeps one) restores both exactly.

The groups are created on every rank, in one order (``dist.new_group`` is collective),
from what every rank reports of its stages (one ``all_gather_object``). The stages
that hold one tied parameter must have equal tensor-parallel and data-parallel degrees,
and tensor parallelism must split every copy over the vocabulary (an embedding's and a
head's [V, H] weight, Shard(0): [Note: tied vocab-parallel weights] in planner/capture/trace.py)
or none: else its copies would be shaped differently on different stages, and the
program refuses to start. Split alike, rank t's copies are the same rows, and the
all-reduce of each rank's local shard of the gradient sums the whole gradient's rows.
A rank holding two stages that use the parameter (the interleaved schedule) holds it
once, and autograd already sums its two uses. The planner's memory model counts a tied copy on every stage but the
first (``tied_params``, planner.costs); the all-reduce's time is not in the estimate.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hetpar.runtime.distributed import Placement, StageSpec
from hetpar.runtime.model_file import ModelFile
from hetpar.runtime.shard import VOCAB_SPLITS, chunk_modules, cut_stage


class TiedWeightError(ValueError):
    """A weight tied across stages cannot be kept in sync under this plan."""


@dataclass(frozen=True, kw_only=True)
class TiedWeight:
    """A parameter that the modules of several stages hold."""

    name: str  # its first name in the whole model (``model.named_parameters()``)
    stages: tuple[int, ...]  # the stages that hold it, ascending


def model_names(model: nn.Module) -> dict[int, str]:
    """The first name of each parameter of ``model`` in ``named_parameters()``, by identity."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def held_parameters(names: dict[int, str], stage_module: nn.Module) -> list[str]:
    """The parameters ``stage_module`` holds, by their names in the whole model (``model_names``)."""
    return sorted({names[id(p)] for p in stage_module.parameters() if id(p) in names})


def find_tied(held: dict[int, list[str]]) -> list[TiedWeight]:
    """The parameters held by more than one stage, by name.

    Args:
        held: each stage's parameters, by their names in the whole model (``held_parameters``).
    """
    holders: dict[str, list[int]] = {}
    for stage in sorted(held):
        for name in held[stage]:
            holders.setdefault(name, []).append(stage)
    return [TiedWeight(name=name, stages=tuple(stages)) for name, stages in sorted(holders.items()) if len(stages) > 1]


def tied_across_stages(model_file: ModelFile, stage_layers: list[tuple[int, int]], layer_names: list[str],
                       leaf_modules: tuple[str, ...] = (), *, micro_batch_size: int = 1) -> list[TiedWeight]:
    """The weights that more than one of these stages holds, found as a program finds
    them: the model built on the meta device and each stage cut out of it
    (``shard.cut_stage``). ``hetpar compile`` asks, so that only the program of a plan
    with such a weight carries ``TiedGradients``.

    Args:
        model_file: the plan's model file, loaded with its arguments.
        stage_layers: each stage's first and last layer, in stage order.
        layer_names: the plan's layer names.
        leaf_modules: the plan's leaf modules.
        micro_batch_size: the rows of the example inputs a stage is cut with.

    Raises:
        runtime.shard.ShardError: the model's layers are not the plan's.
    """
    if len(stage_layers) < 2:
        return []
    with torch.device("meta"):
        model = model_file.build_model()
    names = model_names(model)
    held = {s: held_parameters(names, cut_stage(model, model_file, micro_batch_size, layers, layer_names,
                                                leaf_modules).module)
            for s, layers in enumerate(stage_layers)}
    return find_tied(held)


def sync_groups(tied: list[TiedWeight], stages: list[StageSpec], aliases: dict[str, list[str]] | None = None
                ) -> dict[tuple[int, ...], list[str]]:
    """The ranks whose copies of tied weights are summed together, and which weights.

    For each tied weight, replica d and tensor-parallel index t: the ranks
    ``stages[s].ranks[d][t]`` of its stages s, when they are more than one rank.

    Args:
        tied: the tied weights (``find_tied``).
        stages: the program's stages.
        aliases: every name of each tied weight in the whole model, to check that
            tensor parallelism splits every copy alike or none.

    Returns:
        Sorted rank tuples, each with the names of the weights its ranks sum.

    Raises:
        TiedWeightError: the stages of a weight differ in tensor- or data-parallel
            degree, or tensor parallelism splits its copies differently.
    """
    groups: dict[tuple[int, ...], list[str]] = {}
    for weight in tied:
        holders = [stages[s] for s in weight.stages]
        _check(weight, holders, (aliases or {}).get(weight.name, [weight.name]))
        for d in range(len(holders[0].ranks)):
            for t in range(holders[0].degree(d)):
                ranks = tuple(sorted({stage.ranks[d][t] for stage in holders}))
                if len(ranks) > 1:
                    groups.setdefault(ranks, []).append(weight.name)
    return dict(sorted(groups.items()))


def _check(weight: TiedWeight, holders: list[StageSpec], names: list[str]) -> None:
    where = ", ".join(f"stage {s} (dp {len(h.ranks)}, tp {h.tensor_parallel})" for s, h in zip(weight.stages, holders))
    if len({tuple(len(r) for r in h.ranks) for h in holders}) > 1:
        raise TiedWeightError(f"{weight.name} is tied across {where}: its stages need equal data- and tensor-parallel "
                              f"degrees to keep its copies equal; plan them so, or keep its uses in one stage")
    if all(len(r) == 1 for r in holders[0].ranks):
        return
    modules = {name.rpartition(".")[0] for name in names}
    split = [{m: h.tp_sharding[m] for m in sorted(modules & set(h.tp_sharding))} for h in holders]
    kinds = {kind for s in split for kind in s.values()}
    if kinds and (not all(split) or kinds - VOCAB_SPLITS):
        module, kind = next(iter(next(s for s in split if s).items()))
        how = "not over the vocabulary" if all(split) else "but not every copy"
        raise TiedWeightError(f"{weight.name} is tied across {where}, and tensor parallelism splits {module} ({kind}), "
                              f"which holds it, {how}: its copies would differ in shape; split every copy over the "
                              f"vocabulary or none")


class TiedGradients:
    """Sums the gradients of the copies of weights tied across stages; see
    [Note: tied weights across stages].

    Built once the stages are cut and before tensor or data parallelism replaces their
    parameters (collective: every rank reports its stages and creates every group).
    ``reduce`` looks the parameters up by their names in the rank module, so it finds
    the DTensor or FSDP2 parameters that later replace them.
    """

    def __init__(self, model: nn.Module, module: nn.Module, stage_ids: list[int], stages: list[StageSpec],
                 me: Placement, *, announce: bool = False):
        names = model_names(model)
        mine = {s: held_parameters(names, chunk) for s, chunk in zip(stage_ids, chunk_modules(module), strict=True)}
        reports: list[dict[int, list[str]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(reports, mine)
        held = {s: held for report in reports for s, held in report.items()}
        self.tied = find_tied(held)
        aliases: dict[str, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(names[id(p)], []).append(name)
        self._aliases = aliases
        local = {names[id(p)]: name for name, p in module.named_parameters() if id(p) in names}
        self.module = module
        # copies of weights whose first stage another rank runs: counted there once (training.GradClipper)
        self._later = [local[w.name] for w in self.tied if w.name in local and w.stages[0] not in stage_ids]
        self._mine: list[tuple[dist.ProcessGroup, list[str]]] = []  # (group, names in ``module``)
        for ranks, weights in sync_groups(self.tied, stages, aliases).items():
            group = dist.new_group(list(ranks))
            if me.rank in ranks:
                self._mine.append((group, [local[w] for w in weights]))
        if announce and self.tied:
            print(f"hetpar: {self}", file=sys.stderr, flush=True)

    def __str__(self) -> str:
        tied = "; ".join(f"{' = '.join(self._aliases.get(w.name, [w.name]))} in stages {', '.join(map(str, w.stages))}"
                         for w in self.tied)
        return f"weights tied across stages, gradients summed over their copies: {tied}" if tied else "no tied weights"

    def later_copies(self) -> list[nn.Parameter]:
        """This rank's copies of tied weights whose first stage is another rank's: the
        parameters a sum over every stage must not count again (they equal the first
        stage's copy after ``reduce``). Looked up now, so they are the DTensor or FSDP2
        parameters that replaced the cut ones."""
        return [self.module.get_parameter(name) for name in self._later]

    def reduce(self) -> None:
        """Sum each tied weight's gradient over the ranks of its group (after the
        data-parallel reduction, before the optimizer step)."""
        for group, names in self._mine:
            for name in names:
                param = self.module.get_parameter(name)
                if param.grad is None:  # a stage that holds the weight without using it
                    param.grad = torch.zeros_like(param)
                if isinstance(param.grad, DTensor) and param.grad.placements != param.placements:
                    # an Embedding split over the vocabulary gets a replicated gradient; keep this rank's rows
                    param.grad = param.grad.redistribute(param.device_mesh, param.placements)
                grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)


__all__ = ["TiedGradients", "TiedWeight", "TiedWeightError", "find_tied", "held_parameters", "model_names", "sync_groups",
           "tied_across_stages"]
