"""LayerProfile: what the cost models need to know about one layer of a model.

The planner measures these on the meta device (planner.capture); the cost models only
read them. Every quantity is per sample (batch size 1) and in fp32 bytes; the cost
models scale by micro-batch size and training dtype.

[Note: tensor-parallel scaling]
A layer's work splits into a part that tensor parallelism divides (the colwise and
rowwise Linears and the ops between them) and a part every rank repeats (norms,
residual adds). Measuring the layer once whole and once as one of 2 ranks gives both:
split = 2 * (whole - half), repeated = whole - split. At degree t a rank does
repeated + split / t. The same holds for parameters and saved activations.

[Note: sequence parallelism costs]
Under sequence parallelism (Korthikanti et al. 2022, section 4.2.2; runtime/sequence.py)
the part every tensor-parallel rank repeated (norms, dropout, residual adds) runs on
1/t of the sequence, and a colwise Linear keeps its gathered input as the rank's shard,
gathering it again in backward: all of a layer's saved activations divide by t
(measured on CPU: a block saves exactly half of one process's at t = 2; tests/
test_sequence_parallel.py). Each all-reduce becomes a reduce-scatter and an all-gather
of the same tensor, which move what a ring all-reduce moves; without recompute the
backward adds one all-gather per colwise input (per backward all-reduce); with recompute
the forward's collectives run again instead, as they do for tensor parallelism alone.
The elementwise work of the repeated part also divides by t: its flops are left out (a
small, favourable error), its memory traffic, priced from the saved bytes (compute.py's
layer time), divides, so a layer under sequence parallelism can take less time than at
tp alone and the search's bounds take the least of the two (planner/search/bounds.py).
So under recompute it holds less and moves the same
bytes, and the search takes it on every stage with t > 1 whose tokens split; without
recompute it moves more in backward, and the search weighs it against tp alone (``--sp
on`` or ``off`` pins it).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import astuple, dataclass, replace


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """One layer, per sample, fp32; see [Note: tensor-parallel scaling]."""

    name: str
    fwd_flops: float
    bwd_flops: float
    params: int
    saved_activation_bytes: float
    boundary_bytes: float  # tensors this layer hands to the next one
    num_ops: int  # graph nodes that run kernels; each costs a launch overhead
    tp_split_flops_fraction: float = 0.0  # of fwd and bwd FLOPs, divided by tp
    tp_split_params: int = 0
    tp_split_saved_bytes: float = 0.0
    # The collectives a tensor-parallel rank issues per micro-batch, as the runtime
    # issues them (planner.capture.tp_collectives.layer_collectives): (pass "forward" |
    # "backward", "all_reduce" | "all_gather", bytes of the whole tensor per sample).
    tp_collectives: tuple[tuple[str, str, float], ...] = ()
    param_tensors: int = 0  # parameter tensors this layer holds (an optimizer step pays per tensor)
    # Tensor-parallel degrees > 1 the layer's split runs at (heads divide, ...), as the
    # tracer's dry runs found; None: not checked (any degree).
    tp_degrees: tuple[int, ...] | None = None
    tp_sharded_modules: int = 0  # modules split under tensor parallelism ([Note: tensor-parallel dispatch])
    tp_sharded_tensors: int = 0  # their parameter tensors, DTensors under tensor parallelism
    # Measured alongside (planner.capture, [Note: what a kernel costs]): work that is
    # bound by memory traffic rather than by matmul throughput.
    fwd_elementwise_flops: float = 0.0  # pointwise ops, reductions, norms: one per element
    bwd_elementwise_flops: float = 0.0
    fwd_bytes_accessed: float = 0.0  # bytes the forward kernels read and write
    bwd_bytes_accessed: float = 0.0
    tied_params: int = 0  # parameters this layer uses that an earlier layer holds and counts (tied embeddings)
    # Of those, the ones tensor parallelism splits here as the earlier layer splits them
    # (a tied embedding and head, both split over the vocabulary).
    tp_split_tied_params: int = 0
    # The forward matmuls by row count and width ([Note: matmul rows] in planner.capture):
    # (rows per matmul at batch 1, whether they grow with the micro-batch, share of
    # fwd_flops, width sqrt(K N)).
    matmul_rows: tuple[tuple[int, bool, float, int], ...] = ()
    matmul_ops: int = 0  # forward ops that run FLOPs (matmuls, attention): the kernels compiling keeps
    # Mixtures of experts ([Note: the experts contract] in runtime/experts.py; measured as
    # [Note: experts in a layer] in planner/capture/moe.py says): the layer's
    # modules of experts, which expert parallelism splits ([Note: expert parallelism costs]
    # in cost_models/collectives.py).
    expert_params: int = 0  # parameters of its modules of experts
    num_experts: int = 0  # their number of experts (the gcd where modules differ); 0: none
    routed_bytes: float = 0.0  # bytes of the rows (token, choice) its experts receive, per sample, one way
    expert_flops_fraction: float = 0.0  # of fwd and bwd FLOPs, the share run inside modules of experts
    # Bytes of the keys and values the layer's attention reads, per sample (at the
    # attention call, as the model passes them): what context parallelism gathers from
    # the other ranks ([Note: context parallelism costs]). Not part of ``cost_key``: it
    # follows from the shapes the other fields already count.
    attention_kv_bytes: float = 0.0
    # Of the saved activations, the outputs of the layer's matmuls and attention, per
    # sample: what selective recompute keeps ([Note: selective recompute costs] in
    # planner/capture/measure.py). Not part of ``cost_key``.
    selective_kept_bytes: float = 0.0
    # Of the forward FLOPs, per sample, the products of two activations (a written-out
    # attention's), which selective recompute runs again in backward. Not part of ``cost_key``.
    selective_rerun_flops: float = 0.0
    # The largest single activation whose gradient backward materialises, per sample
    # (the MLP's hidden one in a transformer block): held beside the saved tensors while
    # the layer's backward runs ([Note: activations kept per micro-batch] in
    # cost_models/memory.py). Not part of ``cost_key``.
    widest_gradient_bytes: float = 0.0
    # Bytes of the outputs of the layer's attention calls, per sample: under context
    # parallelism the rank's two chunks' outputs are concatenated, a copy the layer's
    # next op saves beside the ones attention saves ([Note: context parallelism costs] in
    # cost_models/collectives.py). Not part of ``cost_key``.
    attention_out_bytes: float = 0.0

    def with_expert_load(self, factor: float) -> "LayerProfile":
        """The layer as the busiest expert-parallel rank runs it when its experts receive
        ``factor`` times the uniform share of rows ([Note: expert load] in
        cost_models/collectives.py): their FLOPs and the rows it receives times ``factor``."""
        if factor == 1.0 or not self.num_experts:
            return self
        grow = 1.0 + self.expert_flops_fraction * (factor - 1.0)
        return replace(self, fwd_flops=self.fwd_flops * grow, bwd_flops=self.bwd_flops * grow,
                       routed_bytes=self.routed_bytes * factor,
                       expert_flops_fraction=self.expert_flops_fraction * factor / grow)

    def at_context(self, cp: int) -> "LayerProfile":
        """The layer as one of ``cp`` context-parallel ranks runs it; see [Note: context
        parallelism costs]."""
        if cp == 1:
            return self
        share = 1.0 / cp
        gathered = self.attention_kv_bytes * (1.0 - share)  # the other ranks' keys and values, kept for backward
        joined = self.attention_out_bytes * share  # the two chunks' outputs concatenated, kept by the next op
        # heads split over tp, so are their keys, values and outputs
        split_gathered = gathered + joined if self.tp_split_params > 0 else 0.0
        return replace(
            self,
            fwd_flops=self.fwd_flops * share,
            bwd_flops=self.bwd_flops * share,
            saved_activation_bytes=self.saved_activation_bytes * share + gathered + joined,
            tp_split_saved_bytes=self.tp_split_saved_bytes * share + split_gathered,
            boundary_bytes=self.boundary_bytes * share,
            tp_collectives=tuple((p, kind, nbytes * share) for p, kind, nbytes in self.tp_collectives),
            fwd_elementwise_flops=self.fwd_elementwise_flops * share,
            bwd_elementwise_flops=self.bwd_elementwise_flops * share,
            fwd_bytes_accessed=self.fwd_bytes_accessed * share,
            bwd_bytes_accessed=self.bwd_bytes_accessed * share,
            matmul_rows=tuple((max(1, rows // cp), grows, flops, width) for rows, grows, flops, width in self.matmul_rows),
            routed_bytes=self.routed_bytes * share,
            selective_kept_bytes=self.selective_kept_bytes * share,
            selective_rerun_flops=self.selective_rerun_flops * share,
            widest_gradient_bytes=self.widest_gradient_bytes * share,
        )

    def flops_at(self, tp: int) -> tuple[float, float]:
        """(forward, backward) FLOPs one tensor-parallel rank runs, per sample."""
        keep = 1.0 - self.tp_split_flops_fraction * (1.0 - 1.0 / tp)
        return self.fwd_flops * keep, self.bwd_flops * keep

    def params_at(self, tp: int) -> float:
        """Parameters one tensor-parallel rank holds."""
        return self.params - self.tp_split_params * (1.0 - 1.0 / tp)

    def tied_at(self, tp: int) -> float:
        """Tied parameters (``tied_params``) one tensor-parallel rank holds a copy of."""
        return self.tied_params - self.tp_split_tied_params * (1.0 - 1.0 / tp)

    def saved_bytes_at(self, tp: int) -> float:
        """Activation bytes one tensor-parallel rank saves for backward, per sample."""
        return self.saved_activation_bytes - self.tp_split_saved_bytes * (1.0 - 1.0 / tp)

    def bytes_at(self, tp: int, micro_batch_size: int) -> tuple[float, float]:
        """(forward, backward) bytes one tensor-parallel rank's kernels move per micro-batch, fp32
        ([Note: bytes bound] in cost_models/compute.py). The trace counts one sample, the weights
        with it: the activations' bytes grow with the micro-batch and split over tp as the saved
        activations do; the weights' (read forward; read, and their gradients written, backward)
        are moved once per micro-batch, split as the parameters are."""
        whole = (self.params + self.tied_params) * 4.0
        held = (self.params_at(tp) + self.tied_at(tp)) * 4.0
        keep = self.saved_bytes_at(tp) / self.saved_activation_bytes if self.saved_activation_bytes > 0 else 1.0
        fwd = max(0.0, self.fwd_bytes_accessed - whole) * keep * micro_batch_size + min(self.fwd_bytes_accessed, held)
        bwd = max(0.0, self.bwd_bytes_accessed - 2 * whole) * keep * micro_batch_size + min(self.bwd_bytes_accessed, 2 * held)
        return fwd, bwd

    def kept_bytes_at(self, tp: int) -> float:
        """Activation bytes one tensor-parallel rank keeps under selective recompute, per
        sample, its layer input aside: the matmul and attention outputs, split over tp as
        the layer's saved activations are, and never more than those."""
        saved = self.saved_bytes_at(tp)
        if self.saved_activation_bytes <= 0:
            return 0.0
        return min(saved, self.selective_kept_bytes * saved / self.saved_activation_bytes)

    def widest_gradient_at(self, tp: int) -> float:
        """Bytes of the widest activation gradient one tensor-parallel rank holds in the
        layer's backward, per sample: ``widest_gradient_bytes`` split over tp as the
        layer's saved activations are."""
        if self.saved_activation_bytes <= 0:
            return self.widest_gradient_bytes
        return self.widest_gradient_bytes * self.saved_bytes_at(tp) / self.saved_activation_bytes

    def with_sequence_parallel(self, regather: bool = True) -> "LayerProfile":
        """The layer as a tensor-parallel rank runs it under sequence parallelism ([Note:
        sequence parallelism costs]): what every rank repeated is held as 1/tp of the
        sequence, so all its saved activations divide by tp; each all-reduce is a
        reduce-scatter and an all-gather of the same tensor; with ``regather`` (no
        recompute) the backward gathers each colwise input again, one all-gather per
        backward all-reduce."""
        if not self.tp_capable:
            return self
        collectives: list[tuple[str, str, float]] = []
        for p, kind, nbytes in self.tp_collectives:
            if kind != "all_reduce":
                collectives.append((p, kind, nbytes))
                continue
            collectives += [(p, "reduce_scatter", nbytes), (p, "all_gather", nbytes)]
            if regather and p == "backward":
                collectives.append((p, "all_gather", nbytes))
        return replace(self, tp_split_saved_bytes=self.saved_activation_bytes, tp_collectives=tuple(collectives))

    @functools.cached_property
    def cost_key(self) -> str:
        """What the layer costs, as a short key: equal for layers that cost the same
        (the blocks of a transformer), whatever their names. A profile's measured layer
        times are keyed by it ([Note: measured layers] in cost_models/compute.py)."""
        fields = astuple(replace(self, name=""))[: -len(_LATER_FIELDS)]
        if not self.num_experts:  # a dense layer keeps the key it had before experts were counted
            fields = fields[: -len(_EXPERT_FIELDS)]
        return hashlib.sha1(repr(tuple(f"{v:.6g}" if isinstance(v, float) else v for v in fields)).encode()).hexdigest()[:12]

    @property
    def tp_capable(self) -> bool:
        return self.tp_split_params > 0 or self.tp_split_tied_params > 0

    def splits_at(self, tp: int) -> bool:
        """Whether tensor parallelism of degree ``tp`` can run this layer."""
        return tp == 1 or not self.tp_capable or self.tp_degrees is None or tp in self.tp_degrees


_EXPERT_FIELDS = ("expert_params", "num_experts", "routed_bytes", "expert_flops_fraction")  # before _LATER_FIELDS
_LATER_FIELDS = ("attention_kv_bytes", "selective_kept_bytes", "selective_rerun_flops", "widest_gradient_bytes",
                 "attention_out_bytes")  # the last fields, none of them in ``cost_key``


def tp_misfit(layers, tp: int) -> LayerProfile | None:
    """The first layer that cannot be split ``tp`` ways, or None when all can."""
    return next((l for l in layers if not l.splits_at(tp)), None)


def layer_kinds(layers) -> list[int]:
    """For each layer, the index of the first layer equal to it in every field but its name: layers of
    one kind (the blocks of a transformer) cost the same on any device, so a caller times each kind once."""
    bare = [replace(l, name="") for l in layers]
    firsts: list[int] = []
    kinds = []
    for i, b in enumerate(bare):
        kind = next((j for j in firsts if bare[j] == b), None)
        if kind is None:
            firsts.append(i)
            kind = i
        kinds.append(kind)
    return kinds
