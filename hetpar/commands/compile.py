"""``hetpar compile``: a plan becomes a runnable torch program and its launch files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from hetpar.commands.common import console, domain_errors, fail, model_extra_files, print_json, tied_across_stages
from hetpar.planner.plan import ParallelPlan
from hetpar.rewriters import compile_plan


@domain_errors
def compile_(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `hetpar plan`.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory for train.py and its launch files.")] = Path("build"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the written paths as JSON.")] = False,
    elastic: Annotated[Optional[str], typer.Option(metavar="MIN:MAX", help="Launch files for an elastic job of MIN to MAX nodes (torchrun --nnodes=MIN:MAX, c10d rendezvous): when nodes are lost or added, train.py stops with the hetpar plan --resume-from command that re-plans for the nodes there are (one device type only).")] = None,
) -> None:
    """Write OUTPUT/train.py, launch.sh, slurm.sbatch and pytorchjob.yaml for PLAN_FILE."""
    plan = ParallelPlan.load(plan_file)
    paths = compile_plan(plan, output, elastic=_node_range(elastic) if elastic else None, tied=tied_across_stages(plan),
                         extra_files=model_extra_files(plan))
    if as_json:
        print_json({"files": [str(p) for p in paths]})
    else:
        for p in paths:
            print(p)
    console.print(f"run it: cd {output} && ./launch.sh --steps 10")


def _node_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high)
    except ValueError:
        fail(f"--elastic {text!r} is not MIN:MAX, e.g. --elastic 2:4 (nodes)")
