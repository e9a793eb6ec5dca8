"""ParallelPlan -> a self-contained directory that torchrun runs.

``compile_plan`` checks that nothing of the plan file can become code
([Note: plan text] in rewriters/plan_text.py), then writes ``train.py`` (a short
program in the style of nanoGPT holding only what its plan uses, with the logic in
``hetpar.runtime``: rewriters/program.py), its launch files (``launch.sh``,
``slurm.sbatch``, ``pytorchjob.yaml``; see rewriters.launchers), and a copy of the
model file. See docs/running.md.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import stat
import tempfile
from pathlib import Path

from hetpar.planner.plan import ParallelPlan
from hetpar.rewriters.launchers import (
    LAUNCHER, PROGRAM, PYTORCHJOB, SLURM, elastic_problem, launcher_source, pytorchjob_source, slurm_source,
)
from hetpar.rewriters.plan_text import CompileError, check_plan_text, plan_dtype
from hetpar.rewriters.program import program_source, stage_table, torchrun_line


def compile_plan(plan: ParallelPlan, out_dir: Path, *, elastic: tuple[int, int] | None = None,
                 tied: bool | None = None, extra_files: dict[str, Path] | None = None) -> list[Path]:
    """Write the program for ``plan`` into ``out_dir``.

    All files are written to a temporary directory first and then renamed into place,
    so a failure leaves ``out_dir`` as it was.

    Args:
        plan: the plan to compile.
        out_dir: where the program, its launch files and the model file go; created
            if missing; other files in it are left alone.
        extra_files: more files the model file reads, by the name they take next to it
            (a planned Hugging Face config: hetpar/commands/common.py ``model_extra_files``).
        elastic: ``(min_nodes, max_nodes)``: launch files for an elastic job (torchrun
            ``--nnodes=MIN:MAX``, c10d rendezvous), whose program stops with the command
            that re-plans and resumes when its nodes change (see rewriters.launchers).
        tied: whether a weight is held by more than one of the plan's stages
            (``runtime.tied.tied_across_stages``, which ``hetpar compile`` asks); None
            when not looked for, and then a plan of several stages gets the tied code.

    Returns:
        The paths written: ``train.py``, ``launch.sh``, ``slurm.sbatch``,
        ``pytorchjob.yaml``, the model file.

    Raises:
        CompileError: a string or number of the plan is not what hetpar writes there
            ([Note: plan text]), the model file is missing or changed since planning, or
            the plan uses something the program cannot run.
    """
    out_dir = Path(out_dir)
    model_path = checked_model_file(plan)
    if elastic is not None and (problem := elastic_problem(plan, elastic)):
        raise CompileError(problem)
    name = f"hetpar-{model_path.stem}"
    texts = {
        PROGRAM: program_source(plan, tied=tied, replan=replan_options(plan)),
        LAUNCHER: launcher_source(plan, elastic=elastic),
        SLURM: slurm_source(plan, job_name=name, elastic=elastic),
        PYTORCHJOB: pytorchjob_source(plan, job_name=name, build_dir=out_dir.name, elastic=elastic),
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.", suffix=".tmp"))
    try:
        for name, text in texts.items():
            (tmp / name).write_text(text)
        for script in (LAUNCHER, SLURM):
            (tmp / script).chmod((tmp / script).stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        shutil.copyfile(model_path, tmp / model_path.name)
        names = [*texts, model_path.name]
        for extra, source in (extra_files or {}).items():
            shutil.copyfile(source, tmp / extra)
            names.append(extra)
        if not out_dir.exists():
            os.replace(tmp, out_dir)
        else:
            for name in names:
                os.replace(tmp / name, out_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out_dir / name for name in names]


def checked_model_file(plan: ParallelPlan) -> Path:
    """The plan's model file, once the plan's text is safe to write ([Note: plan text]) and
    the file is the one planned (its fingerprint).

    Raises:
        CompileError: either is not so.
    """
    check_plan_text(plan)
    path = Path(plan.model.file)
    if not path.is_file():
        raise CompileError(f"model file {path} not found; restore it or re-run hetpar plan")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != plan.model.fingerprint.removeprefix("sha256:"):
        raise CompileError(f"model file {path} changed since planning; re-run hetpar plan")
    if path.name in (PROGRAM, LAUNCHER, SLURM, PYTORCHJOB):
        raise CompileError(f"model file {path} is named like the program; rename it (e.g. model.py) and re-run hetpar plan")
    return path


def replan_options(plan: ParallelPlan) -> str:
    """The ``hetpar plan`` options that ask for ``plan``'s request again, the cluster aside
    (the program prints them when an elastic job's nodes change: [Note: membership change]),
    each model argument quoted for the shell."""
    model_args = "".join(f" --model-arg {shlex.quote(f'{key}={value}')}" for key, value in plan.model.args.items())
    return f"--global-batch {plan.global_batch_size} --dtype {plan_dtype(plan).value}{model_args}"


__all__ = ["CompileError", "checked_model_file", "compile_plan", "program_source", "replan_options", "stage_table", "torchrun_line"]
