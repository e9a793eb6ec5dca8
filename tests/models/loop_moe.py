"""A GPT whose MLP is a mixture of experts written plainly: a loop over the experts.

    hetpar trace tests/models/loop_moe.py

Each block's MoE routes tokens with a Linear and ``torch.topk`` and runs each expert (an
``nn.ModuleList`` of MLPs) on the rows that chose it, found with ``torch.where`` (or, by
``select``, another data-dependent op: ``nonzero``, ``masked_select``, a boolean mask,
``.tolist()``, ``.item()``; ``capture=export`` adds a branch on a shape that torch.fx
cannot follow, so that torch.export captures it). How many rows an expert gets depends on the data, so the
meta device, where hetpar measures models, cannot run it: ``hetpar trace`` must stop
with one line that names the op and the module and points at the experts contract
(docs/model-file.md, "Mixtures of experts").
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, EXPERTS, TOP_K, SEQ, VOCAB = 32, 4, 2, 8, 64


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class LoopMoE(nn.Module):
    def __init__(self, hidden: int, select: str, shape_branch: bool):
        super().__init__()
        self.select, self.shape_branch = select, shape_branch
        self.router = nn.Linear(hidden, EXPERTS, bias=False)
        self.experts = nn.ModuleList(MLP(hidden) for _ in range(EXPERTS))

    def rows(self, index, expert):
        """(token, choice) of the rows routed to ``expert``."""
        hit = index == expert
        if self.select == "where":
            return torch.where(hit)
        if self.select == "nonzero":
            return hit.nonzero(as_tuple=True)
        if self.select == "mask":
            tokens = torch.arange(index.shape[0], device=index.device).unsqueeze(1).expand_as(index)
            return tokens[hit], torch.arange(index.shape[1], device=index.device).expand_as(index)[hit]
        if self.select == "masked_select":
            tokens = torch.arange(index.shape[0], device=index.device).unsqueeze(1).expand_as(index)
            return torch.masked_select(tokens, hit), torch.masked_select(torch.arange(index.shape[1], device=index.device).expand_as(index), hit)
        if self.select == "tolist":
            pairs = [(t, c) for t, row in enumerate(hit.tolist()) for c, h in enumerate(row) if h]
            return torch.tensor([t for t, _ in pairs], dtype=torch.long), torch.tensor([c for _, c in pairs], dtype=torch.long)
        raise ValueError(self.select)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        if self.shape_branch and flat.shape[0] == 0:  # torch.fx cannot follow it: captured by torch.export
            return x
        weights, index = torch.topk(F.softmax(self.router(flat), dim=-1), TOP_K, dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            if self.select == "item" and int((index == e).sum().item()) == 0:
                continue
            token, choice = self.rows(index, e) if self.select != "item" else torch.where(index == e)
            out = out.index_add(0, token, expert(flat[token]) * weights[token, choice].unsqueeze(-1))
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, hidden: int, select: str, shape_branch: bool):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.moe = LoopMoE(hidden, select, shape_branch)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class LoopMoEGPT(nn.Module):
    def __init__(self, select: str, shape_branch: bool, n_layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(HIDDEN, select, shape_branch) for _ in range(n_layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(select="where", capture="fx"):
    return LoopMoEGPT(select, shape_branch=capture == "export")


def example_inputs(batch_size, **_):
    return (torch.randint(0, VOCAB, (batch_size, SEQ)),)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(batch_size, seed, **_):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=gen)
        yield (tokens[:, :-1],), tokens[:, 1:]
