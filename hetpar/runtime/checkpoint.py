"""Periodic checkpoints with torch.distributed.checkpoint, written atomically, and resume.

[Note: checkpoint layout]
``--checkpoint-dir DIR`` holds one directory per checkpoint, ``DIR/step-00000040``:

- DCP's files (``.metadata`` and each rank's ``__<rank>_<n>.distcp``): the model's
  state_dict and the optimizer's, both keyed by parameter name (the optimizer's
  flattened, ``state.blocks.0.attn.q.weight.exp_avg``), from
  ``torch.distributed.checkpoint.state_dict.get_state_dict``; stages write disjoint
  keys, replicas the same keys (DCP stores one copy), tensor-parallel and FSDP shards
  their own pieces. Beside them ``train``: the step, and the loss scaler's state.
- ``rng-<rank>.pt``: each rank's torch RNG state (dropout continues identically).
- ``hetpar-checkpoint.json``: the marker, written last: step, world size, the model's
  signature (``model_signature``), the run's optimizer, seed and global batch size, and
  the size and sha256 of every other file.

Keys are the model's own parameter names whatever the plan, so any plan of the same
model can load a checkpoint ([Note: resharding resume]).

[Note: atomic checkpoints]
Every rank writes into ``DIR/.tmp-step-00000040``: DCP's files (fsynced by DCP), then
its RNG file. Each rank hashes the files it wrote; rank 0 gathers the hashes, writes
the marker, fsyncs it and the directory, and renames the directory to
``step-00000040`` (one atomic rename), then fsyncs DIR. A crash at any point before
the rename leaves only a ``.tmp-`` directory, which is never read and is removed by
the next run; so a checkpoint that is visible is complete. Old checkpoints beyond
``--checkpoint-keep`` are renamed to ``.trash-`` before they are deleted, for the
same reason. On several hosts DIR must be one shared file system.

[Note: resume]
At start every rank takes part in choosing a checkpoint: rank 0 lists the complete
ones (a marker that parses), newest first, and broadcasts the list. For the newest,
every rank re-hashes its share of the files (file i goes to rank i mod world size) and
the verdicts are gathered; a missing file or a wrong size or hash means corruption,
and rank 0 says on stderr which file is wrong and which checkpoint it falls back to.
The first intact one is loaded into the stage module and optimizer
(``set_state_dict``), the RNG state restored when the world size is unchanged, and
the run continues after its step. Data needs no state: batches are a function of
the seed and the step (see [Note: data order and sharding] in runtime/shard.py).
If checkpoints exist but none is intact, the program stops rather than silently
train from scratch.

[Note: resharding resume]
A checkpoint is loaded by the program of any plan of the same model: other dp, tp, pp,
ZeRO stage, schedule or device types. Its keys are the whole model's parameter names
(``blocks.0.attn.q.weight``; a rank's interleaved chunks are saved without the chunk
number ``Chunks`` puts in front, see ``_checkpoint_key``), and DCP stores each tensor
as one global tensor, whatever the shards that wrote it; each rank reads the pieces its
own shards cover (a tensor-parallel slice, an FSDP row block, a whole replica). What
is exact: parameters, optimizer state (AdamW's moments and step count), the step, the
loss scale, and so the data position; the run continues as the uninterrupted one
would. Before loading, the checkpoint must fit (``_check_fits``): the model signature
in its marker (every state_dict key, shape and dtype of the whole model) must be this
model's, it must have been written with the same optimizer, and it must hold every
tensor this rank's shards need; otherwise the program stops with one line. So it does
when the loop options its marker records (the learning-rate schedule, ``--clip-grad-norm``,
``--weight-decay``: ``training.loop_record``) are not this run's: its line names each one
that differs, rather than the recorded ones silently winning ([Note: learning-rate
schedule] in runtime/training.py). A seed or
global batch size unlike the checkpoint's run is allowed (a re-plan may change the
batch) and reported: the data from the next step on then differs from an uninterrupted
run's. Not exact across layouts: the RNG streams (restored only at an unchanged world
size; dropout masks differ anyway between layouts) and PowerSGD's error feedback,
which is not saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from hetpar.runtime.parts import PartLayout, layouts_of
from hetpar.runtime.precision import LossScaler
from hetpar.runtime.shard import Chunks

MARKER = "hetpar-checkpoint.json"
_NAME = re.compile(r"^step-(\d{8})$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(Exception):
    """No checkpoint in the directory can be resumed from; the message says what to do."""


@dataclass(frozen=True, kw_only=True)
class Found:
    """A complete checkpoint: its directory and its marker."""

    path: Path
    step: int
    marker: dict[str, Any]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _say(message: str) -> None:
    if _rank() == 0:
        print(f"hetpar: {message}", file=sys.stderr, flush=True)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_complete(directory: Path) -> list[Found]:
    """The checkpoints in ``directory`` whose marker parses, newest first; a ``.tmp-``
    directory (a write that never finished) is never one of them."""
    found = []
    if not directory.is_dir():
        return found
    for child in directory.iterdir():
        match = _NAME.match(child.name)
        if not match or not child.is_dir():
            continue
        try:
            marker = json.loads((child / MARKER).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and marker.get("step") == int(match[1]) and isinstance(marker.get("files"), dict):
            found.append(Found(path=child, step=int(match[1]), marker=marker))
    return sorted(found, key=lambda f: f.step, reverse=True)


def verify(found: Found) -> str | None:
    """Check the files of a checkpoint against its marker, this rank's share of them
    (collective); see [Note: resume].

    Returns:
        None when intact, else what is wrong (one line), the same on every rank.
    """
    names = sorted(found.marker["files"])
    problems = []
    for i, name in enumerate(names):
        if i % _world() != _rank():
            continue
        expected = found.marker["files"][name]
        path = found.path / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {expected['bytes']}")
        elif sha256_file(path) != expected["sha256"]:
            problems.append(f"{name} fails its sha256 check")
    every = sorted({p for part in _gather(problems) for p in part})
    return "; ".join(every) if every else None


# ----------------------------------------------------------------------------- what a checkpoint holds


def model_signature(model: nn.Module) -> dict[str, Any]:
    """The identity of a model for checkpoints: how many state_dict tensors it has and the
    sha256 of every key with its shape and dtype (meta, sharded or real tensors alike:
    a DTensor counts with its global shape)."""
    digest = hashlib.sha256()
    shapes = _shapes(model)
    for key, (shape, dtype) in sorted(shapes.items()):
        digest.update(f"{key}:{list(shape)}:{dtype}\n".encode())
    return {"tensors": len(shapes), "sha256": digest.hexdigest()}


def _shapes(model: nn.Module) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in model.state_dict().items()}


def saved_tensors(found: Found) -> dict[str, tuple[int, ...] | None]:
    """Every key DCP stored in a checkpoint (``model.blocks.0.attn.q.weight``,
    ``optim.state....exp_avg``, ``train.step``) with its global shape (None for non-tensors)."""
    metadata = dcp.FileSystemReader(found.path).read_metadata()
    return {
        key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
        for key, md in metadata.state_dict_metadata.items()
    }


def other_model(found: Found, model: nn.Module) -> str | None:
    """Why the checkpoint was not written for ``model`` (one phrase), or None when it was:
    its marker's signature, or, for a marker without one, its tensors' names and shapes."""
    signature = found.marker.get("model")
    if signature is not None and signature == model_signature(model):
        return None
    mine = {k: shape for k, (shape, _) in _shapes(model).items()}
    theirs = {k.removeprefix("model."): v for k, v in saved_tensors(found).items() if k.startswith("model.")}
    foreign = [k for k in theirs if k not in mine]
    if foreign:
        return f"its tensor {foreign[0]} is not this model's ({len(foreign)} of its {len(theirs)} are not)"
    reshaped = [k for k in theirs if theirs[k] != mine[k]]
    if reshaped:
        k = reshaped[0]
        return f"its {k} is {list(theirs[k])}, this model's {list(mine[k])}"
    if signature is None:
        return None
    lacking = [k for k in mine if k not in theirs]
    if lacking and signature.get("tensors") != len(mine):
        return f"it has {signature.get('tensors')} tensors, this model {len(mine)} (it lacks {lacking[0]})"
    return f"its tensors' dtypes or names differ (signature {signature.get('sha256', '?')[:12]}, this model's " \
           f"{model_signature(model)['sha256'][:12]})"


def resume_point(directory: Path, model: nn.Module) -> Found | None:
    """The checkpoint a program of any plan of ``model`` would resume from: the newest
    complete one whose files are all there with their recorded sizes (the program also
    checks their hashes, and falls back further if one fails). Not collective.

    Returns:
        None when ``directory`` holds no checkpoint.

    Raises:
        CheckpointError: the newest such checkpoint was written for another model.
    """
    for found in list_complete(Path(directory)):
        files = found.marker["files"]
        if all((found.path / n).is_file() and (found.path / n).stat().st_size == f["bytes"] for n, f in files.items()):
            reason = other_model(found, model)
            if reason is not None:
                raise CheckpointError(f"checkpoint {found.path} was written for another model: {reason}")
            return found
    return None


def _checkpoint_key(key: str, chunked: bool, optimizer: bool) -> str:
    """The key a state_dict entry is saved under: the module's own, except that the
    ``Chunks`` of an interleaved rank put a chunk number in front of each parameter name
    (``0.blocks.0.w``, optimizer ``state.0.blocks.0.w.exp_avg``), which is dropped so the
    key is the model's name whatever the plan ([Note: resharding resume])."""
    if not chunked:
        return key
    parts = key.split(".")
    drop = 1 if optimizer else 0  # optimizer keys start with "state." or "param_groups."
    return ".".join(parts[:drop] + parts[drop + 1:])


