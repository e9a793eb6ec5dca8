"""Wall time of the timed pipeline simulator (runtime/schedule.py ``simulate_timed``) on large schedules.

Plays three large schedules with unequal stages and a transfer per send, without and
with a late-receive charge ([Note: late receives]), and prints the median of
``--repeats`` timings of each. ``--code`` times another checkout's simulator (one from
before the charge has no second column):

    git worktree add --detach /tmp/before <commit>
    .venv/bin/python benchmarks/simulate_bench.py --code /tmp/before
    .venv/bin/python benchmarks/simulate_bench.py

Results: docs/benchmarks/late-receive_cpu-2core_2026-12-03.md.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("1f1b", 16, 128, 1), ("interleaved", 8, 64, 4), ("zb", 32, 256, 1)]  # (schedule, p, m, v)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, default=ROOT, help="the hetpar checkout whose simulator to time")
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    sys.path.insert(0, str(ns.code.resolve()))
    from hetpar.runtime import schedule

    late = "late_receive_s" in inspect.signature(schedule.simulate_timed).parameters

    def timed(plan, *extra) -> tuple[float, float]:
        samples, makespan = [], 0.0
        for _ in range(ns.repeats):
            start = time.perf_counter()
            makespan = schedule.simulate_timed(plan, lambda a: 1.0 + 0.1 * a.stage, lambda s, r: 0.05, *extra).makespan_s
            samples.append(time.perf_counter() - start)
        return statistics.median(samples), makespan

    print("| schedule | p | m | v | actions | plain | makespan | with a late-receive charge of 0.3 | makespan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, p, m, v in CASES:
        plan = schedule.build_schedule(name, p, m, v)
        plain_s, plain_makespan = timed(plan)
        row = f"| {name} | {p} | {m} | {v} | {sum(map(len, plan))} | {plain_s * 1e3:.0f} ms | {plain_makespan:.1f} |"
        if late:
            late_s, late_makespan = timed(plan, lambda sender: 0.3)
            row += f" {late_s * 1e3:.0f} ms | {late_makespan:.1f} |"
        else:
            row += " - | - |"
        print(row)


if __name__ == "__main__":
    main()
