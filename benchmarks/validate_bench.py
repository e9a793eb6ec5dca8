"""Predictions against this machine: profile it, then plan, run and validate a matrix of plans.

    .venv/bin/python benchmarks/validate_bench.py --out out/validate_bench --rounds 3 --model-layers

Calibration comes only from `hetpar profile`; the validation runs are measured and
compared, never fitted. Each of ``--rounds`` rounds goes through the matrix one group of
rows at a time (the rows that share a profile: same worker count, and with
``--model-layers`` the same model): it profiles the machine, then plans and runs that
group's plans with the fresh profile, so that each plan runs minutes, not a whole
round, after the profile that predicts it (one or two with ``--model-layers``, up to
four for the last 2-worker row without), and a busy minute of the shared machine does
not hit one plan only; with ``--profile-each`` it profiles right before every plan (a
plan then runs seconds after its profile). A plan's predicted step time is the median
of its rounds' predictions, its measured one the median over all measured steps of all
rounds. Prints a Markdown table, the summary (median and worst |error|, Spearman) and
the median error of the stages' forwards and backwards.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the layer-model column estimates plans in this process
HETPAR = [sys.executable, "-m", "hetpar"]
GPT, MLP = str(ROOT / "examples/gpt.py"), str(ROOT / "examples/mlp.py")
SMALL_GPT = ["-a", "n_layers=4", "-a", "hidden=128"]
LARGE_GPT = ["-a", "n_layers=4", "-a", "hidden=256", "-a", "seq_len=64"]
MLP_ARGS = ["-a", "depth=8", "-a", "width=256"]

# (name, model, model args, cluster, global batch, pins). The micro-batch size is pinned
# (to what the planner chose in earlier runs) so that every round runs the same plan: a
# profile of a drifting host can tip the planner between two near-equal sizes, and the
# measured steps of two plans must not be pooled.
MATRIX = [
    ("gpt-s dp2", GPT, SMALL_GPT, "1x2xcpu", 16, ["--dp", "2", "--micro-batch-size", "8"]),
    ("gpt-s pp2 1f1b", GPT, SMALL_GPT, "1x2xcpu", 16, ["--pp", "2", "--schedule", "1f1b", "--micro-batch-size", "4"]),
    ("gpt-s pp2 gpipe", GPT, SMALL_GPT, "1x2xcpu", 16, ["--pp", "2", "--schedule", "gpipe", "--micro-batch-size", "4"]),
    ("gpt-s tp2", GPT, SMALL_GPT, "1x2xcpu", 16, ["--tp", "2", "--micro-batch-size", "16"]),
    ("gpt-l dp2", GPT, LARGE_GPT, "1x2xcpu", 16, ["--dp", "2", "--micro-batch-size", "4"]),
    ("gpt-l pp2 1f1b", GPT, LARGE_GPT, "1x2xcpu", 16, ["--pp", "2", "--schedule", "1f1b", "--micro-batch-size", "2"]),
    ("gpt-l pp2 gpipe", GPT, LARGE_GPT, "1x2xcpu", 16, ["--pp", "2", "--schedule", "gpipe", "--micro-batch-size", "2"]),
    ("gpt-l tp2", GPT, LARGE_GPT, "1x2xcpu", 16, ["--tp", "2", "--micro-batch-size", "16"]),
    ("mlp dp2", MLP, MLP_ARGS, "1x2xcpu", 64, ["--dp", "2", "--micro-batch-size", "32"]),
    ("mlp pp2 1f1b", MLP, MLP_ARGS, "1x2xcpu", 64, ["--pp", "2", "--schedule", "1f1b", "--micro-batch-size", "32"]),
    ("gpt-s dp2 pp2", GPT, SMALL_GPT, "1x4xcpu", 16, ["--dp", "2", "--pp", "2", "--schedule", "1f1b", "--micro-batch-size", "4"]),
    ("gpt-s dp2 tp2", GPT, SMALL_GPT, "1x4xcpu", 16, ["--dp", "2", "--tp", "2", "--micro-batch-size", "8"]),
]


def _hetpar(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([*HETPAR, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"hetpar {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (no ties expected in timings)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


@functools.cache
def _reference_layers():
    from hetpar.commands.profiling import reference_graph

    return reference_graph().layers


def _layer_model_prediction(plan_path: Path, profile_path: Path) -> float:
    """The plan's step time estimated again with the profile it was planned with, refitted
    from the same measurements less the timed layers: what the layer model alone predicts."""
    from hetpar.cost_models.calibrate import fit_profile
    from hetpar.cost_models.devices import get_device
    from hetpar.planner.explain import explain_plan
    from hetpar.planner.plan import ParallelPlan

    plan = ParallelPlan.load(plan_path)
    record = json.loads(profile_path.with_suffix(".measurements.json").read_text())
    record.pop("model_layers", None)
    profile = fit_profile(record, get_device("cpu"), _reference_layers())
    return explain_plan(plan, profiles={profile.name: profile}).estimate.time.step_s


def _profile_key(ns, model: str, args: list[str], cluster: str, row: int) -> tuple:
    """Which profile a row is predicted with: one per worker count (a plan for 4 ranks runs
    4 workers at once on this host, and the profile measures what each rank gets when that
    many compute together), and with --model-layers one per worker count and model, which
    also times that model's layers ([Note: measured layers]); with --profile-each, one per row."""
    world = int(cluster.split("x")[1])
    key = (world, model, tuple(args)) if ns.model_layers else (world,)
    return (*key, row) if ns.profile_each else key


