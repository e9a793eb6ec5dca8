"""``hetpar calibrate``: fit device profiles to a user's own runs ([Note: calibrating from runs])."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from hetpar.commands.common import console, domain_errors, print_json
from hetpar.commands.common import profiles_option
from hetpar.cost_models.devices import dump_profile, profile_to_dict
from hetpar.planner import PlanningError, write_text_atomic


@domain_errors
def calibrate(
    runs: Annotated[list[Path], typer.Argument(help="PLAN METRICS pairs, one per run: a plan file and the --metrics file its program wrote (2 or more steps; its per-stage times, else its steps), or, for a run of another framework, a plan of its configuration (hetpar plan with every choice pinned) and the seconds per step it measured.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the fitted profile: a .toml or .json file when the runs used one device type, else a directory that gets one <device>.toml each.")],
    profile: Annotated[Optional[list[Path]], typer.Option(help="Start from this device profile instead of the built-in one of its name (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what moved as JSON on stdout.")] = False,
) -> None:
    """Fit each device type's training kernel efficiency (forward and backward) to the stage times your runs measured (from steps alone: the kernels' rate and the per-op overhead); plan and estimate with the result through --profile."""
    if len(runs) % 2:
        raise PlanningError(f"hetpar calibrate takes PLAN METRICS pairs; got {len(runs)} paths, an odd count")
    from hetpar.planner.calibrate import CalibrationError, calibrate as fit_runs, describe, read_run, read_step_run

    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    try:
        loaded = [read_step_run(plan, seconds) if (seconds := _seconds(measured)) is not None else read_run(plan, measured)
                  for plan, measured in pairs]
        fitted, fits = fit_runs(loaded, profiles_option(profile))
    except CalibrationError as exc:
        raise PlanningError(str(exc)) from None
    single = output.suffix.lower() in (".toml", ".json")
    if single and len(fitted) > 1:
        raise PlanningError(f"the runs used {len(fitted)} device types ({', '.join(fitted)}); give --output a directory "
                            "for one profile each")
    targets = {name: output if single else output / f"{name.lower()}.toml" for name in fitted}
    if not single:
        output.mkdir(parents=True, exist_ok=True)
    for name, path in targets.items():
        text = json.dumps(profile_to_dict(fitted[name]), indent=2) + "\n" if path.suffix.lower() == ".json" \
            else dump_profile(fitted[name])
        write_text_atomic(path, text)
    if as_json:
        print_json({"profiles": {name: str(path) for name, path in targets.items()},
                    "fits": [{"device_type": f.device_type, "field": f.field, "before": f.before, "after": f.after,
                              "measured_s": f.measured_s, "predicted_before_s": f.predicted_before_s, "fitted_to": f.what, "count": f.count,
                              "runs": f.runs, "ratios": f.ratios, "capped": f.capped,
                              "sensitivity": f.sensitivity, "fixed_cost_bound": f.fixed_cost_bound} for f in fits]})
        return
    for fit in fits:
        console.print(describe(fit), soft_wrap=True)
    for name, path in targets.items():
        console.print(f"wrote {path}: plan with --profile {path}", soft_wrap=True)


def _seconds(measured: Path) -> float | None:
    """The seconds per step a METRICS argument gives as a number (no file of that name), else None."""
    if measured.exists():
        return None
    try:
        return float(str(measured))
    except ValueError:
        return None
