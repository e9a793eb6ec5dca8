"""What ``hetpar profile`` runs (commands/profile.py holds its options): the host measured by fresh workers, a
device profile fitted to it and written."""

from __future__ import annotations

import datetime
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hetpar import profiler
from hetpar.cost_models.calibrate import fit_profile
from hetpar.cost_models.devices import DeviceProfile, ProfileError, dump_profile, get_device, known_devices, profile_to_dict
from hetpar.commands.common import console, seconds
from hetpar.planner import ModelGraph, trace_model
from hetpar.profiler import reference_model
from hetpar.runtime import devices
from hetpar.runtime.model_file import load_model_file, parse_model_args

# (matmul sizes, collective sizes in bytes, repeats) by device and --quick. CUDA
# timings are steady, so a GPU takes fewer repeats of larger sizes than a CPU; --quick
# is for tests and a first look. How long a profile takes: docs/profiling.md.
_SIZES = {
    ("cpu", False): ([64, 128, 256, 384, 512, 768], [4096, 65536, 1 << 20, 4 << 20, 16 << 20], 9),
    ("cpu", True): ([64, 256, 512], [4096, 1 << 20, 4 << 20], 3),
    ("cuda", False): ([512, 1024, 2048, 4096, 8192], [4096, 65536, 1 << 20, 16 << 20, 128 << 20], 10),
    ("cuda", True): ([1024, 4096, 8192], [4096, 1 << 20, 64 << 20], 5),
}


