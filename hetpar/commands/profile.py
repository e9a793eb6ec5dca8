"""``hetpar profile``: measure this host and write a device profile that ``plan``/``estimate --profile`` use.

The options live here and the work in commands/profiling.py, which imports torch and the
profiler only when a profile is taken: ``hetpar --help`` and the other commands load none
of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hetpar.commands.common import domain_errors

# Whole measurements per profile by default: each pass spawns fresh workers, and the
# record keeps the median of every number over the passes (profiler/workers.py
# ``median_record``), so one slow minute of the shared host or one unlucky set of
# processes does not set the profile. A GPU's timings are steady from one pass to the
# next, so one pass is enough there.
PASSES = {"cpu": 3, "cuda": 1}


@domain_errors
def profile(
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the profile (.json or .toml).")],
    nproc: Annotated[Optional[int], typer.Option(
        help="Local workers measured at once, as a plan's ranks run; with 2 or more they time collectives too "
             "\\\\[default: every visible GPU on CUDA, 2 on a CPU].", show_default=False)] = None,
    model: Annotated[Optional[Path], typer.Option(help="Also time each layer of this model file, forward and backward; "
                                                   "plans of models with such layers then use the times.")] = None,
    model_arg: Annotated[Optional[list[str]], typer.Option("--model-arg", "-a", help="key=value passed to build_model(); repeatable.")] = None,
    batch_sizes: Annotated[str, typer.Option(help="Micro-batch sizes at which to time the --model layers, comma-separated.")] = "1,2,4,8,16,32",
    quick: Annotated[bool, typer.Option(help="Fewer sizes and repeats, one pass (a first look; noisier).")] = False,
    passes: Annotated[Optional[int], typer.Option(
        help=f"Whole measurements to take the median of \\\\[default: {PASSES['cpu']} on a CPU, {PASSES['cuda']} on GPUs, "
             "1 with --quick].", show_default=False)] = None,
    base: Annotated[Optional[str], typer.Option(
        help="Built-in profile whose unmeasured fields (memory, NICs, links not timed) are kept, and whose name the "
             "profile takes \\\\[default: this host's GPU type on CUDA, cpu on a CPU].", show_default=False)] = None,
) -> None:
    """Measure this host (matmul, memory, per-op overhead, collectives) and fit a device profile."""
    from hetpar.commands.profiling import run_profile  # torch and the profiler: only when measuring

    run_profile(output=output, nproc=nproc, model=model, model_arg=model_arg, batch_sizes=batch_sizes, quick=quick,
                passes=passes, base=base, default_passes=PASSES)
