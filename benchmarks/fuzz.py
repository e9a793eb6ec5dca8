"""The planner fuzzed at length: N random ``hetpar plan`` commands, none may crash or hang (issue 22).

    .venv/bin/python benchmarks/fuzz.py --cases 1000 [--seed 0] [--jobs 1] > out/fuzz.md

The cases come from the generators of tests/test_fuzz_planner.py (tests/fuzz_cases.py:
random clusters, model sizes, batches, pins, objectives, heterogeneous data-parallel
modes), drawn by hypothesis from ``--seed``; each is planned, and its plan checked,
explained and compiled, by ``fuzz_cases.run_case`` in a worker process, with
``hetpar plan``'s CP-SAT work limit per candidate (10 deterministic seconds, so the
outcomes do not depend on the machine's speed or load). A case that runs past
``--case-timeout`` seconds (20 minutes by default, far above the slowest case that
finishes: docs/benchmarks/fuzz_cpu-2core_2026-12-07.md) is a
hang: its worker is killed and a fresh one takes the next case. The report counts plans, one-line errors and failures (broken
invariants, crashes, hangs), lists each failure with its command line, and gives the
wall time. Exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

from fuzz_cases import Case, cases  # noqa: E402


@dataclass(frozen=True)
class Result:
    index: int
    kind: str  # "plan" | "error" | "invariant" | "crash" | "hang"
    message: str
    wall_s: float


def draw_cases(count: int, seed_value: int, max_world: int | None) -> list[Case]:
    """``count`` distinct cases from the generators, the same ones for the same seed.

    Hypothesis draws some inputs more than once (it mutates earlier ones), so it is asked
    for three times as many and the first ``count`` distinct ones are kept.
    """
    drawn: dict[Case, None] = {}

    @seed(seed_value)
    @settings(max_examples=3 * count, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases(max_world=max_world))
    def collect(case: Case) -> None:
        drawn.setdefault(case)

    collect()
    if len(drawn) < count:
        raise SystemExit(f"the generators gave only {len(drawn)} distinct cases of the {count} asked for")
    return list(drawn)[:count]


def _worker(conn, work_limit_s: float) -> None:
    """Run the cases the parent sends, one at a time, and send back each Result."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from fuzz_cases import InvariantError, run_case, use_cached_traces

    use_cached_traces()
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        index, case = job
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="hetpar-fuzz-") as tmp:
            try:
                outcome = run_case(case, Path(tmp), work_limit_s=work_limit_s)
                kind, message = outcome.kind, outcome.message
            except InvariantError as exc:
                kind, message = "invariant", str(exc)
            except Exception as exc:  # noqa: BLE001 - a crash is what the fuzzer reports
                frames = traceback.extract_tb(exc.__traceback__)
                where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
                kind, message = "crash", f"{type(exc).__name__}{where}: {exc}"
        conn.send(Result(index=index, kind=kind, message=message, wall_s=time.perf_counter() - start))


class Worker:
    """A worker process with the case it is running."""

    def __init__(self, context, work_limit_s: float):
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker, args=(child, work_limit_s), daemon=True)
        self.process.start()
        child.close()
        self.job: tuple[int, float] | None = None  # (case index, when sent)

    def send(self, index: int, case: Case) -> None:
        self.conn.send((index, case))
        self.job = (index, time.perf_counter())

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


def run_all(todo: list[Case], jobs: int, work_limit_s: float, case_timeout_s: float, log=None) -> list[Result]:
    """Every case on ``jobs`` workers; a case past ``case_timeout_s`` is a hang and its worker is replaced."""
    context = mp.get_context("spawn")
    workers = [Worker(context, work_limit_s) for _ in range(jobs)]
    pending = list(enumerate(todo))[::-1]
    results: list[Result] = []
    while pending or any(w.job for w in workers):
        for i, w in enumerate(workers):
            if w.job is None and pending:
                w.send(*pending.pop())
            if w.job is None:
                continue
            index, sent = w.job
            if w.conn.poll(0.05):
                try:
                    result = w.conn.recv()
                except EOFError:  # the worker died (out of memory, a signal, a C++ CHECK's abort): a crash
                    w.process.join(timeout=10)
                    result = Result(index=index, kind="crash", message=f"worker died (exit code {w.process.exitcode})",
                                    wall_s=time.perf_counter() - sent)
                    w.kill()
                    workers[i] = Worker(context, work_limit_s)
                w.job = None
            elif time.perf_counter() - sent > case_timeout_s or not w.process.is_alive():
                alive = w.process.is_alive()
                w.kill()
                workers[i] = Worker(context, work_limit_s)
                result = Result(index=index, kind="hang" if alive else "crash",
                                message=f"no answer within {case_timeout_s:g} s" if alive else f"worker died (exit code {w.process.exitcode})",
                                wall_s=time.perf_counter() - sent)
            else:
                continue
            results.append(result)
            if log:
                print(f"[{len(results)}/{len(todo)}] case {result.index}: {result.kind} {result.wall_s:.1f} s  {result.message[:150]}",
                      file=log, flush=True)
    for w in workers:
        w.conn.send(None)
        w.process.join(timeout=10)
    return sorted(results, key=lambda r: r.index)


def report(todo: list[Case], results: list[Result], wall_s: float, ns) -> str:
    counts = Counter(r.kind for r in results)
    failures = [r for r in results if r.kind not in ("plan", "error")]
    times = [r.wall_s for r in results]
    lines = [
        f"# hetpar plan fuzzed: {len(todo)} cases, seed {ns.seed}",
        "",
        f"command: `.venv/bin/python benchmarks/fuzz.py --cases {ns.cases} --seed {ns.seed} --jobs {ns.jobs} "
        f"--work-limit {ns.work_limit:g} --case-timeout {ns.case_timeout:g}`",
        "",
        f"- plans: {counts['plan']} (each round-tripped, explained and compiled)",
        f"- one-line errors: {counts['error']}",
        f"- failures: {len(failures)} (broken invariants {counts['invariant']}, crashes {counts['crash']}, hangs {counts['hang']})",
        f"- wall time: {wall_s:.0f} s; per case median {statistics.median(times):.2f} s, max {max(times):.1f} s" if times else "",
        "",
    ]
    errors = Counter(_error_kind(r.message) for r in results if r.kind == "error")
    if errors:
        lines += ["## Most frequent errors", ""] + [f"- {n} x {text}" for text, n in errors.most_common(12)] + [""]
    if failures:
        lines += ["## Failures", ""]
        for r in failures:
            lines += [f"### case {r.index}: {r.kind}", "", "```", todo[r.index].command(), "```", "", r.message, ""]
    return "\n".join(lines)


def _error_kind(message: str) -> str:
    """An error message with its numbers blanked, to group alike ones."""
    import re

    return re.sub(r"\d+(\.\d+)?(e[+-]?\d+)?", "N", message)[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--work-limit", type=float, default=10.0, help="CP-SAT deterministic seconds per candidate (hetpar plan's default)")
    parser.add_argument("--case-timeout", type=float, default=1200.0, help="seconds after which a case counts as a hang")
    parser.add_argument("--max-world", type=int, default=None, help="cap on the devices of a cluster")
    parser.add_argument("--log", action="store_true", help="one line per case on stderr as it finishes")
    ns = parser.parse_args()
    start = time.perf_counter()
    todo = draw_cases(ns.cases, ns.seed, ns.max_world)
    results = run_all(todo, ns.jobs, ns.work_limit, ns.case_timeout, log=sys.stderr if ns.log else None)
    print(report(todo, results, time.perf_counter() - start, ns))
    return 1 if any(r.kind not in ("plan", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
