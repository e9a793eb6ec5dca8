"""Predict a finished validate_bench run again from its own measurements, with another fit.

Each plan of the run is estimated again under the profile refitted from the raw
measurements it was planned with, less any timed layers (validate_bench.py's
``_layer_model_prediction``, as ``--code``, a checkout of hetpar, default this one,
has it), and set against the steps the run measured. So two versions of the fits compare on the very same runs:

    git worktree add --detach /tmp/before <commit>
    .venv/bin/python benchmarks/refit_run.py out/vb15 --code /tmp/before
    .venv/bin/python benchmarks/refit_run.py out/vb15

Paths in the run's results are relative to the directory the run was started in
(``--cwd``, default the parent of the run's ``out`` directory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a validate_bench --out directory")
    parser.add_argument("--code", type=Path, default=ROOT, help="the hetpar checkout whose fits to use")
    parser.add_argument("--cwd", type=Path, help="where the run was started (default: two levels above RUN)")
    ns = parser.parse_args()
    sys.path.insert(0, str(ns.code.resolve()))
    from benchmarks.validate_bench import _layer_model_prediction, spearman

    results = ns.run / "results.json"
    if not results.is_file():
        sys.exit(f"refit_run: {results} not found; give a finished validate_bench --out directory")
    base = ns.cwd or ns.run.resolve().parent.parent
    rows = json.loads(results.read_text())
    predicted, measured = [], []
    print("| plan | predicted | measured | error |\n|---|---|---|---|")
    for row in rows:
        predicted.append(statistics.median(_layer_model_prediction(base / plan, base / profile)
                                           for plan, profile in zip(row["plans"], row["profiles"], strict=True)))
        measured.append(statistics.median(row["steps"]))
        print(f"| {row['name']} | {predicted[-1] * 1e3:.1f} ms | {measured[-1] * 1e3:.1f} ms | {predicted[-1] / measured[-1] - 1:+.1%} |")
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
    print(f"\n{len(rows)} plans: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, "
          f"Spearman {spearman(predicted, measured):.3f} (fits of {ns.code.resolve()})")


if __name__ == "__main__":
    main()
