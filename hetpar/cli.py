"""The ``hetpar`` command: a thin typer front end; every command is a library call first."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from hetpar import __version__
from hetpar.commands import calibrate as calibrate_cmd
from hetpar.commands import compile as compile_cmd
from hetpar.commands import data as data_cmd
from hetpar.commands import devices as devices_cmd
from hetpar.commands import explain as explain_cmd
from hetpar.commands import estimate as estimate_cmd
from hetpar.commands import plan as plan_cmd
from hetpar.commands import profile as profile_cmd
from hetpar.commands import validate as validate_cmd
from hetpar.commands import trace as trace_cmd

app = typer.Typer(
    name="hetpar",
    help="Plan, compile and run parallel PyTorch training on (heterogeneous) clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("plan")(plan_cmd.plan)
app.command("compile")(compile_cmd.compile_)
app.command("trace")(trace_cmd.trace)
app.command("devices")(devices_cmd.devices)
app.command("estimate")(estimate_cmd.estimate)
app.command("profile")(profile_cmd.profile)
app.command("validate")(validate_cmd.validate)
app.command("explain")(explain_cmd.explain)
app.command("data")(data_cmd.data)
app.command("calibrate")(calibrate_cmd.calibrate)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"hetpar {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")] = None,
) -> None:
    """hetpar: auto-parallel planner and compiler for PyTorch training."""


def main() -> None:
    app()
