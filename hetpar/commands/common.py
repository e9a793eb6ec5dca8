"""What every command shares: the stderr console and turning domain errors into one line."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from hetpar.models import HF_CAUSAL_LM, HF_CONFIG_COPY
from hetpar.cost_models.cluster import ClusterSpecError
from hetpar.cost_models.devices import DeviceProfile, ProfileError, UnknownDeviceError, get_device, load_profile
from hetpar.planner import ParallelPlan, PlanFileError, PlanningError
from hetpar.rewriters import CompileError, checked_model_file
from hetpar.runtime.errors import DataError, ModelFileError, TraceError
from hetpar.runtime.model_args import parse_model_args
from hetpar.vocabulary import DType, Precision

console = Console(stderr=True, highlight=False)

class RunError(Exception):
    """A plan's program could not be run or measured here (``hetpar validate``); the message says what happened."""


DOMAIN_ERRORS = (ProfileError, ModelFileError, TraceError, ClusterSpecError, UnknownDeviceError, PlanningError, PlanFileError, CompileError, RunError,
                 DataError)


def fail(message: str, code: int = 1) -> None:
    """Print ``hetpar: error: message`` to stderr and exit with ``code``."""
    console.print(f"[bold red]hetpar: error:[/] {message}", soft_wrap=True)
    raise typer.Exit(code)


def domain_errors(fn: Callable) -> Callable:
    """Turn hetpar's domain errors into one clear line and exit code 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DOMAIN_ERRORS as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper


def print_json(data: Any) -> None:
    """JSON to stdout, for scripts."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def rank_ranges(ranks: list[list[int]]) -> str:
    """Ranks as sorted runs for people to read, e.g. ``0-7, 16-23`` (plan JSON keeps the real lists)."""
    flat = sorted(r for replica in ranks for r in replica)
    if not flat:
        return ""
    runs, start, prev = [], flat[0], flat[0]
    for r in flat[1:]:
        if r != prev + 1:
            runs.append((start, prev))
            start = r
        prev = r
    runs.append((start, prev))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def print_parts(rows: list[tuple[str, str, str, list[int]]], where: str) -> None:
    """The fused projections split part by part, one row each (its ``where``: a layer or stage;
    module path, sharding, part sizes), on stderr; nothing when there are none
    ([Note: part-laid Linears] in runtime/parts.py)."""
    if not rows:
        return
    table = Table(title="fused projections, each part split over the tensor-parallel ranks", title_justify="left")
    for column in (where, "module", "sharding", "parts"):
        table.add_column(column, overflow="fold")
    for where, path, how, parts in rows:
        table.add_row(where, path, str(how), str(list(parts)))
    console.print(table)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"


def default_compiled(device_types: list[str]) -> bool:
    """Stages compiled by default where torch.compile generates GPU kernels: every device
    an NVIDIA or AMD GPU (the program's ``--compile auto`` follows the plan)."""
    return all(get_device(t).vendor in ("NVIDIA", "AMD") for t in set(device_types))


def default_dtype(device_types: list[str]) -> str:
    """fp32 on a CPU-only cluster; bf16 where every device has it; fp16 otherwise (V100, T4)."""
    profiles = [get_device(t) for t in set(device_types)]
    if all(p.name == "cpu" for p in profiles):
        return DType.FP32
    return DType.BF16 if all(Precision.BF16 in p.peak_flops_per_s for p in profiles) else DType.FP16


def tied_across_stages(plan: ParallelPlan) -> bool:
    """Whether a weight is held by more than one stage, so that the program needs
    runtime.tied; the model file runs (on the meta device) only once it is the planned
    one and the plan's text is safe ([Note: plan text] in rewriters/plan_text.py)."""
    if len(plan.stages) < 2:
        return False
    from hetpar.runtime.shard import ShardError  # torch.distributed.tensor: only where the program has stages to cut
    from hetpar.runtime.model_file import load_model_file
    from hetpar.runtime.tied import tied_across_stages as tied_weights

    model_file = load_model_file(checked_model_file(plan), plan.model.args)
    try:
        return bool(tied_weights(model_file, [(s.layers[0], s.layers[-1]) for s in plan.stages],
                                 list(plan.model.layer_names), tuple(plan.model.leaf_modules),
                                 micro_batch_size=plan.replica_micro_batch_sizes[0]))
    except ShardError as exc:
        raise CompileError(str(exc)) from None


