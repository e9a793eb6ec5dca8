"""Build a model without memory, then compute only some of its tensors, with the values
one ``build_model()`` gives them.

[Note: building only this rank's tensors]
Each rank of a generated program holds one stage (or a few chunks) of the model, so it
must not build the whole model: a 70B-parameter model is 280 GB in float32.

1. ``build_on_meta`` runs ``build_model()`` once under a dispatch mode that runs every
   ATen op on fake tensors (``FakeTensorMode``: a device, shape and dtype but no memory,
   so code that asks for a tensor's device sees ``cpu`` as in a real build;
   transformers skips its weight initialisation when it sees ``meta``) and logs it:
   the op, its arguments (a tensor as a view of a numbered storage), the storages it
   reads, changes and creates. A random op (``torch.Tag.nondeterministic_seeded``:
   ``uniform_``, ``normal_``, ``randn``...) also draws for real into a scratch tensor
   of the same sizes, strides and dtype, dropped at once, after the log keeps its
   generator's state. An op whose result Python reads (``.item()``, ``if mask.any()``
   in ``trunc_normal_``'s rejection loop) is run for real on its inputs, computed as
   in step 2. The model comes back with every tensor on the meta device, and the
   stages are cut from it (torch.fx, or torch.export as planning does).
2. ``materialize`` computes the tensors a rank keeps by replaying the log, without
   running the model file again. Which ops matter follows from liveness, backwards
   from the end: a storage the rank keeps is live at the end; an op that changes a
   live storage runs, for real on the CPU, and the storages it reads become live;
   a storage it creates or overwrites entirely (``normal_`` on a whole weight) is dead
   before it. Every other op is skipped. A random op that runs first sets its
   generator to the state the log kept; at the end every generator is set to where
   the whole build left it. A storage is allocated by the first op that runs on it
   and freed after the last one; a tensor the rank keeps only a shard of (tensor
   parallelism) is cut to its shard right after the last op that touches it.

Why the values equal one ``build_model()``'s, bit for bit: the ops that run are the
build's own ops on the same inputs (live storages, computed the same way), and each
random one starts from the generator state it had in the whole build, which step 1
reproduced by drawing every random op's numbers in order: how many numbers a CPU
kernel draws depends on the tensor's size, dtype and layout (``normal_`` takes another
path for contiguous tensors of 16 or more elements), never on the values it
overwrites, so the scratch twin draws what the real tensor would. Simpler schemes are
not exact: ``to_empty`` and each module's ``reset_parameters`` draw in another order
than the constructor and miss ``post_init``-style initialisation (GPT's scaled
projections, transformers' ``_init_weights``); drawing a tensor in chunks draws other
numbers than drawing it whole; building module by module and dropping the modules of
other stages is exact only for constructors that initialise each module before
building the next, which ``post_init`` does not.

Cost: step 1 draws every random number of the model (a Mersenne twister has no cheap
skip-ahead), so it takes about as long as one whole build, in the memory of one
scratch tensor (the largest tensor of the model) and a log of a few hundred bytes per
op plus 5 kB of generator state per random op. Step 2 computes only the rank's
tensors (shards under tensor parallelism) and the storages live at once while it does.

Assumptions: the model builds on the CPU (random ops draw from the CPU generator; the
program moves its stage to its device afterwards), and tensors made outside ATen ops
(a module-level constant, ``torch.tensor(data)``'s data) keep their values after
``build_on_meta``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException, DynamicOutputShapeException, FakeTensor, FakeTensorMode,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from hetpar.runtime.hf_checkpoint import HFCheckpoint, HFCheckpointError, is_hf_checkpoint
from hetpar.runtime.parts import PartLayout, layouts_of
from hetpar.runtime.shard import chunk_modules


class MaterializeError(Exception):
    """Tensors of the model cannot be computed this way; the message says why."""


class InitFromError(MaterializeError):
    """``--init-from`` does not fit the model (every rank finds it alike, before reading a tensor)."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the construction, as a view of a numbered storage."""

    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _Op:
    func: torch._ops.OpOverload
    args: tuple  # tensors as TensorRef
    kwargs: dict
    outputs: Any  # the output with its tensors as TensorRef
    reads: frozenset[int]  # storages whose values the op reads
    writes: frozenset[int]  # storages it changes or creates
    dead_before: frozenset[int]  # storages it creates or overwrites whole: their earlier values never matter
    rng: tuple[torch.Generator, torch.Tensor] | None  # a random op's generator and its state before the op