def measure(*, nproc: int, quick: bool, device: str = "cpu", tp_sharding: dict[str, str] | None = None,
            model: dict | None = None, passes: int = 1, step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run every microbenchmark of this host ``passes`` times; the record cost_models/calibrate.py fits.

    Args:
        nproc: local workers that run the benchmarks at once, as the ranks of a plan for
            this many devices would (1 or more; on CUDA one per GPU).
        quick: fewer sizes and repeats.
        device: "cuda" or "cpu": what the workers compute on.
        tp_sharding: the reference model's tensor-parallel sharding (``reference_graph``),
            for two or more CPU workers.
        model: ``{"path", "args", "batch_sizes"}``: also time that model file's layers
            (profiler/layers.py ``layer_times``).
        passes: whole measurements, each with fresh workers; the record holds the
            median of each number over them.
        step: called with a description as each benchmark starts (progress display).

    Returns:
        The measurement record (cost_models/calibrate.py documents its keys).
    """
    sizes, comm_sizes, repeats = _SIZES[device, quick]
    threads = 1 if nproc > 1 else torch.get_num_threads()  # as the workers set it
    record: dict[str, Any] = {"fingerprint": profiler.fingerprint(), "date": datetime.date.today().isoformat(),
                              "device": device, "workers": nproc, "threads_per_worker": threads}
    records = []
    for k in range(passes):
        def progress(what: str, k: int = k) -> None:
            step(f"pass {k + 1}/{passes}: {what}" if passes > 1 else what)

        records.append(_one_pass(nproc, sizes, comm_sizes, repeats, tp_sharding, model, progress, device=device))
    record.update(profiler.median_record(records))
    record["passes"] = passes
    return record


def _one_pass(nproc: int, sizes: list[int], comm_sizes: list[int], repeats: int, tp_sharding: dict[str, str] | None,
              model: dict | None, progress: Callable[[str], None], *, device: str = "cpu") -> dict[str, Any]:
    """One measurement with fresh workers; a pass whose worker died is measured once more.

    Raises:
        ProfileError: a worker raised, or died twice.
    """
    def once() -> dict[str, Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return profiler.host_measurements(nproc, device=device, matmul_sizes=sizes, sizes_bytes=comm_sizes,
                                              repeats=repeats, tp_sharding=tp_sharding, model=model, progress=progress)

    try:
        return once()
    except profiler.WorkerDied as exc:
        progress(f"{exc}; measuring this pass again")
    except profiler.WorkerFailed as exc:
        raise ProfileError(str(exc)) from None
    try:
        return once()
    except profiler.WorkerFailed as exc:
        raise ProfileError(f"{exc}; run hetpar profile again when the machine is quieter") from None


def run_profile(*, output: Path, nproc: int | None, model: Path | None, model_arg: list[str] | None, batch_sizes: str,
                quick: bool, passes: int | None, base: str | None, default_passes: dict[str, int]) -> None:
    """``hetpar profile`` with its options parsed (commands/profile.py): measure, fit, write.
    ``default_passes``: whole measurements by device when ``passes`` is None (profile.PASSES)."""
    if output.suffix.lower() not in (".json", ".toml"):
        raise ProfileError(f"--output {str(output)!r} must end in .json or .toml")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    nproc = workers(nproc, device)
    passes = passes if passes is not None else (1 if quick else default_passes[device])
    if passes < 1:
        raise ProfileError(f"--passes must be at least 1, got {passes}")
    base_profile = get_device(base) if base is not None else host_profile(device, nproc)
    sizes = _batch_sizes(batch_sizes)
    target = _model_target(model, parse_model_args(model_arg or []), sizes) if model is not None else None
    reference = reference_graph(device)
    tp_sharding = reference_sharding(reference, nproc) if device == "cpu" and nproc > 1 else {}
    if nproc == 1:
        console.print(f"hetpar: one worker: collectives not measured, keeping the {base_profile.name} profile's links",
                      soft_wrap=True)
    # A neighbour's burst can spoil one round past what the fit tolerates; one more round
    # usually is clean, and a second failure is reported.
    for attempt in (1, 2):
        record = _measure_with_progress(nproc, quick, device, passes, target and target[0], tp_sharding)
        try:
            fitted = fit_profile(record, base_profile, reference.layers, target[1].layers if target else ())
            break
        except ProfileError as exc:
            if attempt == 2 or "noisy" not in str(exc):
                raise
            console.print("measurements too noisy to fit; measuring again")
    output.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(profile_to_dict(fitted), indent=2) + "\n" if output.suffix.lower() == ".json" else dump_profile(fitted)
    output.write_text(text)
    sidecar = output.with_name(output.stem + ".measurements.json")
    sidecar.write_text(json.dumps(record, indent=2) + "\n")
    _print_summary(fitted, record)
    console.print(f"wrote {output} (raw measurements in {sidecar})")
    typer.echo(str(output))


def workers(nproc: int | None, device: str) -> int:
    """How many workers measure at once: ``--nproc``, else every visible GPU on CUDA and
    2 on a CPU (two workers that share the cores, as the cpu profile describes).

    Raises:
        ProfileError: fewer than 1, or more than the visible GPUs on CUDA.
    """
    if device == "cuda":
        visible = torch.cuda.device_count()
        if nproc is None:
            return visible
        if nproc > visible:
            raise ProfileError(f"--nproc {nproc} is more than the {visible} visible GPU{'s' if visible != 1 else ''} "
                               "(one worker per GPU)")
    nproc = 2 if nproc is None else nproc
    if nproc < 1:
        raise ProfileError(f"--nproc must be at least 1, got {nproc}")
    return nproc


def host_profile(device: str, nproc: int) -> DeviceProfile:
    """The built-in profile this host's measured one stands in for: ``cpu`` on a CPU; on
    CUDA the one that matches the GPUs' name and memory (runtime.devices ``matches``:
    ``NVIDIA H200`` with 140 GiB is ``H200-141GB``), so that ``--profile`` replaces that
    type in a cluster.

    Raises:
        ProfileError: the workers' GPUs differ, or no built-in profile matches them.
    """
    if device != "cuda":
        return get_device("cpu")
    found = [devices.this_device(torch.device("cuda", k)) for k in range(nproc)]
    if len({(f.name, f.memory_bytes) for f in found}) > 1:
        kinds = ", ".join(sorted({f.describe() for f in found}))
        raise ProfileError(f"the GPUs differ ({kinds}); profile one type at a time (CUDA_VISIBLE_DEVICES, --nproc)")
    matching = [p for p in known_devices() if not devices.is_cpu_type(p.name) and devices.matches(p.name, found[0])]
    if not matching:
        raise ProfileError(f"no built-in profile matches this GPU ({found[0].describe()}); pass --base NAME "
                           "(hetpar devices lists them)")
    return matching[0]


def reference_graph(device: str = "cpu") -> ModelGraph:
    """The model the profile times as its reference workload on ``device`` ("cpu" or
    "cuda": its size, profiler/reference_model.py), traced by the planner."""
    args = {"size": reference_model.size_for(device)}
    return trace_model(load_model_file(Path(reference_model.__file__), args))


def reference_sharding(graph: ModelGraph, tp: int) -> dict[str, str]:
    """The planner's tensor-parallel sharding of the whole reference model (module path ->
    style), or {} when some layer does not split ``tp`` ways."""
    if any(not layer.splits_at(tp) for layer in graph.layers):
        return {}
    return {path: kind.value for layer in graph.tp_sharding for path, kind in layer.items()}


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ProfileError(f"--batch-sizes {text!r} must be positive integers, comma-separated (e.g. 1,4,16)")
    return sizes


def _model_target(path: Path, args: dict[str, Any], sizes: list[int]) -> tuple[dict[str, Any], ModelGraph]:
    """What the workers time for ``--model`` and the planner's trace of it (which checks the file first)."""
    graph = trace_model(load_model_file(path, args))
    return {"path": str(path.resolve()), "args": args, "batch_sizes": sizes}, graph


