"""Pipeline stages cut out of a Hugging Face decoder-only model at module boundaries.

[Note: stages of the eager model]
A stage cut from a torch.export graph (runtime.graph) is ATen code with its shapes
baked in: its attention reshapes name the head count, so tensor parallelism cannot give
a rank half the heads, and it has no ``nn.Linear`` modules for DTensor to shard. For
the decoder-only causal LMs whose forward hetpar knows (``decoder_layout``: Llama,
Mistral, Qwen2, Gemma, Phi, GPT-NeoX, Mixtral, GPT-2, OPT), a stage is instead an
``nn.Module`` that calls the model's own modules in the model's own order:

- the first stage embeds the tokens (GPT-2 and OPT add the position embeddings, GPT-2,
  Phi and GPT-NeoX their embedding dropout);
- every stage with blocks makes the position ids ``arange(T)``, the causal mask
  (``transformers.masking_utils``, as the model's forward does, sliding-window layers
  included) and the rotary tables from the hidden states it holds, and runs its blocks
  as the model calls them;
- the last stage applies the final norm and ``lm_head`` and returns the model's own
  output type (``CausalLMOutputWithPast(logits=...)``), so ``loss_fn`` reads
  ``outputs.logits`` as in one process.

Only the hidden states cross a cut: masks and rotary tables are recomputed where they
are used (the exported graph would send them). The stage holds the model's modules at
their qualified names (``model.layers.3.self_attn.q_proj``), so the plan's
``tp_sharding`` names them, DTensor shards the real ``nn.Linear`` (and GPT-2's
``Conv1D``) weights, attention's ``view(..., -1, head_dim)`` gives each rank its own
heads, and checkpoints, FSDP2 and tied weights see the model's parameter names. Nothing
is captured, so nothing is specialised to a shape or pinned to a device: the stage runs
wherever its parameters are. Recompute checkpoints each block. The layering must be the
one the planner traced: a leading layer, one layer per block, a trailing layer.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hetpar.runtime.graph import Stage, TensorSpec
from hetpar.runtime.parts import PartError
from hetpar.runtime.recompute import checkpoint_call
from hetpar.runtime.sequence import gather_sequence, scatter_sequence, sequence_of
from hetpar.vocabulary import Recompute, Sharding

# Base-model classes whose forward is Llama's (embed, rotary tables, layers called with
# the mask and the tables, final norm), by class: the embedding modules in the order the
# forward applies them (an embedding, then its dropout) and the final norm. Gemma scales
# its embedding inside the embedding module; Mixtral's blocks route to experts.
_LLAMA_LIKE = {
    "LlamaModel": (("embed_tokens",), ("norm",)),
    "MistralModel": (("embed_tokens",), ("norm",)),
    "Qwen2Model": (("embed_tokens",), ("norm",)),
    "GemmaModel": (("embed_tokens",), ("norm",)),
    "MixtralModel": (("embed_tokens",), ("norm",)),
    "PhiModel": (("embed_tokens", "embed_dropout"), ("final_layernorm",)),
    "GPTNeoXModel": (("embed_in", "emb_dropout"), ("final_layer_norm",)),
}


@dataclass(frozen=True, kw_only=True)
class DecoderLayout:
    """Where a decoder-only causal LM keeps its parts; see [Note: stages of the eager model]."""

    family: str  # "llama" (Llama-like), "gpt2" or "opt"
    base: str  # the base model's path: "model", "transformer", "model.decoder"
    embed: tuple[str, ...]  # the leading layer's modules, under the base
    blocks: str  # the block list, under the base
    norm: tuple[str, ...]  # the modules between the last block and the head, under the base
    rotary: str | None  # the rotary embedding, under the base
    head: str = "lm_head"
    num_blocks: int = 0

    def block_path(self, i: int) -> str:
        return f"{self.base}.{self.blocks}.{i}"

    def block_index(self, path: str) -> int | None:
        """The block a layer name is, or None."""
        prefix = f"{self.base}.{self.blocks}."
        rest = path.removeprefix(prefix)
        return int(rest) if path.startswith(prefix) and rest.isdigit() and int(rest) < self.num_blocks else None


def decoder_layout(model: nn.Module) -> DecoderLayout | None:
    """The layout of ``model`` if it is a decoder-only causal LM hetpar cuts at module
    boundaries ([Note: stages of the eager model]), else None."""
    base_name = getattr(model, "base_model_prefix", None)
    base = getattr(model, base_name, None) if isinstance(base_name, str) else None
    head = getattr(model, "lm_head", None)
    if base is None or not isinstance(head, nn.Linear) or getattr(base, "config", None) is None:
        return None
    kind = type(base).__name__
    if kind in _LLAMA_LIKE:
        embed, norm = _LLAMA_LIKE[kind]
        if all(hasattr(base, n) for n in (*embed, "layers", *norm, "rotary_emb")):
            return DecoderLayout(family="llama", base=base_name, embed=embed, blocks="layers", norm=norm,
                                 rotary="rotary_emb", num_blocks=len(base.layers))
    if kind == "GPT2Model" and not base.config.add_cross_attention:
        return DecoderLayout(family="gpt2", base=base_name, embed=("wte", "wpe", "drop"), blocks="h", norm=("ln_f",),
                             rotary=None, num_blocks=len(base.h))
    decoder = getattr(base, "decoder", None)
    if kind == "OPTModel" and type(decoder).__name__ == "OPTDecoder" and not base.config.layerdrop:
        present = [n for n in ("project_in", "final_layer_norm", "project_out") if getattr(decoder, n) is not None]
        return DecoderLayout(family="opt", base=f"{base_name}.decoder", embed=(
            "embed_tokens", "embed_positions", *(n for n in present if n == "project_in")), blocks="layers",
            norm=tuple(n for n in present if n != "project_in"), rotary=None, num_blocks=len(decoder.layers))
    return None


def layout_for(model: nn.Module, layer_names: list[str] | tuple[str, ...], example_inputs: tuple) -> DecoderLayout | None:
    """``decoder_layout(model)`` if the stages of ``layer_names`` can be cut from it at
    module boundaries: the layers are a leading layer, the blocks in order and a trailing
    layer, and the model takes one tensor of token ids."""
    layout = decoder_layout(model)
    if layout is None or len(example_inputs) != 1 or example_inputs[0].is_floating_point():
        return None
    blocks = [layout.block_path(i) for i in range(layout.num_blocks)]
    if len(layer_names) != len(blocks) + 2 or list(layer_names[1:-1]) != blocks:
        return None
    return layout


class DecoderStage(nn.Module):
    """Layers ``first_layer..last_layer`` of a decoder-only causal LM, run with the
    model's own modules; see [Note: stages of the eager model].

    ``forward(tokens)`` on the first stage, ``forward(hidden)`` on the others; returns
    ``(hidden,)``, or on the last stage what the model returns.
    """

    def __init__(self, model: nn.Module, layout: DecoderLayout, first_layer: int, last_layer: int, *,
                 recompute: str = Recompute.NONE):
        super().__init__()
        if recompute not in tuple(Recompute):
            raise ValueError(f"recompute {recompute!r} must be one of {', '.join(Recompute)}")
        self._layout, self._recompute = layout, recompute
        base = model.get_submodule(layout.base)
        self._config = base.config
        self._output_type = _output_type(model)
        self._embeds = first_layer == 0
        self._heads = last_layer == layout.num_blocks + 1
        self._blocks = [i for i in range(layout.num_blocks) if first_layer <= i + 1 <= last_layer]
        paths = [f"{layout.base}.{name}" for name in layout.embed] if self._embeds else []
        if self._blocks and layout.rotary:
            paths.append(f"{layout.base}.{layout.rotary}")
        paths += [layout.block_path(i) for i in self._blocks]
        if self._heads:
            paths += [*(f"{layout.base}.{name}" for name in layout.norm), layout.head]
        for path in paths:
            _attach(self, path, model.get_submodule(path))
        self.context = None  # a runtime.context.ContextSplit under context parallelism (context.apply_to_decoder)

    def forward(self, x: torch.Tensor) -> Any:
        layout = self._layout
        base = self.get_submodule(layout.base)
        h = self._embed(base, x) if self._embeds else x
        seq = sequence_of(self) if self._blocks else None  # [Note: sequence parallelism] in runtime/sequence.py
        if self._blocks:
            positions, masks = self._positions_and_masks(h)
            rotary = base.get_submodule(layout.rotary)(h, position_ids=positions) if layout.rotary else None
            blocks = base.get_submodule(layout.blocks)
            h = h if seq is None else scatter_sequence(h, seq)  # after the tables and masks of the whole sequence
            for i in self._blocks:
                call = _Gpt2Block(blocks.get_submodule(str(i)), masks["full_attention"], positions) \
                    if layout.family == "gpt2" else \
                    _LlamaBlock(blocks.get_submodule(str(i)), masks[_mask_kind(self._config, i)], rotary, positions)
                h = checkpoint_call(call, h, mode=self._recompute)
        if not self._heads:
            return (h if seq is None else gather_sequence(h, seq),)
        head = self.get_submodule(layout.head)
        if seq is None and not isinstance(head.weight, DTensor):  # recomputed as a traced stage's last layer is
            return self._output_type(logits=checkpoint_call(self._final_layer, h, mode=self._recompute))
        for name in layout.norm:
            h = base.get_submodule(name)(h)
        if seq is not None:
            h = gather_sequence(h, seq, partial_grad=seq.head_partial_grad)
        return self._output_type(logits=head(h))

    def fsdp_units(self) -> list[nn.Module]:
        """The decoder blocks, which ZeRO-3 gathers one at a time ([Note: ZeRO through FSDP2]
        in runtime/data_parallel.py): each is called as a module."""
        if not self._blocks:
            return []
        blocks = self.get_submodule(self._layout.base).get_submodule(self._layout.blocks)
        return [blocks.get_submodule(str(i)) for i in self._blocks]

    def _final_layer(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the head: the stage's last layer, which the costs recompute
        with the blocks (the cost model's layer of ``norm+lm_head``)."""
        base = self.get_submodule(self._layout.base)
        for name in self._layout.norm:
            h = base.get_submodule(name)(h)
        return self.get_submodule(self._layout.head)(h)

    def _positions_and_masks(self, h: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The position ids of ``h``'s tokens and the masks by attention kind: 0 .. T - 1
        and the model's causal masks, or under context parallelism the rank's global
        positions and no masks (its attention masks by position: [Note: context
        parallelism] in runtime/context.py)."""
        positions = self._position_ids(h)
        if self.context is None:
            return positions, _causal_masks(self._config, h, positions)
        return positions, collections.defaultdict(lambda: None)

    def _position_ids(self, x: torch.Tensor) -> torch.Tensor:
        """[1, T] position ids of the T tokens along ``x``'s dimension 1: 0 .. T - 1, or
        under context parallelism the rank's global positions."""
        if self.context is None:
            return torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return self.context.positions(x.shape[1], device=x.device).unsqueeze(0)

    def sequence_layout(self) -> tuple[list[str], list[str], str | None]:
        """(the blocks, the norms after them, the head) as paths of this stage: what
        runtime.sequence.shard_module_stage shards; nothing for a stage without blocks.

        Raises:
            ValueError: an OPT stage, whose blocks call their Linears on a flattened input.
        """
        layout = self._layout
        if not self._blocks:
            return [], [], None
        if layout.family == "opt":
            raise ValueError("OPT's decoder layers flatten the sequence before their Linears; sequence parallelism "
                             "runs Llama-like and GPT-2 stages: plan OPT without it")
        norms = [f"{layout.base}.{name}" for name in layout.norm] if self._heads else []
        return [layout.block_path(i) for i in self._blocks], norms, layout.head if self._heads else None

    def _embed(self, base: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        if self._layout.family == "llama":
            first, *after = self._layout.embed
            h = base.get_submodule(first)(tokens)
            for name in after:
                h = base.get_submodule(name)(h)
            return h
        positions = self._position_ids(tokens)
        if self._layout.family == "opt":  # positions from an all-ones mask: 0 .. T-1, offset inside embed_positions
            h = base.embed_tokens(tokens)
            if "project_in" in self._layout.embed:
                h = base.project_in(h)
            return h + base.embed_positions(torch.ones_like(tokens), 0, position_ids=positions)
        return base.drop(base.wte(tokens) + base.wpe(positions))


class _LlamaBlock:
    """One Llama-like (or OPT, without rotary tables) decoder layer called as the model's forward calls it."""

    def __init__(self, block: nn.Module, mask: Any, rotary: Any, positions: torch.Tensor):
        self.block, self.mask, self.rotary, self.positions = block, mask, rotary, positions

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        rotary = {} if self.rotary is None else {"position_embeddings": self.rotary}
        return self.block(h, attention_mask=self.mask, position_ids=self.positions, **rotary)


class _Gpt2Block:
    """One GPT-2 block called as GPT2Model.forward calls it."""

    def __init__(self, block: nn.Module, mask: Any, positions: torch.Tensor):
        self.block, self.mask, self.positions = block, mask, positions

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.block(h, None, self.mask, None, encoder_attention_mask=None, position_ids=self.positions)


def _mask_kind(config: Any, block: int) -> str:
    """The attention a block runs: ``config.layer_types`` (Qwen2), else sliding-window
    attention where the config sets a window (Mistral), else full causal attention."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[block]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _causal_masks(config: Any, h: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The masks the model's forward makes, by attention kind (None where attention is
    causal without one)."""
    import inspect

    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = dict(config=config, inputs_embeds=h, attention_mask=None, position_ids=positions)
    names = inspect.signature(create_causal_mask).parameters
    kwargs["cache" if "cache" in names else "past_key_values"] = None  # renamed in transformers 5.2x
    if "cache_position" in names:  # transformers before 5.2x
        kwargs["cache_position"] = positions[0]
    masks = {"full_attention": create_causal_mask(**kwargs)}
    if getattr(config, "sliding_window", None):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


# [Note: local attention attributes]
# A module stage runs the model's own attention, whose shape constants are attributes
# rather than graph literals ([Note: local shape constants] in runtime/parts.py is the
# same idea for fx graphs). GPT-2's ``GPT2Attention`` computes q, k and v with one
# Conv1D ``c_attn`` and cuts its output with ``split(self.split_size, dim=2)``; split
# colwise part by part ([Note: part-laid Linears] in runtime/parts.py), a rank's
# ``c_attn`` gives ``[q_r, k_r, v_r]``, each ``split_size / tp`` wide, so the attribute
# must be the local width; the heads' views read ``-1`` and ``head_dim`` and follow.
# ``embed_dim`` and ``num_heads`` become local too, as older transformers versions view
# heads with ``num_heads`` (``_split_heads``). The table names, per attention class,
# the fused projection whose colwise split makes the attributes local, the attribute
# that is its part width, and the others that shrink with it. The planner's dry run (planner.capture.module_tp
# ``BlockDryRun``) and the program (runtime.shard ``apply_tensor_parallel``) both call
# ``localise_attention``, so they run the same attention.
_HEAD_ATTRIBUTES = {
    "GPT2Attention": ("c_attn", "split_size", ("embed_dim", "num_heads")),
}
_GLOBAL_ATTRIBUTES = "hetpar_global_attributes"  # the attributes' unsplit values, kept on the module


def localise_attention(stage: nn.Module, tp_sharding: dict[str, str], tp: int,
                       tp_parts: dict[str, Any] | None = None) -> list[str]:
    """Give the attention modules of ``stage`` whose fused projection ``tp_sharding``
    splits colwise their attributes as one of ``tp`` ranks sees them, in place; see
    [Note: local attention attributes]. Applying it again with the same ``tp`` changes
    nothing (the unsplit values are kept on the module).

    Args:
        stage: a module stage (or a block) holding modules at the paths ``tp_sharding`` names.
        tp_sharding: module path -> sharding.
        tp: the tensor-parallel degree.
        tp_parts: module path -> part sizes (the plan's); given, the fused projection
            must be part-laid in parts of the attribute's width.

    Returns:
        The paths of the attention modules made local.

    Raises:
        PartError: an attribute does not divide by ``tp``, or the fused projection is
            not laid out in the parts the attention splits it into.
    """
    changed = []
    for path, module in stage.named_modules():
        spec = _HEAD_ATTRIBUTES.get(type(module).__name__)
        if spec is None:
            continue
        fused, width, others = spec
        child = f"{path}.{fused}" if path else fused
        if tp_sharding.get(child) != Sharding.COLWISE:
            continue
        unsplit = module.__dict__.setdefault(_GLOBAL_ATTRIBUTES, {n: getattr(module, n) for n in (width, *others)})
        if tp_parts is not None:
            out_features = getattr(module.get_submodule(fused), "nf", None)
            parts = tuple(int(p) for p in tp_parts.get(child, ())) or ((out_features,) if out_features else ())
            if not parts or any(p != unsplit[width] for p in parts) or (out_features and sum(parts) != out_features):
                raise PartError(f"{child} is split colwise in parts {list(parts)}, but {path} cuts it into parts "
                                f"of {unsplit[width]} ({width})", node=path)
        bad = [n for n, v in unsplit.items() if v % tp]
        if bad:
            raise PartError(f"{path}.{bad[0]} is {unsplit[bad[0]]}, which tp({tp}) does not divide", node=path)
        for name, value in unsplit.items():
            setattr(module, name, value // tp)
        changed.append(path)
    return changed


def _output_type(model: nn.Module) -> type:
    """The ModelOutput class the model's forward returns (its return annotation)."""
    import inspect

    from transformers.modeling_outputs import CausalLMOutputWithPast

    annotation = inspect.signature(type(model).forward).return_annotation
    return annotation if isinstance(annotation, type) else CausalLMOutputWithPast


def hidden_size(model: nn.Module, layout: DecoderLayout) -> int:
    """The width of the hidden states between blocks (OPT may project it before the head)."""
    return model.get_submodule(layout.base).config.hidden_size


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` under ``root``, creating plain containers on the way."""
    owner = root
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    owner.add_module(name, module)


def cut_module_stage(model: nn.Module, example_inputs: tuple, layers: tuple[int, int],
                     layer_names: list[str] | tuple[str, ...], *, recompute: str = Recompute.NONE) -> Stage | None:
    """Layers ``layers[0]..layers[1]`` of ``model`` as a module stage ([Note: stages of
    the eager model]), or None when ``model`` is not one hetpar cuts that way.

    Args:
        model: the whole model; the stage shares its modules.
        example_inputs: the model's inputs for one micro-batch (shapes of the hidden states).
        layers: first and last layer, inclusive.
        layer_names: the model's layers as the planner traced them.
        recompute: "none", "selective" or "full": each block under torch.utils.checkpoint.
    """
    layout = layout_for(model, layer_names, example_inputs)
    if layout is None:
        return None
    first, last = layers
    module = DecoderStage(model, layout, first, last, recompute=recompute)
    tokens = example_inputs[0]
    embedding = model.get_submodule(f"{layout.base}.{layout.embed[0]}")
    hidden = TensorSpec(shape=(*tokens.shape, hidden_size(model, layout)),
                        dtype=embedding.weight.dtype)
    is_last = last == len(layer_names) - 1
    return Stage(module=module, first_layer=first, last_layer=last, is_last=is_last,
                 model_inputs=(0,) if first == 0 else (), recv=() if first == 0 else (hidden,),
                 send=() if is_last else (hidden,))


__all__ = ["DecoderLayout", "DecoderStage", "cut_module_stage", "decoder_layout", "hidden_size", "layout_for",
           "localise_attention"]