@dataclass
class Construction:
    """What ``build_model()`` did, op by op; see [Note: building only this rank's tensors].

    ``tensors`` holds every parameter, buffer and tensor attribute of the built model by
    each of its qualified names; ``rng_end`` each generator's state after the build.
    """

    ops: list[_Op] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)  # of each storage
    devices: list[torch.device] = field(default_factory=list)  # of each storage
    external: dict[int, torch.Tensor] = field(default_factory=dict)  # storages made outside the ops: a tensor on each
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    rng_end: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)

    def plan(self, keep: set[int], end: int | None = None) -> tuple[list[bool], dict[int, int]]:
        """Which of the first ``end`` ops run to compute the storages ``keep``, and the
        last op that runs on each storage (-1 for a kept storage no op runs on).
        """
        end = len(self.ops) if end is None else end
        live = set(keep)
        runs = [False] * end
        for i in range(end - 1, -1, -1):
            op = self.ops[i]
            if op.writes & live:
                runs[i] = True
                live = (live - op.dead_before) | op.reads
        last: dict[int, int] = {s: -1 for s in keep}
        for i in range(end):
            if runs[i]:
                for s in self.ops[i].reads | self.ops[i].writes:
                    last[s] = i
        return runs, last


# ----------------------------------------------------------------------------- replaying


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _give_back_freed_memory() -> None:
    """Return freed heap memory to the system (glibc's ``malloc_trim``). Once glibc has
    freed a large block it raises its mmap threshold, so later blocks of up to 32 MiB
    (scratch draws, temporaries) come from the heap, and what they free stays in the
    process until a trim gives it back, which this does after each draw
    (docs/benchmarks/memory_cpu-2core_2026-12-04.md measures it on a 1B-parameter GPT)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class _Storages:
    """The real storages of a replay: allocated on first use, freed after their last."""

    def __init__(self, log: Construction):
        self.log = log
        self.real: dict[int, torch.UntypedStorage] = {s: t.untyped_storage() for s, t in log.external.items()}

    def view(self, ref: TensorRef) -> torch.Tensor:
        if ref.storage not in self.real:
            self.real[ref.storage] = torch.UntypedStorage(self.log.nbytes[ref.storage], device=self.log.devices[ref.storage])
        t = torch.empty(0, dtype=ref.dtype, device=self.log.devices[ref.storage])
        return t.set_(self.real[ref.storage], ref.offset, ref.size, ref.stride)

    def adopt(self, ref: TensorRef, t: torch.Tensor) -> None:
        """Make ``t``, an op's output, the value of ``ref``, in the layout the log recorded."""
        storage = t.untyped_storage()
        if ref.storage in self.real and self.real[ref.storage].data_ptr() == storage.data_ptr():
            return  # an in-place op's or a view's output
        if ref.storage not in self.real and (t.storage_offset(), tuple(t.stride())) == (ref.offset, ref.stride) \
                and storage.nbytes() == self.log.nbytes[ref.storage]:
            self.real[ref.storage] = storage
        else:
            self.view(ref).copy_(t)

    def free(self, storage: int) -> None:
        if storage not in self.log.external:
            self.real.pop(storage, None)


def _replay(log: Construction, keep: set[int], end: int, on_last: Callable[[int, _Storages], None]) -> _Storages:
    """Run the ops of ``log.ops[:end]`` that compute the storages ``keep``, calling
    ``on_last(i, storages)`` after op ``i`` (and with -1 first); free every storage not in
    ``keep`` after the last op that runs on it."""
    runs, last = log.plan(keep, end)
    freed_after: dict[int, list[int]] = {}
    for s, i in last.items():
        if s not in keep:
            freed_after.setdefault(i, []).append(s)
    storages = _Storages(log)
    on_last(-1, storages)
    with torch.no_grad():
        for i in range(end):
            if not runs[i]:
                continue
            op = log.ops[i]
            if op.rng is not None:
                op.rng[0].set_state(op.rng[1])
            args, kwargs = pytree.tree_map_only(TensorRef, storages.view, (op.args, op.kwargs))
            result = op.func(*args, **kwargs)
            for ref, t in zip(pytree.tree_leaves(op.outputs), pytree.tree_leaves(result)):
                if isinstance(ref, TensorRef):
                    storages.adopt(ref, t)
            for s in freed_after.get(i, ()):
                storages.free(s)
            on_last(i, storages)
            if i in freed_after:
                _give_back_freed_memory()
    return storages


