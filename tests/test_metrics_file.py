"""The metrics file's contract ([Note: metrics file], docs/running.md): one JSON object
per line, each with a ``kind``; step lines carry step, loss, step time and throughput;
readers of steps skip every other kind. And the README's demo, end to end."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from hetpar.runtime.training import StepLogger, read_metrics

STEP_FIELDS = {"kind", "step", "loss", "step_time_s", "samples_per_s", "time_left_s"}


def write_run(path: Path, steps: int, *, start_step: int = 0) -> None:
    logger = StepLogger(enabled=True, total_steps=steps, global_batch_size=8, metrics=path, start_step=start_step)
    for step in range(start_step + 1, steps + 1):
        logger.log(step, loss=1.0 / step, step_time_s=0.5)
    logger.log_stages([{"stage": 0, "fwd_s": 0.1, "bwd_s": 0.2}])
    logger.close()


def test_every_line_is_an_object_with_a_kind_and_step_lines_have_the_documented_fields(tmp_path):
    path = tmp_path / "m.jsonl"
    write_run(path, 3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["kind"] for line in lines] == ["step", "step", "step", "stages"]
    steps = read_metrics(path)
    assert all(set(r) == STEP_FIELDS for r in steps)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["samples_per_s"] for r in steps] == [16.0, 16.0, 16.0]  # 8 samples in 0.5 s
    assert read_metrics(path, "stages") == [{"kind": "stages", "stages": [{"stage": 0, "fwd_s": 0.1, "bwd_s": 0.2}]}]


def test_a_resumed_run_keeps_the_steps_up_to_its_checkpoint_and_drops_the_rest(tmp_path):
    path = tmp_path / "m.jsonl"
    write_run(path, 5)
    with open(path, "a") as f:
        f.write('{"kind": "step", "step": 6, "lo')  # cut short by the crash
    write_run(path, 6, start_step=2)
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in read_metrics(path)] == [1.0 / s for s in range(1, 7)]
    assert len(read_metrics(path, "stages")) == 1  # the interrupted run's stage line is not kept


@pytest.mark.slow
def test_the_readme_demo_runs_and_prints_its_losses(tmp_path):
    """``make demo``'s script, as a new user runs it (CI also runs ``make demo`` itself)."""
    bindir = Path(os.sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["sh", str(ROOT / "scripts" / "demo.sh"), str(tmp_path / "demo"), "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("== losses: ") and "at step 8" in last, last
    steps = read_metrics(tmp_path / "demo" / "metrics.jsonl")
    assert [r["step"] for r in steps] == list(range(1, 9))