def _renamed(state: dict[str, Any], chunked: bool, optimizer: bool) -> dict[str, Any]:
    return {_checkpoint_key(k, chunked, optimizer): v for k, v in state.items()}


class Checkpointer:
    """Saves every ``every`` steps (and at the last step) into ``directory``, keeping the
    newest ``keep``; resumes from the newest intact one. Without a directory it does
    nothing. See [Note: checkpoint layout], [Note: atomic checkpoints], [Note: resume].
    """

    def __init__(self, directory: Path | None, *, every: int, keep: int, model: nn.Module | None = None,
                 run: dict[str, Any] | None = None):
        """Args:
            directory: where checkpoints go; None: checkpointing is off.
            every: steps between checkpoints. keep: newest checkpoints kept.
            model: the whole model (meta or real): its signature goes into every marker
                and a checkpoint of another model is refused ([Note: resharding resume]).
            run: what the data and the optimizer state depend on, e.g.
                ``{"optimizer": "adamw", "seed": 0, "global_batch_size": 8}``, recorded
                in every marker and compared on resume.
        """
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every({every}) and keep({keep}) must be >= 1")
        self.directory = Path(directory) if directory is not None else None
        self.every = every
        self.keep = keep
        self.model = model
        self.signature = model_signature(model) if model is not None and directory is not None else None
        self.run = dict(run or {})

    @classmethod
    def for_run(cls, args: Any, model: nn.Module, global_batch_size: int, *, loop: dict[str, Any] | None = None
                ) -> Checkpointer:
        """The checkpointer of a program's run: ``args`` (runtime.cli.TrainArgs) gives the
        directory, ``every`` and ``keep``, and the optimizer and seed its markers record;
        with them, ``loop``: the loop options a resume must share (``training.loop_record``:
        learning-rate schedule, clipping, weight decay)."""
        run = {"optimizer": args.optimizer, "seed": args.seed, "global_batch_size": global_batch_size}
        return cls(args.checkpoint_dir, every=args.checkpoint_every, keep=args.checkpoint_keep, model=model,
                   run=run | ({"loop": loop} if loop is not None else {}))

    # ------------------------------------------------------------------ resume

    def restore(self, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler | None = None) -> int:
        """Load the newest intact checkpoint (collective); ``scaler`` (fp16 plans) gets the
        loss scaler's state, which a program without one leaves unread.

        Returns:
            The step it was taken after; 0 when there is none (a fresh start).

        Raises:
            CheckpointError: checkpoints exist but every one is corrupt.
        """
        if self.directory is None:
            return 0
        if _rank() == 0:
            self._remove_leftovers()
        candidates = _broadcast(list_complete(self.directory) if _rank() == 0 else None)
        for i, found in enumerate(candidates):
            problem = verify(found)
            if problem is None:
                self._check_fits(found, module, optimizer)
                self._load(found, module, optimizer, scaler or LossScaler(enabled=False))
                _say(f"resuming from {found.path} (step {found.step})")
                return found.step
            fallback = str(candidates[i + 1].path) if i + 1 < len(candidates) else "nothing"
            _say(f"checkpoint {found.path} is corrupt ({problem}); falling back to {fallback}")
        if candidates:
            raise CheckpointError(
                f"every checkpoint in {self.directory} is corrupt; move them away to start from step 0"
            )
        return 0

    def resume(self, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler | None = None) -> int:
        """``restore``, for the program: where no checkpoint can be resumed from (another
        model's, one without tensors this plan needs, all corrupt), rank 0 says why in one
        line, every rank leaves the process group and exits with code 2 (collective)."""
        try:
            return self.restore(module, optimizer, scaler)
        except CheckpointError as exc:
            _say(str(exc))
            if dist.is_initialized():
                dist.destroy_process_group()
            raise SystemExit(2) from None

    def _check_fits(self, found: Found, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Raise CheckpointError unless ``found`` is this model's, written with this
        optimizer, and holds every tensor this rank needs (collective; the same verdict on
        every rank). See [Note: resharding resume]."""
        problem = None
        if self.model is not None and _rank() == 0:
            reason = other_model(found, self.model)
            if reason is not None:
                problem = f"checkpoint {found.path} was written for another model: {reason}; give --checkpoint-dir " \
                          "a directory of this model's checkpoints (or an empty one to start from step 0)"
        theirs = found.marker.get("run", {})
        if problem is None and "optimizer" in theirs and "optimizer" in self.run and theirs["optimizer"] != self.run["optimizer"]:
            problem = f"checkpoint {found.path} was written with --optimizer {theirs['optimizer']}, whose state " \
                      f"--optimizer {self.run['optimizer']} cannot take; resume with --optimizer {theirs['optimizer']}"
        if problem is None:
            problem = _other_loop(found, theirs.get("loop"), self.run.get("loop"))
        problem = _broadcast(problem)
        if problem is None:
            problem = self._missing(found, module, optimizer)
        if problem is not None:
            raise CheckpointError(problem)
        changed = [f"{k} {self.run[k]} (the checkpoint's run: {theirs[k]})" for k in ("global_batch_size", "seed")
                   if k in theirs and k in self.run and theirs[k] != self.run[k]]
        if changed:
            _say(f"continuing {found.path} with {', '.join(changed)}: the data from step {found.step + 1} on differs "
                 "from an uninterrupted run's")

    def _missing(self, found: Found, module: nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
        """The tensors this rank's shards need that the checkpoint lacks, over every rank
        (collective): one line, or None."""
        saved = saved_tensors(found)
        model_state, optim_state = self._state(module, optimizer)
        wanted = [f"model.{k}" for k in model_state] + [f"optim.{k}" for k in optim_state if k.startswith("state.")]
        lacking = [k for k in wanted if k not in saved]
        every = sorted({k for part in _gather(lacking) for k in part})
        if not every:
            return None
        return f"checkpoint {found.path} lacks {len(every)} of the tensors this plan needs (first: {every[0]}); " \
               "it was written by another model or program: give --checkpoint-dir this model's checkpoints"

    def _state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """The module's and optimizer's state dicts under their checkpoint keys
        (``_checkpoint_key``), part-laid tensors in the user's layout ([Note: part-laid
        checkpoints])."""
        model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
        layouts = layouts_of(module)
        for state, optimizer_keys in ((model_state, False), (optim_state, True)):
            for k, layout in _part_laid(state, layouts, optimizer_keys).items():
                state[k] = _in_order(state[k], layout.to_user)
        chunked = isinstance(module, Chunks)
        return _renamed(model_state, chunked, optimizer=False), _renamed(optim_state, chunked, optimizer=True)

    def _load(self, found: Found, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
        model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
        layouts = layouts_of(module)
        user = {}  # [Note: part-laid checkpoints]: read in the user's layout, then put in the rank's
        for state, optimizer_keys in ((model_state, False), (optim_state, True)):
            for k, layout in _part_laid(state, layouts, optimizer_keys).items():
                user[k] = (state[k], layout)
                state[k] = _in_order(state[k], lambda t: t)
        chunked = isinstance(module, Chunks)
        state = {"model": _renamed(model_state, chunked, optimizer=False),
                 "optim": _renamed(optim_state, chunked, optimizer=True),
                 "train": {"step": 0, "loss_scaler": scaler.state_dict()}}
        dcp.load(state, checkpoint_id=found.path, no_dist=not dist.is_initialized())
        placed = {}  # part-laid tensors, put back in the rank's layout
        for k, (param, layout) in user.items():
            optimizer_key = k.startswith(("state.", "param_groups."))
            loaded = state["optim" if optimizer_key else "model"][_checkpoint_key(k, chunked, optimizer_key)]
            with torch.no_grad():
                param.to_local().copy_(_in_order(loaded, layout.from_user).to_local())
            placed[k] = param
        # DCP loads tensors in place and replaces other values; either way read them back under the module's keys,
        # but the part-laid ones as just placed (what DCP read is in the user's layout)
        model_state = {k: placed.get(k, state["model"][_checkpoint_key(k, chunked, False)]) for k in model_state}
        optim_state = {k: placed.get(k, state["optim"][_checkpoint_key(k, chunked, True)]) for k in optim_state}
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=_OPTIONS)
        scaler.load_state_dict(state["train"]["loss_scaler"])
        rng = found.path / f"rng-{_rank()}.pt"
        if found.marker.get("world_size") == _world() and rng.is_file():
            states = torch.load(rng, weights_only=True)
            torch.set_rng_state(states["cpu"])
            if "cuda" in states and torch.cuda.is_available():
                torch.cuda.set_rng_state(states["cuda"])

    def _remove_leftovers(self) -> None:
        for child in self.directory.iterdir() if self.directory.is_dir() else ():
            if child.name.startswith((".tmp-step-", ".trash-step-")):
                shutil.rmtree(child, ignore_errors=True)

    # ------------------------------------------------------------------ save

    def due(self, step: int, last: bool) -> bool:
        return self.directory is not None and (step % self.every == 0 or last)

    def maybe_save(self, step: int, module: nn.Module, optimizer: torch.optim.Optimizer,
                   scaler: LossScaler | None = None, *, last: bool = False, copy: bool = False) -> None:
        """Save after ``step`` when it is due (collective); see [Note: atomic checkpoints].
        Without ``scaler`` (a plan without fp16) the checkpoint holds a disabled scaler's
        state, as before, so any plan of the model can resume it. A ``copy`` rank writes no
        tensors: its replica holds what another replica of its stage writes, laid out
        otherwise (replicas of different tensor-parallel degrees, whose pieces DCP cannot
        merge: [Note: replicas of different degrees] in runtime/mixed_sync.py)."""
        if not self.due(step, last):
            return
        scaler = scaler or LossScaler(enabled=False)
        tmp = self.directory / f".tmp-{step_dir_name(step)}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_state, optim_state = self._state(module, optimizer)
        if copy:
            model_state, optim_state = {}, {k: v for k, v in optim_state.items() if not k.startswith("state.")}
        state = {"model": model_state, "optim": optim_state, "train": {"step": step, "loss_scaler": scaler.state_dict()}}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=not dist.is_initialized())
        mine = self._write_rng(tmp)
        hashed = {}
        for part in _gather(mine):
            hashed.update(part)
        if _rank() == 0:
            self._publish(tmp, step, hashed)
        _barrier()

    def _write_rng(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """Write this rank's RNG file and hash the files this rank wrote."""
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state()
        rng = tmp / f"rng-{_rank()}.pt"
        with open(rng, "wb") as f:
            torch.save(states, f)
            f.flush()
            os.fsync(f.fileno())
        mine = [rng, *tmp.glob(f"__{_rank()}_*")]
        return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in mine}

    def _publish(self, tmp: Path, step: int, hashed: dict[str, dict[str, Any]]) -> None:
        for path in tmp.iterdir():  # .metadata, and anything DCP wrote under another name
            if path.name not in hashed and path.is_file():
                hashed[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        marker = {"step": step, "world_size": _world(), "model": self.signature, "run": self.run,
                  "files": dict(sorted(hashed.items()))}
        with open(tmp / MARKER, "w") as f:
            json.dump(marker, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = self.directory / step_dir_name(step)
        if final.exists():  # saved again after resuming from an earlier step (this one was corrupt)
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        for old in list_complete(self.directory)[self.keep:]:
            _discard(old.path)


def _other_loop(found: Found, theirs: dict[str, Any] | None, mine: dict[str, Any] | None) -> str | None:
    """Why this run cannot continue ``found``'s loop (one line), or None: its learning-rate
    schedule, clipping or weight decay differ ([Note: learning-rate schedule] in
    runtime/training.py). A checkpoint that records none (written before they were options)
    fits any."""
    if theirs is None or mine is None or theirs == mine:
        return None
    differ = [k for k in sorted(set(theirs) | set(mine)) if theirs.get(k) != mine.get(k)]
    options = ", ".join(f"--{k.replace('_', '-')} {theirs.get(k, 'unset')} (this run: {mine.get(k, 'unset')})"
                        for k in differ)
    return f"checkpoint {found.path} was written with {options}; a resumed run continues the loop it began (the " \
           f"schedule is a function of the step): resume with the checkpoint's options, or give --checkpoint-dir " \
           f"an empty directory to start from step 0"


# [Note: part-laid checkpoints]
# A part-laid tensor's DTensor holds its rows in rank-major order ([Note: part-laid
# Linears] in runtime/parts.py), which DCP would store as they are: not the user's
# tensor, and not what another tensor-parallel degree reads. So a checkpoint stores it
# in the user's layout: at save the full tensor is gathered in the tensor-parallel group,
# put in the user's row order and cut again as the same placements cut it (each rank
# keeps the user's rows ``Shard(0)`` gives it; a Conv1D weight's columns, ``Shard(1)``:
# ``PartLayout.dim``); at load, the reverse. Parameters and the
# optimizer state of their shape (AdamW's moments, momentum) alike. The price is one
# all-gather of each part-laid tensor per save and load; the checkpoint then holds the
# model's own tensors, and [Note: resharding resume] holds as for any other.


def _part_laid(state: dict[str, Any], layouts: dict[str, PartLayout], optimizer: bool) -> dict[str, PartLayout]:
    """The keys of ``state`` (a model's or a flattened optimizer's) that hold part-laid tensors."""
    out = {}
    for k, v in state.items():
        name = k.removeprefix("state.").rpartition(".")[0] if optimizer else k
        if optimizer and not k.startswith("state."):
            continue
        layout = layouts.get(name)
        if layout is not None and isinstance(v, DTensor) and v.dim() > layout.dim \
                and v.shape[layout.dim] == sum(layout.parts):
            out[k] = layout
    return out


def _in_order(t: DTensor, order) -> DTensor:
    """A new DTensor of ``t``'s placements holding ``order(t.full_tensor())``."""
    return distribute_tensor(order(t.full_tensor()), t.device_mesh, t.placements, src_data_rank=None)


def _discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of sight first, so that a crash midway
    never leaves a checkpoint with files missing under its real name."""
    trash = path.with_name(f".trash-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


__all__ = [
    "CheckpointError", "Checkpointer", "Found", "MARKER", "list_complete", "model_signature", "other_model",
    "resume_point", "saved_tensors", "sha256_file", "verify",
]