def materialize(log: Construction, names: set[str], *, local: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
                ) -> dict[str, torch.Tensor]:
    """The values of the tensors ``names`` of the model that ``log`` recorded, as one
    ``build()`` gives them; see [Note: building only this rank's tensors]. Every
    generator the build used ends where the build left it.

    Args:
        log: from ``build_on_meta(build)``.
        names: qualified names of parameters, buffers or tensor attributes of the model.
        local: for some of ``names``, what the rank keeps of the whole tensor (its
            tensor-parallel shard, as a tensor of its own); the whole tensor is freed
            as soon as the last op that touches it has run.

    Returns:
        Each name's tensor (or what ``local`` keeps of it); the names of one tensor (a
        tied weight) share one object.

    Raises:
        MaterializeError: a name is not a tensor of the model.
    """
    local = local or {}
    unknown = sorted(names - set(log.tensors))
    if unknown:
        raise MaterializeError(f"{unknown[0]} is not a parameter, buffer or tensor attribute of the model")
    refs = {name: log.tensors[name] for name in names}
    _, last = log.plan({r.storage for r in refs.values()})
    finished_at: dict[int, list[str]] = {}
    for name, ref in refs.items():
        finished_at.setdefault(last[ref.storage], []).append(name)
    whole = {ref.storage for name, ref in refs.items() if name not in local}
    values: dict[Any, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}

    def finish(i: int, storages: _Storages) -> None:
        done = finished_at.pop(i, [])
        for name in done:
            key = (refs[name], name) if name in local else refs[name]
            if key not in values:
                view = storages.view(refs[name])
                values[key] = local[name](view) if name in local else view
            out[name] = values[key]
        for s in {refs[n].storage for n in done} - whole:
            storages.free(s)
        if done:
            _give_back_freed_memory()

    _replay(log, {r.storage for r in refs.values()}, len(log.ops), finish)
    for generator, state in log.rng_end:
        generator.set_state(state)
    return out


# ----------------------------------------------------------------------------- recording


