"""``hetpar compile``: a plan becomes a runnable torch program and its launch files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hetpar.commands.common import console, domain_errors, print_json
from planner.plan import ParallelPlan
from rewriters.torchrun import compile_plan


@domain_errors
def compile_(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `hetpar plan`.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for train.py and its launch files.")] = Path("build"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the written paths as JSON.")] = False,
) -> None:
    """Write OUTPUT/train.py, launch.sh, slurm.sbatch and pytorchjob.yaml for PLAN_FILE."""
    plan = ParallelPlan.load(plan_file)
    paths = compile_plan(plan, output)
    if as_json:
        print_json({"files": [str(p) for p in paths]})
    else:
        for p in paths:
            print(p)
    console.print(f"run it: cd {output} && ./launch.sh --steps 10")
