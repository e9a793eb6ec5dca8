"""Mixture-of-experts layers: the modules of experts hetpar recognises.

[Note: the experts contract]
A module of experts is one ``nn.Module`` that

- has an integer attribute ``num_experts`` (E, at least 2);
- holds its experts' weights as its own parameters, each with E in its first
  dimension (expert e's weights are the slice ``[e]`` of each), at least one of them a
  stack of matrices (3-D; a router's [E, H] weight is not one), and no child module
  holds parameters (an activation module may be a child);
- is called as ``experts(hidden, top_k_index, top_k_weights)``, with ``hidden`` of
  shape [N, H] (N tokens), ``top_k_index`` [N, k] (the experts each token chose) and
  ``top_k_weights`` [N, k], and returns [N, H]: for each token, the sum over its k
  choices of the weight times that expert applied to the token.

Hugging Face's mixture-of-experts families hold their experts this way in transformers
5 (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``,
``DeepseekV3Experts``, ``GptOssExperts``), and ``examples/moe_gpt.py`` writes one in
plain torch. The contract is what lets the planner count an expert's work from the
routing rather than from a data-dependent loop, and the program split the experts over
ranks: each rank keeps the slices of its own experts and runs the module's own forward
on the tokens sent to them.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a module of experts ([Note: the experts contract])."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        return False
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() < 2 or p.shape[0] != count for p in own) or all(p.dim() < 3 for p in own):
        return False
    return all(next(child.parameters(), None) is None for child in module.children())


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of experts in ``model``, by path, in module order."""
    return [(path, m) for path, m in model.named_modules() if is_experts(m)]


def grouped_mm_shape(a: torch.Size, b: torch.Size, groups: int) -> tuple[int, ...]:
    """The shape ``torch._grouped_mm(a, b, offs)`` returns for operands of shapes ``a``
    and ``b`` and ``groups`` offsets; see [Note: grouped_mm on meta]."""
    if len(a) == 2 and len(b) == 3:  # rows of a grouped, one matrix of b per group
        return (a[0], b[2])
    if len(a) == 3 and len(b) == 2:  # columns of b grouped
        return (a[1], b[1])
    if len(a) == 2 and len(b) == 2:  # the shared dimension grouped: one product per group
        return (groups, a[0], b[1])
    return (a[0], a[1], b[2])  # a batch of products


# [Note: grouped_mm on meta]
# ``torch.nn.functional.grouped_mm`` (``aten._grouped_mm``) multiplies float32 on the CPU
# in torch 2.13, but its meta function accepts bfloat16 only, so a float32 model that
# uses it (examples/moe_gpt.py, Hugging Face's experts on the CPU) cannot run on the meta
# device, where hetpar measures models and cuts stages. hetpar registers a meta function
# that gives the output's shape for any floating dtype, as the kernels do; the operands'
# other checks are the real kernel's, at run time. The registration lives as long as
# the process and only once hetpar.runtime.experts is imported.
def _grouped_mm_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    groups = offs.shape[0] if offs is not None else 1
    shape = grouped_mm_shape(mat_a.shape, mat_b.shape, groups)
    return mat_a.new_empty(shape, dtype=out_dtype or mat_a.dtype)


_META_LIBRARY = torch.library.Library("aten", "IMPL")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
    _META_LIBRARY.impl("_grouped_mm", _grouped_mm_meta, "Meta")


__all__ = ["grouped_mm_shape", "experts_modules", "is_experts"]