def _written_args(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments ``func`` changes (``Tensor(a!)`` in its schema)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        out += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


# In-place ops whose result does not depend on the tensor they write: applied to a whole
# storage, they make its earlier values irrelevant.
_OVERWRITES = {
    "aten::uniform_", "aten::normal_", "aten::fill_", "aten::zero_", "aten::copy_", "aten::random_",
    "aten::bernoulli_", "aten::exponential_", "aten::geometric_", "aten::cauchy_", "aten::log_normal_",
}


# Random ops that read only their input's shape and dtype, never its values.
_SHAPE_ONLY = {"aten::rand_like", "aten::randn_like", "aten::randint_like"}


def _whole(t: torch.Tensor) -> bool:
    """True if ``t`` covers all of its storage, each element once."""
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


class _Recorder(TorchDispatchMode):
    """Runs every op of a construction on fake tensors and logs it; see
    [Note: building only this rank's tensors]."""

    def __init__(self, log: Construction):
        super().__init__()
        self.log = log
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._numbers: dict[StorageWeakRef, int] = {}
        self._storages: list[torch.UntypedStorage] = []  # kept alive: a number's address is never reused
        self.generators: dict[int, torch.Generator] = {id(torch.default_generator): torch.default_generator}

    def number(self, t: torch.Tensor) -> int:
        """The number of ``t``'s storage; a storage first seen outside the ops is external."""
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in self._numbers:
            self._numbers[key] = len(self._storages)
            self._storages.append(storage)
            self.log.nbytes.append(storage.nbytes())
            self.log.devices.append(t.device)
            if not isinstance(t, FakeTensor):
                self.log.external[self._numbers[key]] = t
        return self._numbers[key]

    def ref(self, t: torch.Tensor) -> TensorRef:
        return TensorRef(self.number(t), tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        refs = {id(t): self.ref(t) for t in tensors}  # inputs first: a storage first seen here is external
        ref_args, ref_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: refs[id(t)], (args, kwargs))
        seen = len(self._storages)
        written = _written_args(func, args, kwargs)
        overwritten = {refs[id(t)].storage for t in written[:1] if func._schema.name in _OVERWRITES and _whole(t)}
        reads = frozenset(r.storage for r in refs.values()) - overwritten
        rng = self._draw(func, ref_args, ref_kwargs, reads) if torch.Tag.nondeterministic_seeded in func.tags else None
        try:
            with self.fake:
                out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self._run_for_real(func, ref_args, ref_kwargs)
        out_refs = pytree.tree_map_only(torch.Tensor, self.ref, out)
        created = {r.storage for r in pytree.tree_leaves(out_refs) if isinstance(r, TensorRef) and r.storage >= seen}
        self.log.ops.append(_Op(
            func=func, args=ref_args, kwargs=ref_kwargs, outputs=out_refs, reads=reads,
            writes=frozenset({refs[id(t)].storage for t in written} | created),
            dead_before=frozenset(created | overwritten), rng=rng,
        ))
        return out

    def _draw(self, func, ref_args: tuple, ref_kwargs: dict, reads: frozenset[int]) -> tuple[torch.Generator, torch.Tensor]:
        """Keep the state of a random op's generator, then draw what the op draws in a
        whole build, into scratch tensors; inputs it reads (``bernoulli``'s
        probabilities: the count of draws may depend on them) are computed from the log."""
        generator = ref_kwargs.get("generator") or torch.default_generator
        self.generators[id(generator)] = generator
        rng = (generator, generator.get_state())
        values = set() if func._schema.name in _SHAPE_ONLY else set(reads)
        real = self._real(values)

        def arg(ref: TensorRef) -> torch.Tensor:
            if ref.storage in values:
                return real.view(ref)
            return torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype, device=self.log.devices[ref.storage])

        func(*pytree.tree_map_only(TensorRef, arg, ref_args), **pytree.tree_map_only(TensorRef, arg, ref_kwargs))
        del real
        _give_back_freed_memory()
        return rng

    def _real(self, storages: set[int]) -> _Storages:
        """The storages computed from the log so far, every generator left as it was."""
        if not storages - set(self.log.external):
            return _Storages(self.log)
        saved = [(g, g.get_state()) for g in self.generators.values()]
        real = _replay(self.log, storages, len(self.log.ops), lambda i, s: None)
        for generator, state in saved:
            generator.set_state(state)
        return real

    def _run_for_real(self, func, ref_args, ref_kwargs) -> Any:
        """Run an op whose result Python reads on the real values of its inputs, computed
        from the log so far; its tensors come back fake."""
        inputs = {r.storage for r in pytree.tree_leaves((ref_args, ref_kwargs)) if isinstance(r, TensorRef)}
        real = self._real(inputs)
        args, kwargs = pytree.tree_map_only(TensorRef, real.view, (ref_args, ref_kwargs))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, self.fake.from_tensor, out)


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter, buffer and tensor attribute of ``model`` by each of its qualified names."""
    out = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for slots in (module._parameters, module._buffers, vars(module)):
            for name, t in slots.items():
                if isinstance(t, torch.Tensor):
                    out.append((f"{prefix}.{name}" if prefix else name, t))
    return out


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, Construction]:
    """``build()`` with every tensor on the meta device, and the log of its construction
    ([Note: building only this rank's tensors]). The random generators end where
    ``build()`` leaves them.
    """
    log = Construction()
    recorder = _Recorder(log)
    with recorder:
        model = build()
    log.tensors = {name: recorder.ref(t) for name, t in named_tensors(model)}
    log.rng_end = [(g, g.get_state()) for g in recorder.generators.values()]
    _to_meta(model)
    return model, log


def _to_meta(model: nn.Module) -> None:
    """Replace the fake tensors of ``model`` by meta tensors of the same shapes (ties kept)."""
    meta: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for slots in (module._parameters, module._buffers, vars(module)):
            for name, t in list(slots.items()):
                if isinstance(t, FakeTensor):
                    if id(t) not in meta:
                        m = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
                        meta[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
                    slots[name] = meta[id(t)]


# ----------------------------------------------------------------------------- a rank's stages


@dataclass(frozen=True)
class _Slot:
    """Where a stage module keeps one tensor: ``slots[attr]`` of a module, by the tensor's
    qualified name in the model."""

    slots: dict
    attr: str
    name: str
    tensor: torch.Tensor


def _meta_slots(module: nn.Module) -> list[_Slot]:
    """The tensors of ``module`` still on the meta device (a DTensor whose shard is), by
    their qualified names: a stage keeps the model's names."""
    out = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for slots in (sub._parameters, sub._buffers, vars(sub)):
            for attr, t in slots.items():
                if isinstance(t, torch.Tensor) and (t.to_local() if isinstance(t, DTensor) else t).is_meta:
                    out.append(_Slot(slots, attr, f"{prefix}.{attr}" if prefix else attr, t))
    return out


def materialize_stages(model: nn.Module, module: nn.Module, log: Construction, device: torch.device | None = None, *,
                       init_from: Path | None = None, keep_unused: bool = False) -> None:
    """Give this rank's stages their tensors, in place, on ``device``: as one
    ``build_model()`` gives them ([Note: building only this rank's tensors]), or read
    from ``init_from``.

    Each stage module cut from ``model`` (``build_on_meta``'s) holds meta tensors at the
    model's qualified names; a tensor-parallel one (``apply_tensor_parallel`` on the
    meta stage) a DTensor, which gets only this rank's shard. Collective when the
    process group is up: every rank reports the tensors its stages hold.

    Args:
        model: the whole model on the meta device; modules the stages share see the
            new tensors.
        module: this rank's stage, or its chunks (``runtime.shard.rank_module``).
        log: ``build_on_meta``'s log of ``model``.
        device: where the stage's tensors go (default: the CPU).
        init_from: a whole state_dict saved by ``torch.save`` (read through mmap: only
            this rank's tensors are read), a ``torch.distributed.checkpoint``
            directory of one (only this rank's shards are read), or a Hugging Face
            checkpoint directory (safetensors: only this rank's slices are read, [Note:
            Hugging Face checkpoints] in runtime/hf_checkpoint.py); tensors the state_dict
            lacks (non-persistent buffers) come from the build.
        keep_unused: also materialise, in ``model``, the state_dict entries no rank's
            stage holds (a parameter no layer uses), as the rank that writes
            ``--save-final`` needs (on the CPU).

    Raises:
        MaterializeError: a stage holds a meta tensor the model does not name (a
            constant of an exported graph); ``InitFromError``: ``init_from`` does not
            fit the model.
    """
    slots = [slot for chunk in chunk_modules(module) for slot in _meta_slots(chunk)]
    anonymous = sorted({slot.name for slot in slots} - set(log.tensors))
    if anonymous:
        raise MaterializeError(f"the stage holds {anonymous[0]}, which the model's construction does not make; "
                               f"make it a buffer of the module that uses it")
    keys = list(model.state_dict().keys())
    unused = _unused(slots, keys) if keep_unused or dist.is_initialized() else set()
    extra = [slot for slot in _meta_slots(model) if slot.name in unused] if keep_unused else []
    source = _Source(init_from, keys, model) if init_from is not None else None
    layouts = {name: layout for chunk in chunk_modules(module) for name, layout in layouts_of(chunk).items()}
    local = {slot.name: partial(_rows_of, slot.tensor, layouts[slot.name]) if slot.name in layouts
             else partial(_shard_of, slot.tensor) for slot in slots if isinstance(slot.tensor, DTensor)}
    names = {slot.name for slot in slots + extra}
    values = materialize(log, names - source.names if source else names, local=local)
    if source is not None:
        values.update(source.read(names & source.names, local, {slot.name: slot.tensor for slot in slots + extra},
                                  whole=set(layouts)))
    _place(slots, values, device)
    _place(extra, values, None)
    if device is not None:
        module.to(device)  # a tensor the model file made outside the ops (never on meta) too


def _unused(slots: list[_Slot], keys: list[str]) -> set[str]:
    """The state_dict keys no rank's stage holds (collective when the process group is up)."""
    held = [{slot.name for slot in slots}]
    if dist.is_initialized():
        held = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(held, {slot.name for slot in slots})
    return set(keys) - set().union(*held)


def _shard_of(like: DTensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, as ``distribute_tensor`` cuts it for ``like``'s placements."""
    shard = distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return shard.clone() if shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() else shard


def _rows_of(like: DTensor, layout: PartLayout, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a part-laid tensor ``full`` (the user's layout): its slice of
    every part ([Note: part-laid Linears] in runtime/parts.py)."""
    return layout.of_rank(full, like.device_mesh.get_local_rank())


def _place(slots: list[_Slot], values: dict[str, torch.Tensor], device: torch.device | None) -> None:
    """Put each value into its slot: a parameter stays a parameter, a DTensor a DTensor
    (with the value as its shard); the names of one tensor get one object."""
    made: dict[tuple[int, int], torch.Tensor] = {}
    for slot in slots:
        value = values[slot.name]
        key = (id(value), id(slot.tensor) if isinstance(slot.tensor, DTensor) else 0)
        if key not in made:
            value = value.to(device) if device is not None else value
            if isinstance(slot.tensor, DTensor):
                value = DTensor.from_local(value, slot.tensor.device_mesh, slot.tensor.placements, run_check=False,
                                           shape=slot.tensor.shape, stride=slot.tensor.stride())
            if isinstance(slot.tensor, nn.Parameter):
                value = nn.Parameter(value, requires_grad=slot.tensor.requires_grad)
            made[key] = value
        slot.slots[slot.attr] = made[key]


class _Source:
    """A whole state_dict to start from: a ``torch.save`` file, a DCP directory or a
    Hugging Face checkpoint directory."""

    def __init__(self, path: Path, keys: list[str], model: nn.Module):
        self.path = Path(path)
        self.names = set(keys)
        self.hf = None
        if is_hf_checkpoint(self.path):
            try:
                self.hf = HFCheckpoint(self.path, model)
            except HFCheckpointError as exc:
                raise InitFromError(str(exc)) from None
            return
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if self.path.is_dir():
            metadata = dcp.FileSystemReader(str(self.path)).read_metadata().state_dict_metadata
            found = {k: tuple(m.size) for k, m in metadata.items() if hasattr(m, "size")}
            self.state = None
        else:
            self.state = torch.load(self.path, map_location="cpu", weights_only=True, mmap=True)
            found = {k: tuple(v.shape) for k, v in self.state.items()}
        missing = [k for k in keys if k not in found]
        unexpected = [k for k in found if k not in shapes]
        wrong = [k for k in keys if k in found and found[k] != shapes[k]]
        if missing or unexpected or wrong:
            what = (f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, which the model lacks" if unexpected
                    else f"has {wrong[0]} of shape {list(found[wrong[0]])}, the model's is {list(shapes[wrong[0]])}")
            raise InitFromError(f"--init-from {self.path} is not a state_dict of this model: it {what}")

    def read(self, names: set[str], local: dict[str, Callable], like: dict[str, torch.Tensor], *,
             whole: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (shards where ``local`` says), reading only those; the
        names of one tensor of the model (``like``: its meta tensor) get one object.
        From a DCP directory, the ``whole`` names (part-laid) are read whole, then cut."""
        if self.hf is not None:
            return self.hf.read(names, local, like, whole=whole)
        first: dict[int, str] = {}
        for n in sorted(names):
            first.setdefault(id(like[n]), n)
        if self.state is not None:  # mmap: only what is touched is read
            got = {n: local[n](self.state[n]) if n in local else self.state[n] for n in first.values()}
        else:
            sharded = {n for n in local if n not in whole}
            got = {n: torch.empty(tuple(like[n].shape), dtype=like[n].dtype) if n in whole
                   else torch.empty_like(like[n].to_local() if n in sharded else like[n], device="cpu") for n in first.values()}
            dcp.load({n: DTensor.from_local(t, like[n].device_mesh, like[n].placements, run_check=False,
                                            shape=like[n].shape, stride=like[n].stride()) if n in sharded else t
                      for n, t in got.items()}, checkpoint_id=str(self.path))
            got = {n: local[n](t) if n in whole and n in local else t for n, t in got.items()}
        return {n: got[first[id(like[n])]] for n in names}


__all__ = ["Construction", "InitFromError", "MaterializeError", "TensorRef", "build_on_meta", "materialize", "materialize_stages", "named_tensors"]
