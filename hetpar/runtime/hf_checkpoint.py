"""Hugging Face checkpoint directories: read by ``--init-from DIR``, written by ``--save-hf DIR``.

[Note: Hugging Face checkpoints]
A directory that ``save_pretrained`` writes holds ``config.json`` and the weights as
safetensors: one ``model.safetensors``, or shards ``model-0000x-of-0000y.safetensors``
with ``model.safetensors.index.json`` mapping each tensor's name to its shard. The names
are the model's ``state_dict()`` keys (``LlamaForCausalLM``: ``model.layers.0.mlp.up_proj
.weight``, ``lm_head.weight``), and a weight tied to another (``lm_head.weight`` with
``tie_word_embeddings``) is written once, under the name that comes first in the
state_dict, as transformers does.

Reading (``--init-from DIR``): every rank reads each shard's header (8 bytes and a JSON
table of names, dtypes and shapes, a few kB) and checks the names and shapes against
the model, so that all ranks reach the same verdict before any reads a tensor; a
mismatch is one line naming what is missing, extra or of another shape (a few of
each, then how many more). A name the files lack is fine where the model ties it to
one they hold. Then a rank opens only the shards that hold its tensors, and of a tensor
split over tensor-parallel ranks (a DTensor sharded along a dimension) reads only its
slice (``safe_open(...).get_slice``, which reads those bytes); a part-laid tensor
([Note: part-laid Linears] in runtime/parts.py) is read whole and cut. Values are cast
to the model's dtype (a bfloat16 checkpoint into a float32 model).

Writing (``--save-hf DIR``, rank 0, from the full state_dict gathered as for
``--save-final``): ``model.safetensors`` holds every tensor once (a tied one under its
first name), contiguous, with ``{"format": "pt"}`` metadata as transformers writes;
``config.json`` is the model's own config (``model.config.save_pretrained``) with
``architectures`` set to the model's class and ``use_cache`` back at the config class's
default (training turned it off: [Note: no KV cache in training] in
runtime/model_file.py); ``generation_config.json`` where the model has one. The
directory is written under a temporary name beside ``DIR`` and renamed into place, so a
run that fails leaves no half directory (an existing ``DIR`` is replaced only once the
new one is complete). A model without a Hugging Face config is refused before training.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# How many names a mismatch line shows of each kind before "and N more".
_SHOWN = 3


class HFCheckpointError(Exception):
    """A Hugging Face checkpoint directory that cannot be read into, or written from, this model."""


def is_hf_checkpoint(path: Path) -> bool:
    """True if ``path`` is a directory holding ``model.safetensors`` or its index."""
    path = Path(path)
    return path.is_dir() and ((path / SINGLE_FILE).is_file() or (path / INDEX_FILE).is_file())


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each state_dict key whose tensor an earlier key holds too, mapped to that first key
    (``{"lm_head.weight": "model.embed_tokens.weight"}`` for a tied Llama)."""
    first: dict[int, str] = {}
    out = {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            out[key] = first[id(t)]
        else:
            first[id(t)] = key
    return out


def _header(path: Path) -> dict[str, dict]:
    """The safetensors header of ``path``: each tensor's dtype, shape and offsets."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            raise HFCheckpointError(f"{path} is not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", size)
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HFCheckpointError(f"{path} is not a safetensors file (its header is not JSON)") from None
    header.pop("__metadata__", None)
    return header


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


class HFCheckpoint:
    """The safetensors of a checkpoint directory, checked against a model; see
    [Note: Hugging Face checkpoints]."""

    def __init__(self, path: Path, model: nn.Module):
        """Read the shards' headers and check names and shapes against ``model`` (meta will do).

        Raises:
            HFCheckpointError: a name is missing or extra, a shape differs, or the
                index names a shard that is not there.
        """
        self.path = Path(path)
        self.file_of: dict[str, Path] = {}  # tensor name in the files -> its shard
        shapes: dict[str, list[int]] = {}
        if (self.path / INDEX_FILE).is_file():
            weight_map = json.loads((self.path / INDEX_FILE).read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            weight_map, files = {}, [SINGLE_FILE]
        for name in files:
            file = self.path / name
            if not file.is_file():
                where = f"{INDEX_FILE} names {name}, which is not there" if weight_map else f"no {name}"
                raise HFCheckpointError(f"--init-from {self.path}: {where}")
            for key, entry in _header(file).items():
                if weight_map and weight_map.get(key) != name:
                    continue  # the index says where a name lives
                self.file_of[key] = file
                shapes[key] = list(entry["shape"])
        self.aliases = tied_names(model)
        self._check(model, shapes)

    def _check(self, model: nn.Module, shapes: dict[str, list[int]]) -> None:
        want = {k: list(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
        missing = [k for k in want if k not in shapes and self.aliases.get(k) not in shapes]
        extra = [k for k in shapes if k not in want]
        wrong = [k for k in want if k in shapes and shapes[k] != want[k]]
        if not (missing or extra or wrong):
            return
        parts = []
        if missing:
            parts.append(f"lacks {_listed(missing)}")
        if extra:
            parts.append(f"has {_listed(extra)}, which the model lacks")
        if wrong:
            parts.append("has " + _listed([f"{k} of shape {shapes[k]} (the model's: {want[k]})" for k in wrong]))
        raise HFCheckpointError(f"--init-from {self.path} does not fit {type(model).__name__}: it {'; '.join(parts)}")

    def key_of(self, name: str) -> str:
        """The name under which the files hold the model's tensor ``name`` (its tie's, where the files lack it)."""
        return name if name in self.file_of else self.aliases[name]

    def read(self, names: set[str], local: dict[str, Callable], like: dict[str, torch.Tensor], *,
             whole: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """The tensors ``names`` of the model as this rank holds them (``local``: its
        shard), each cast to ``like``'s dtype; the names of one tensor get one object.

        Args:
            names: the model's names of the rank's tensors.
            local: for a tensor a rank holds part of, the function that cuts its part
                from the whole tensor.
            like: each name's meta tensor (a DTensor where the rank holds a shard).
            whole: part-laid names, read whole and cut by ``local``.
        """
        from safetensors import safe_open  # with transformers; only a Hugging Face --init-from needs it

        first: dict[int, str] = {}
        for n in sorted(names):
            first.setdefault(id(like[n]), n)
        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in first.values():
            by_file[self.file_of[self.key_of(n)]].append(n)
        got: dict[str, torch.Tensor] = {}
        for file, wanted in sorted(by_file.items()):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for n in wanted:
                    got[n] = self._read_one(f, n, local, like[n], whole).to(like[n].dtype)
        return {n: got[first[id(like[n])]] for n in names}

    def _read_one(self, f, name: str, local: dict[str, Callable], like: torch.Tensor, whole: set[str]) -> torch.Tensor:
        key = self.key_of(name)
        if isinstance(like, DTensor) and name not in whole:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            return f.get_slice(key)[index].contiguous()
        full = f.get_tensor(key)
        return local[name](full) if name in local else full


def check_savable(model: nn.Module) -> None:
    """Refuse ``--save-hf`` for a model without a Hugging Face config, before training.

    Raises:
        HFCheckpointError: ``model.config`` has no ``save_pretrained``.
    """
    if not callable(getattr(getattr(model, "config", None), "save_pretrained", None)):
        raise HFCheckpointError(f"--save-hf writes a Hugging Face checkpoint, but {type(model).__name__} has no Hugging "
                                f"Face config (model.config) to write as config.json; use --save-final")


def save_pretrained(directory: Path, state: dict[str, torch.Tensor], model: nn.Module) -> None:
    """Write ``state`` (the whole trained state_dict) and ``model``'s config as a directory
    that ``AutoModelForCausalLM.from_pretrained`` loads, atomically ([Note: Hugging Face
    checkpoints]).

    Args:
        directory: where the checkpoint goes.
        state: every state_dict key of the model, whole tensors on the CPU.
        model: the model (meta will do): its config and which keys are tied.
    """
    from safetensors.torch import save_file  # with transformers, which a Hugging Face model needs anyway

    check_savable(model)
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".tmp"))
    try:
        tied = tied_names(model)
        tensors, storages = {}, set()
        for key, value in state.items():
            if key in tied:
                continue
            value = value.detach().contiguous()
            if value.untyped_storage().data_ptr() in storages:  # safetensors refuses two names on one storage
                value = value.clone()
            storages.add(value.untyped_storage().data_ptr())
            tensors[key] = value
        save_file(tensors, tmp / SINGLE_FILE, metadata={"format": "pt"})
        _config_for_inference(model).save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if callable(getattr(generation, "save_pretrained", None)):
            generation.save_pretrained(tmp)
        _replace_directory(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _config_for_inference(model: nn.Module):
    """A copy of the model's config as ``save_pretrained`` would write it: ``architectures``
    named, ``use_cache`` at its class's default (training set it False)."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    if getattr(config, "use_cache", None) is False:
        try:
            config.use_cache = type(config)().use_cache
        except Exception:  # noqa: BLE001 - a config class that needs arguments keeps False
            pass
    return config


def _replace_directory(new: Path, directory: Path) -> None:
    """Rename ``new`` to ``directory``; an existing ``directory`` is moved aside first and
    removed once the rename has happened."""
    old = None
    if directory.exists():
        old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".old"))
        os.replace(directory, old / directory.name)
    os.replace(new, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["CONFIG_FILE", "HFCheckpoint", "HFCheckpointError", "INDEX_FILE", "SINGLE_FILE", "check_savable",
           "is_hf_checkpoint", "save_pretrained", "tied_names"]