def _profile(ns, key: tuple, path: Path) -> None:
    """Profile this machine for the rows of ``key`` into ``path``."""
    if ns.reuse_profiles and path.is_file():
        return
    world = key[0]
    measured = ["--model", key[1], *key[2]] if ns.model_layers else []
    print(f"profiling this machine with {world} workers {' '.join(measured)} -> {path}", file=sys.stderr)
    _hetpar("profile", "-o", str(path), "--nproc", str(world), *measured, *(["--quick"] if ns.quick_profile else []),
            *(["--passes", str(ns.profile_passes)] if ns.profile_passes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out/validate_bench")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick-profile", action="store_true")
    parser.add_argument("--reuse-profiles", action="store_true", help="use the profiles an earlier run left in --out")
    parser.add_argument("--model-layers", action="store_true", help="profile each model with --model (measured layers)")
    parser.add_argument("--rows", help="comma-separated row indices to run (default: all)")
    parser.add_argument("--profile-each", action="store_true",
                        help="profile the machine right before every plan (one profile per row and round)")
    parser.add_argument("--profile-passes", type=int, help="hetpar profile --passes (default: its own)")
    ns = parser.parse_args()
    chosen = [int(i) for i in ns.rows.split(",")] if ns.rows else list(range(len(MATRIX)))
    rows = [{"name": MATRIX[i][0], "cluster": MATRIX[i][3], "predictions": [], "steps": [], "plans": []} for i in chosen]
    # The rows that share a profile, in the matrix's order (the host's speed moves by
    # 20-30% within minutes: a profile taken ten minutes before a run predicts another machine).
    groups: dict[tuple, list[int]] = {}
    for i in chosen:
        _, model, args, cluster, _, _ = MATRIX[i]
        groups.setdefault(_profile_key(ns, model, args, cluster, i), []).append(i)
    by_index = dict(zip(chosen, rows))
    for r in range(ns.rounds):
        round_dir = ns.out / f"round{r + 1}"
        round_dir.mkdir(parents=True, exist_ok=True)
        for g, (key, members) in enumerate(groups.items()):
            profile = round_dir / f"profile-{key[0]}-{g}.json"
            _profile(ns, key, profile)
            for i in members:
                name, model, args, cluster, batch, pins = MATRIX[i]
                row = by_index[i]
                plan = round_dir / f"plan{i}.json"
                _hetpar("plan", model, "-c", cluster, "-b", str(batch), *args, *pins, "--profile", str(profile), "-o", str(plan))
                print(f"round {r + 1}: {name}", file=sys.stderr)
                result = json.loads(_hetpar("validate", str(plan), "--steps", str(ns.steps), "--json"))
                row["predictions"].append(result["predicted_step_time_s"])
                row["steps"] += result["step_times_s"][2:]
                row["plans"].append(str(plan))
                row.setdefault("profiles", []).append(str(profile))
                row.setdefault("stages", []).append(result.get("stages", []))
                # So far, in case a later run fails: what the finished rounds measured.
                (ns.out / "partial.json").write_text(json.dumps(rows, indent=2))
    if ns.model_layers:
        for row in rows:  # the same plans and profiles, the profiles refitted without the timed layers
            row["layer_model"] = statistics.median(_layer_model_prediction(Path(plan), Path(profile))
                                                   for plan, profile in zip(row["plans"], row["profiles"], strict=True))
    for row in rows:
        row["predicted"] = statistics.median(row["predictions"])
        row["measured"] = statistics.median(row["steps"])
        row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
    errors = [abs(r["error"]) for r in rows]
    rho = spearman([r["predicted"] for r in rows], [r["measured"] for r in rows])
    if ns.model_layers:
        print("| plan | cluster | predicted | measured | error | layer model alone | error |\n|---|---|---|---|---|---|---|")
    else:
        print("| plan | cluster | predicted | measured | error |\n|---|---|---|---|---|")
    for r in rows:
        shapes = []
        for path in r["plans"]:
            plan = json.loads(Path(path).read_text())
            shapes.append(f"{plan['micro_batch_size']}x{plan['num_microbatches']}")
        detail = "mb " + " / ".join(dict.fromkeys(shapes))
        alone = ""
        if "layer_model" in r:
            alone = f" {r['layer_model'] * 1e3:.1f} ms | {(r['layer_model'] - r['measured']) / r['measured']:+.1%} |"
        print(f"| {r['name']} ({detail}) | {r['cluster']} | {r['predicted'] * 1e3:.1f} ms | {r['measured'] * 1e3:.1f} ms | "
              f"{r['error']:+.1%} |{alone}")
    print(f"\n{len(rows)} plans: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, Spearman {rho:.3f}")
    stage_errors = {pass_: [st[f"predicted_{pass_}_s"] / st[f"measured_{pass_}_s"] - 1 for r in rows
                            for stages in r.get("stages", []) for st in stages if st[f"measured_{pass_}_s"] > 0]
                    for pass_ in ("fwd", "bwd")}
    if stage_errors["fwd"]:
        print("per stage and micro-batch (every round): median error forward "
              f"{statistics.median(stage_errors['fwd']):+.1%}, backward {statistics.median(stage_errors['bwd']):+.1%}")
    if ns.model_layers:
        alone = [abs(r["layer_model"] - r["measured"]) / r["measured"] for r in rows]
        rho = spearman([r["layer_model"] for r in rows], [r["measured"] for r in rows])
        print(f"layer model alone: median |error| {statistics.median(alone):.1%}, worst {max(alone):.1%}, Spearman {rho:.3f}")
    (ns.out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
