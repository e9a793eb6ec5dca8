"""Which modules of a layer split over the vocabulary; see [Note: vocab-parallel layers]."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from hetpar.vocabulary import Sharding


# [Note: vocab-parallel layers]
# Beside the ILP's Linears, two modules split over the vocabulary, as Megatron splits
# them (Shoeybi et al. 2019, section 3): an ``nn.Embedding`` that looks up the model's
# input tokens, decided on the whole model's graph (a position embedding, indexed by
# computed positions, stays whole even where its layer receives the positions, as in
# Megatron: splitting its few rows would cost an all-reduce for nothing; each rank holds V / tp rows,
# looks up the tokens in its range, and the partial outputs are all-reduced: one
# forward all-reduce of the output, nothing in the backward, whose input is token ids)
# and, on the model's last layer, the Linear whose output is the model's output and as
# wide as one of its Embeddings' vocabularies, a language model's head (each
# rank computes V / tp logits, which go split into the loss: [Note: vocab-parallel
# loss] in runtime/executor.py; forward, three all-reduces of one number per token in
# the cross-entropy; backward, the all-reduce of the Linear's input gradient, as any
# colwise Linear). Both cut the vocabulary-sized work, parameters, gradients,
# optimizer state and logits by tp. A weight tied to another module (GPT-2's wte and
# lm_head) splits only where every module holding it splits alike: the tracer decides
# ([Note: tied vocab-parallel weights] in planner/capture/trace.py) and passes the others in
# ``tied``. The vocabulary must divide by 16 (``VOCAB_MULTIPLE``).
# A vocabulary splits only where 16 divides it: every tensor-parallel degree a node's
# devices allow (2, 4, 8, 16) then divides it too, so the split never rules a degree out
# for the whole model. GPT-2's 50257 stays whole; Megatron pads its vocabulary to a
# multiple of 128 x tp (--make-vocab-size-divisible-by) for the same reason.
VOCAB_MULTIPLE = 16


def splits_vocabulary(size: int) -> bool:
    """Whether a vocabulary of ``size`` rows may split over tensor-parallel ranks."""
    return size % VOCAB_MULTIPLE == 0


def token_embeddings(gm: fx.GraphModule) -> set[str]:
    """The paths of the Embeddings that look up the model's input tokens, read on the whole
    model's graph ``gm``: those whose index is a model input, not positions computed in
    ``forward`` (``arange``), which a layer's own graph receives as an input too."""
    return {str(node.target) for node in gm.graph.nodes
            if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Embedding)
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"}


def vocab_sharding(gm: fx.GraphModule, *, last_layer: bool, tied: set[int], vocabularies: set[int] = frozenset(),
                   tokens: set[str] | None = None) -> dict[str, Sharding]:
    """The vocab-parallel modules of one layer ([Note: vocab-parallel layers]).

    Args:
        last_layer: the layer's output is the model's output (what the loss reads).
        tied: ids of parameters the model shares between modules.
        vocabularies: the sizes of the model's Embeddings: an output Linear splits only
            where its width is one of them (a language model's head, whose loss is a
            cross-entropy over the vocabulary; a regression or classifier head stays whole).
        tokens: the Embeddings that look up the model's input tokens (``token_embeddings``
            of the whole model's graph); None: those whose index is an input of ``gm``.
    """
    out: dict[str, Sharding] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(module := gm.get_submodule(str(node.target)), nn.Embedding):
            looks_up_tokens = isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder" and \
                (tokens is None or str(node.target) in tokens)
            if looks_up_tokens and id(module.weight) not in tied and module.padding_idx is None and module.max_norm is None \
                    and splits_vocabulary(module.num_embeddings):
                out[str(node.target)] = Sharding.VOCAB_EMBEDDING
    if last_layer:
        (result,) = [n for n in gm.graph.nodes if n.op == "output"]
        head = result.args[0]
        if isinstance(head, fx.Node) and head.op == "call_module":
            module = gm.get_submodule(str(head.target))
            if isinstance(module, nn.Linear) and id(module.weight) not in tied and module.bias is None \
                    and module.out_features in vocabularies and splits_vocabulary(module.out_features):
                out[str(head.target)] = Sharding.VOCAB_HEAD
    return out
