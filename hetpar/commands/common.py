"""What every command shares: the stderr console and turning domain errors into one line."""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Callable

import typer
from rich.console import Console

from cost_models.cluster import ClusterSpecError
from cost_models.devices import ProfileError, UnknownDeviceError
from planner.plan import PlanError
from planner.search import PlanningError
from rewriters.torchrun import CompileError
from runtime.graph import TraceError
from runtime.model_file import ModelFileError

console = Console(stderr=True, highlight=False)

DOMAIN_ERRORS = (ProfileError, ModelFileError, TraceError, ClusterSpecError, UnknownDeviceError, PlanningError, PlanError, CompileError)


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


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def seconds(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.3f} s"
