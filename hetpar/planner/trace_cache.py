"""Traced models kept on disk, so a model planned again is not traced again.

[Note: the trace cache]
Tracing builds the model on the meta device, captures it and measures every layer
(planner.capture); on a laptop that is seconds for a GPT and more for a Hugging Face
model, and with torch's import it is most of a `hetpar plan` that changes only the
cluster or the batch. ``traced_model`` keeps each ModelGraph it makes in a cache
directory and hands it back while nothing it was made from has changed; a hit never
imports torch. The graph is the trace's own output: tracing is on the meta device and
measures no time, so a cached graph equals a fresh one.

An entry's key is what the caller names: the model file's bytes, the model arguments
and the leaf modules, with the versions of torch and transformers (from their package
metadata) and a stamp of hetpar's own source files (each file's path, size and
modification time, so an edited checkout misses). Besides the key an entry records the
files the trace read that the key does not cover, each with its sha256, and is used
only while every one still hashes the same:

- the source of every module loaded from outside the Python installation and its
  site-packages (a ``layers.py`` the model file imports from beside it);
- every model argument that names an existing file (``--hf``'s config.json).

What a model file reads in other ways (environment variables, a file it opens by a name
the arguments do not give) is not seen: ``HETPAR_TRACE_CACHE=off`` traces every time.
``hetpar trace`` always traces, and keeps what it traced for the commands after it.

Where: ``HETPAR_TRACE_CACHE`` names the directory (``off``: no cache); by default
``$XDG_CACHE_HOME/hetpar/traces``, else ``~/.cache/hetpar/traces``. The directory is
made private to the user (mode 0700) and an entry is read only from a directory the
user owns that no one else may write, since entries are pickles. At most
``MAX_ENTRIES`` are kept, the least recently used dropped. A cache that cannot be
written (read-only home) or an entry that cannot be read is skipped, not an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import site
import stat
import sys
import sysconfig
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from hetpar.planner.model_graph import ModelGraph

ENVIRONMENT = "HETPAR_TRACE_CACHE"
MAX_ENTRIES = 64
_FORMAT = 1  # bump when an entry's layout changes


@dataclass(frozen=True)
class Traced:
    """A traced model and whether it came from the cache."""

    graph: ModelGraph
    cached: bool
    seconds: float  # wall-clock of tracing, or of finding the entry


def cache_dir() -> Path | None:
    """The cache directory ``HETPAR_TRACE_CACHE`` names, or the default; None when off."""
    named = os.environ.get(ENVIRONMENT, "").strip()
    if named.lower() in ("off", "0", "no", "false"):
        return None
    if named:
        return Path(named).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hetpar" / "traces"


def traced_model(model_path: str | Path, model_args: dict[str, Any], leaf_modules: tuple[str, ...] = (), *,
                 refresh: bool = False) -> Traced:
    """The ModelGraph of ``model_path`` with ``model_args``: from the cache while it holds
    one made from the same files, else traced (planner.capture.trace_model) and kept;
    ``refresh``: traced and kept whatever the cache holds (``hetpar trace``). See [Note:
    the trace cache].

    Raises:
        what planner.capture.trace_model and runtime.model_file.load_model_file raise.
    """
    start = time.perf_counter()
    directory = cache_dir()
    key = _key(Path(model_path), model_args, leaf_modules) if directory is not None else None
    if key is not None and not refresh:
        graph = _load(directory, key)
        if graph is not None:
            return Traced(graph=graph, cached=True, seconds=time.perf_counter() - start)
    from hetpar.planner.capture import trace_model  # torch: only on a miss
    from hetpar.runtime.model_file import load_model_file

    graph = trace_model(load_model_file(model_path, model_args), tuple(leaf_modules))
    seconds = time.perf_counter() - start
    if key is not None:
        _store(directory, key, graph, _read_files(model_args))
    return Traced(graph=graph, cached=False, seconds=seconds)


def _key(model_path: Path, model_args: dict[str, Any], leaf_modules: tuple[str, ...]) -> str | None:
    try:
        model = _sha256(model_path)
    except OSError:
        return None  # load_model_file names the problem
    parts = {
        "format": _FORMAT,
        "model": model,
        "path": str(model_path.resolve()),  # the graph names its file
        "args": json.dumps(model_args, sort_keys=True, default=repr),
        "leaf_modules": list(leaf_modules),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "python": sys.version,
        "hetpar": _source_stamp(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _source_stamp() -> str:
    """Path, size and modification time of every file of hetpar's own source."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        info = path.stat()
        digest.update(f"{path.relative_to(root)}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_files(model_args: dict[str, Any]) -> dict[str, str]:
    """path -> sha256 of what the trace may have read beyond the key: the sources of the
    modules loaded from outside the installation (more than the model file imported, in a
    process that loaded others first: a miss later, never a stale hit), and files the
    model arguments name."""
    installed = {Path(p).resolve() for p in _installation_paths()}
    hetpar_root = Path(__file__).resolve().parent.parent
    files: set[Path] = set()
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if not isinstance(source, str) or not source:
            continue
        path = Path(source).resolve()
        if path.suffix == ".py" and hetpar_root not in path.parents and not any(p in path.parents for p in installed):
            files.add(path)
    for value in model_args.values():
        if isinstance(value, str) and value and Path(value).expanduser().is_file():
            files.add(Path(value).expanduser().resolve())
    read: dict[str, str] = {}
    for path in sorted(files):
        try:
            read[str(path)] = _sha256(path)
        except OSError:
            continue
    return read


def _installation_paths() -> set[str]:
    """Where Python and installed packages live: the standard library, site-packages
    (the user's too) and the prefixes."""
    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths |= set(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE is not False:
        paths.add(site.getusersitepackages())
    return paths


def _private(directory: Path) -> bool:
    """Whether ``directory`` is the user's own and no one else may write it."""
    if os.name != "posix":
        return True
    try:
        info = directory.stat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _load(directory: Path, key: str) -> ModelGraph | None:
    entry = directory / f"{key}.pickle"
    if not entry.is_file() or not _private(directory):
        return None
    try:
        with entry.open("rb") as f:
            saved = pickle.load(f)
        for path, digest in saved["read"].items():
            if _sha256(Path(path)) != digest:
                return None
        os.utime(entry)  # most recently used
        graph = saved["graph"]
    except Exception:  # noqa: BLE001 - a damaged or foreign entry is a miss, traced again
        return None
    return graph if isinstance(graph, ModelGraph) else None


def _store(directory: Path, key: str, graph: ModelGraph, read: dict[str, str]) -> None:
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(directory):
            return
        partial = directory / f".{key}.{os.getpid()}.tmp"
        try:
            with partial.open("wb") as f:
                pickle.dump({"graph": graph, "read": read}, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(partial, directory / f"{key}.pickle")
        finally:
            partial.unlink(missing_ok=True)
        entries = sorted(directory.glob("*.pickle"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            old.unlink(missing_ok=True)
    except OSError:
        return


__all__ = ["ENVIRONMENT", "MAX_ENTRIES", "Traced", "cache_dir", "traced_model"]
