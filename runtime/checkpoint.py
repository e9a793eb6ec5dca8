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
- ``hetpar-checkpoint.json``: the marker, written last: step, world size, and the
  size and sha256 of every other file.

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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from runtime.precision import LossScaler

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


class Checkpointer:
    """Saves every ``every`` steps (and at the last step) into ``directory``, keeping the
    newest ``keep``; resumes from the newest intact one. Without a directory it does
    nothing. See [Note: checkpoint layout], [Note: atomic checkpoints], [Note: resume].
    """

    def __init__(self, directory: Path | None, *, every: int, keep: int):
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every({every}) and keep({keep}) must be >= 1")
        self.directory = Path(directory) if directory is not None else None
        self.every = every
        self.keep = keep

    # ------------------------------------------------------------------ resume

    def restore(self, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> int:
        """Load the newest intact checkpoint (collective).

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
                self._load(found, module, optimizer, scaler)
                _say(f"resuming from {found.path} (step {found.step})")
                return found.step
            fallback = str(candidates[i + 1].path) if i + 1 < len(candidates) else "nothing"
            _say(f"checkpoint {found.path} is corrupt ({problem}); falling back to {fallback}")
        if candidates:
            raise CheckpointError(
                f"every checkpoint in {self.directory} is corrupt; move them away to start from step 0"
            )
        return 0

    def _load(self, found: Found, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
        model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
        state = {"model": model_state, "optim": optim_state, "train": {"step": 0, "loss_scaler": scaler.state_dict()}}
        dcp.load(state, checkpoint_id=found.path, no_dist=not dist.is_initialized())
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_OPTIONS)
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

    def maybe_save(self, step: int, module: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler,
                   *, last: bool = False) -> None:
        """Save after ``step`` when it is due (collective); see [Note: atomic checkpoints]."""
        if not self.due(step, last):
            return
        tmp = self.directory / f".tmp-{step_dir_name(step)}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_state, optim_state = get_state_dict(module, optimizer, options=_OPTIONS)
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
        marker = {"step": step, "world_size": _world(), "files": dict(sorted(hashed.items()))}
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


def _discard(path: Path) -> None:
    """Delete a checkpoint directory: renamed out of sight first, so that a crash midway
    never leaves a checkpoint with files missing under its real name."""
    trash = path.with_name(f".trash-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


__all__ = ["CheckpointError", "Checkpointer", "Found", "MARKER", "list_complete", "sha256_file", "verify"]