# [Note: planning from a config]
# A Hugging Face model needs no model file: ``--hf PATH`` stands for hetpar's own
# hetpar/models/hf_causal_lm.py with the model arguments ``config`` (the config.json
# found from PATH, absolute) and ``seq`` (``--seq-len``). PATH is a config.json, a
# directory holding one (a checkpoint saved by ``save_pretrained``), or a model name
# (``org/name``) already in the local Hugging Face cache; nothing is downloaded. The
# plan records that file and those arguments like any other, and ``hetpar compile``
# copies the config next to the program (``hf_config.json``), where the model file
# reads it, so the program runs where PATH does not exist.
DEFAULT_SEQ_LEN = 2048


def model_source(model_file: Path | None, hf: str | None, seq_len: int | None,
                 model_arg: list[str] | None) -> tuple[Path, dict[str, Any]]:
    """The model file and model arguments a command works on: MODEL_FILE and its
    ``--model-arg``s, or ``--hf PATH``; see [Note: planning from a config].

    Raises:
        ModelFileError: neither or both given, ``--seq-len`` without ``--hf``, or no config at PATH.
    """
    args = parse_model_args(model_arg or [])
    if hf is None:
        if model_file is None:
            raise ModelFileError("no model: pass a MODEL_FILE, or --hf PATH for a Hugging Face config or checkpoint directory")
        if seq_len is not None:
            raise ModelFileError("--seq-len goes with --hf; a model file takes its sequence length as a --model-arg")
        return model_file, args
    if model_file is not None:
        raise ModelFileError(f"pass MODEL_FILE ({model_file}) or --hf {hf}, not both")
    if seq_len is not None and seq_len < 1:
        raise ModelFileError(f"--seq-len {seq_len} must be >= 1")
    clash = sorted(set(args) & {"config", "seq"})
    if clash:
        raise ModelFileError(f"--model-arg {clash[0]} is set by --hf and --seq-len; drop it")
    return HF_CAUSAL_LM, {**args, "config": str(hf_config_path(hf)), "seq": seq_len or DEFAULT_SEQ_LEN}


def hf_config_path(hf: str) -> Path:
    """The config.json ``--hf`` names: a file, a directory with one, or a cached model name."""
    path = Path(hf).expanduser()
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file():
            return (path / "config.json").resolve()
        raise ModelFileError(f"--hf {hf}: the directory has no config.json; pass a Hugging Face checkpoint or config directory")
    if hf.count("/") == 1 and not hf.startswith((".", "/")):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            raise ModelFileError("--hf needs transformers (and huggingface_hub): pip install transformers") from None
        cached = try_to_load_from_cache(hf, "config.json")
        if isinstance(cached, str) and Path(cached).is_file():
            return Path(cached).resolve()
        raise ModelFileError(f"--hf {hf}: no such file or directory, and no config.json of {hf} in the local Hugging Face "
                             f"cache (hetpar downloads nothing; run huggingface-cli download {hf} config.json, or pass a path)")
    raise ModelFileError(f"--hf {hf}: no such file or directory; pass a config.json, a checkpoint directory or a cached org/name")


def model_extra_files(plan: ParallelPlan) -> dict[str, Path]:
    """Files ``hetpar compile`` copies next to the model file: the config of a plan made
    with ``--hf`` ([Note: planning from a config]).

    Raises:
        CompileError: that config is gone.
    """
    if Path(plan.model.file).resolve() != HF_CAUSAL_LM:
        return {}
    path = Path(str(plan.model.args.get("config", "")))
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise CompileError(f"the plan's Hugging Face config {str(path)!r} is not there; restore it or re-run hetpar plan --hf")
    return {HF_CONFIG_COPY: path}


def model_label(plan: ParallelPlan) -> str:
    """How a plan's model is named to the user: its model file, or for ``--hf`` the
    directory of its config ([Note: planning from a config])."""
    path = Path(plan.model.file)
    if path.resolve() == HF_CAUSAL_LM and "config" in plan.model.args:
        return f"{Path(str(plan.model.args['config'])).parent.name} (--hf)"
    return path.name


def load_measured_profile(path: Path) -> DeviceProfile:
    """Read a profile file; warn in one line when it was measured on other hardware.

    Raises:
        ProfileError: the file is missing or malformed.
    """
    loaded = load_profile(path)  # a missing or malformed file is refused before torch loads
    from hetpar import profiler  # torch: only once a --profile file reads

    here = profiler.fingerprint()
    if loaded.fingerprint is not None and loaded.fingerprint != here:
        console.print(f"[yellow]hetpar: warning:[/] profile {path} was measured on '{loaded.fingerprint}', "
                      f"this host is '{here}'", soft_wrap=True)
    return loaded


def profiles_option(paths: Optional[list[Path]]) -> dict[str, DeviceProfile]:
    """``--profile`` files as parse_cluster's ``profiles``: device name -> measured profile."""
    return {p.name: p for p in (load_measured_profile(path) for path in (paths or []))}
