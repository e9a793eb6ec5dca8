"""Checkpoints: atomic writes, resume from the newest intact one, fallback on corruption.

In-process tests drive runtime.checkpoint directly (one process, no process group);
the slow ones run compiled programs under torchrun: a worker killed with SIGKILL
under ``--max-restarts=1``, and a corrupted newest checkpoint. Both must end with the
parameters of an uninterrupted run (the single-process reference loop)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import build_plan, run_torchrun
from hetpar.rewriters import compile_plan
from hetpar.runtime.checkpoint import MARKER, CheckpointError, Checkpointer, list_complete
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.precision import LossScaler
from hetpar.runtime.training import read_metrics
from test_distributed import LR, MLP_ARGS, assert_matches_reference, reference_run


def make_state(seed: int = 0):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return module, torch.optim.AdamW(module.parameters(), lr=1e-2)


def train_steps(module, optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 2, generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(module(x), y).backward()
        optimizer.step()


def saved_run(directory: Path, steps: int, every: int, keep: int = 3) -> Checkpointer:
    module, optimizer = make_state()
    checkpoints = Checkpointer(directory, every=every, keep=keep)
    scaler = LossScaler(enabled=False)
    for step in range(1, steps + 1):
        train_steps(module, optimizer, 1, start=step - 1)
        checkpoints.maybe_save(step, module, optimizer, scaler, last=step == steps)
    return checkpoints


def test_resume_restores_parameters_and_optimizer_state(tmp_path):
    checkpoints = saved_run(tmp_path, steps=4, every=2)
    assert [f.step for f in list_complete(tmp_path)] == [4, 2]
    module, optimizer = make_state(seed=1)  # different weights: all of them must come from the checkpoint
    assert checkpoints.restore(module, optimizer, LossScaler(enabled=False)) == 4
    train_steps(module, optimizer, 2, start=4)
    ref_module, ref_optimizer = make_state()
    train_steps(ref_module, ref_optimizer, 6)
    for a, b in zip(module.state_dict().values(), ref_module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_marker_lists_every_file_with_its_hash(tmp_path):
    saved_run(tmp_path, steps=2, every=2)
    marker = json.loads((tmp_path / "step-00000002" / MARKER).read_text())
    files = sorted(p.name for p in (tmp_path / "step-00000002").iterdir() if p.name != MARKER)
    assert sorted(marker["files"]) == files and ".metadata" in files and "rng-0.pt" in files
    assert marker["step"] == 2 and marker["world_size"] == 1


def test_unfinished_writes_are_never_resumed_and_are_cleaned_up(tmp_path):
    saved_run(tmp_path, steps=2, every=2)
    # A crash mid-write leaves a .tmp- directory; one without a marker is not complete either.
    (tmp_path / ".tmp-step-00000004").mkdir()
    (tmp_path / ".tmp-step-00000004" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "step-00000006").mkdir()
    module, optimizer = make_state()
    assert Checkpointer(tmp_path, every=2, keep=3).restore(module, optimizer, LossScaler(enabled=False)) == 2
    assert not (tmp_path / ".tmp-step-00000004").exists()


def test_corrupt_newest_checkpoint_falls_back_and_says_so(tmp_path, capsys):
    checkpoints = saved_run(tmp_path, steps=4, every=2)
    data = next((tmp_path / "step-00000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, the size unchanged
    data.write_bytes(bytes(raw))
    module, optimizer = make_state(seed=1)
    assert checkpoints.restore(module, optimizer, LossScaler(enabled=False)) == 2
    err = capsys.readouterr().err
    assert f"hetpar: checkpoint {tmp_path / 'step-00000004'} is corrupt ({data.name} fails its sha256 check); " \
           f"falling back to {tmp_path / 'step-00000002'}" in err
    assert f"hetpar: resuming from {tmp_path / 'step-00000002'} (step 2)" in err


def test_every_checkpoint_corrupt_stops_the_run(tmp_path):
    checkpoints = saved_run(tmp_path, steps=2, every=2)
    (tmp_path / "step-00000002" / ".metadata").unlink()
    module, optimizer = make_state()
    with pytest.raises(CheckpointError, match="every checkpoint in .* is corrupt; move them away"):
        checkpoints.restore(module, optimizer, LossScaler(enabled=False))


def test_only_the_newest_are_kept(tmp_path):
    saved_run(tmp_path, steps=8, every=2, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000008"]


def test_loss_scaler_state_is_checkpointed(tmp_path):
    module, optimizer = make_state()
    train_steps(module, optimizer, 1)
    scaler = LossScaler(enabled=True)
    scaler.scale, scaler.good_steps = 1024.0, 7
    Checkpointer(tmp_path, every=1, keep=1).maybe_save(1, module, optimizer, scaler)
    restored = LossScaler(enabled=True)
    Checkpointer(tmp_path, every=1, keep=1).restore(*make_state(), restored)
    assert (restored.scale, restored.good_steps) == (1024.0, 7)


# ----------------------------------------------------------------------------- real runs

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KILL_AT_BATCH = 5  # rank 1 dies fetching the batch of step 5, after the checkpoint of step 4
KILLER_BATCHES = f'''

import os
import signal


def batches(batch_size, seed, in_features=32, out_features=8, **_):
    """Synthetic data; rank 1 of the first attempt kills itself with SIGKILL at batch {KILL_AT_BATCH}."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    while True:
        n += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if n == {KILL_AT_BATCH} and os.environ.get("RANK") == "1" and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        yield (torch.randn(batch_size, in_features, generator=gen),), torch.randn(batch_size, out_features, generator=gen)