def _measure_with_progress(nproc: int, quick: bool, device: str, passes: int, model: dict[str, Any] | None,
                           tp_sharding: dict[str, str]) -> dict[str, Any]:
    steps = profiler.progress_steps(nproc, torch.device(device, 0) if device == "cuda" else torch.device("cpu"),
                                    model=bool(model), tensor_parallel=bool(tp_sharding))
    total = steps * passes
    with Progress(TextColumn("profiling"), BarColumn(), TextColumn("{task.completed}/{task.total} {task.description}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=total)
        done = {"n": -1}

        def step(what: str) -> None:
            done["n"] += 1
            bar.update(task, completed=done["n"], description=what)

        record = measure(nproc=nproc, quick=quick, device=device, tp_sharding=tp_sharding, model=model, passes=passes,
                         step=step)
        bar.update(task, completed=total)
    return record


def _print_summary(p: DeviceProfile, record: dict[str, Any]) -> None:
    console.print(f"[bold]{p.fingerprint}[/]")
    console.print(
        "matmul " + ", ".join(f"{d} {v / 1e9:.0f} GFLOP/s" for d, v in p.peak_flops_per_s.items())
        + f"; memory {p.mem_bw_bytes_per_s / 1e9:.1f} GB/s; op overhead {p.op_overhead_s * 1e6:.1f} us; "
        f"step overhead {seconds(p.step_overhead_s)}"
        + (f"; late pipeline receive {seconds(p.late_receive_s)}" if p.late_receive_s is not None else "")
    )
    if "collectives" in record:  # one worker times none
        table = Table(title=f"collectives, {record['workers']} workers", title_justify="left")
        for column in ("collective", "alpha", "beta"):
            table.add_column(column)
        for name, fit in p.collectives.items():
            table.add_row(name, f"{fit.latency_s * 1e6:.0f} us", f"{fit.bw_bytes_per_s / 1e9:.2f} GB/s")
        console.print(table)
    if "model_layers" in record:
        timed = record["model_layers"]
        sizes = [int(t[0]) for t in timed["layers"][0]["times"]]
        layers = Table(title=f"layers of {timed['model']}: measured over modelled, forward / backward", title_justify="left")
        layers.add_column("layer")
        for size in sizes:
            layers.add_column(f"mb {size}")
        for entry in p.layer_corrections.values():
            layers.add_row(entry["layer"], *(" / ".join(f"{entry[c][b]:.2f}" if b in entry[c] else "-" for c in ("forward", "backward"))
                                             for b in sizes))
        console.print(layers)