'''


def compiled(tmp_path: Path, model_path: Path, plan_kwargs: dict) -> tuple[object, Path, dict]:
    plan = build_plan(model_path, MLP_ARGS, **plan_kwargs)
    out = tmp_path / "build"
    compile_plan(plan, out)
    torch.manual_seed(1234)
    init_state = load_model_file(plan.model.file, plan.model.args).build_model().state_dict()
    torch.save(init_state, out / "init.pt")
    return plan, out, init_state


def assert_final_matches_reference(out: Path, plan, init_state: dict, optimizer: str, steps: int) -> None:
    final = torch.load(out / "final.pt", weights_only=True)
    _, ref_state = reference_run(plan, init_state, optimizer, steps)
    records = read_metrics(out / "m.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert_matches_reference(plan, init_state, optimizer, steps, [r["loss"] for r in records], final, ref_state)


def run_args(steps: int, optimizer: str, every: int) -> list[str]:
    return ["--steps", str(steps), "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--init-from", "init.pt",
            "--save-final", "final.pt", "--metrics", "m.jsonl", "--checkpoint-dir", "ckpt",
            "--checkpoint-every", str(every), "--dist-timeout-s", "60"]


@pytest.mark.slow
def test_a_worker_killed_mid_run_costs_only_the_steps_since_the_checkpoint(tmp_path, mlp_path):
    model_path = tmp_path / "killer.py"
    model_path.write_text(mlp_path.read_text() + KILLER_BATCHES)
    # pp 2 with 1F1B and AdamW: the restarted run needs the optimizer state and the data position.
    plan, out, init_state = compiled(tmp_path, model_path, dict(splits=[[0, 1], [2, 3]], num_microbatches=2))
    result = run_torchrun(out / "train.py", 2, run_args(steps=7, optimizer="adamw", every=2),
                          max_restarts=1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "Signals.SIGKILL" in result.stderr or "exitcode: -9" in result.stderr, result.stderr[-4000:]
    assert "hetpar: resuming from ckpt/step-00000004 (step 4)" in result.stderr
    assert_final_matches_reference(out, plan, init_state, "adamw", steps=7)


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_on_resume(tmp_path, mlp_path):
    """dp 2 with ZeRO-3: parameters and AdamW state are saved as FSDP shards."""
    plan, out, init_state = compiled(tmp_path, mlp_path, dict(splits=[[0, 1, 2, 3]], data_parallel=2,
                                                               num_microbatches=2, zero_stage=3))
    first = run_torchrun(out / "train.py", 2, run_args(steps=4, optimizer="adamw", every=2))
    assert first.returncode == 0, first.stderr[-4000:]
    data = sorted((out / "ckpt" / "step-00000004").glob("*.distcp"))[-1]
    raw = bytearray(data.read_bytes())
    raw[-9] ^= 0xFF
    data.write_bytes(bytes(raw))
    second = run_torchrun(out / "train.py", 2, run_args(steps=6, optimizer="adamw", every=2))
    assert second.returncode == 0, second.stderr[-4000:]
    assert (f"hetpar: checkpoint ckpt/step-00000004 is corrupt ({data.name} fails its sha256 check); "
            "falling back to ckpt/step-00000002") in second.stderr
    assert "hetpar: resuming from ckpt/step-00000002 (step 2)" in second.stderr
    assert_final_matches_reference(out, plan, init_state, "adamw", steps=6)
