"""The loop users expect: a learning-rate schedule (warm-up, then cosine or linear decay),
gradient-norm clipping over the whole model, weight decay on matrices only, and step
lines with tokens/s and time left. Unit tests on runtime.training and runtime.cli; the
slow ones run compiled programs (one process, or torchrun) and compare with one process."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TORCHRUN_TIMEOUT_S, build_plan, run_torchrun, subprocess_env
from hetpar.rewriters import compile_plan
from hetpar.runtime.cli import LrDecay, parse_args
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.training import LearningRate, read_metrics
from test_distributed import GPT_ARGS, MLP_ARGS


# ----------------------------------------------------------------------------- the schedule


def closed_form(step: int, *, lr: float, warmup: int, decay: str, decay_steps: int, min_lr: float) -> float:
    """[Note: learning-rate schedule], written out again."""
    if step <= warmup:
        return lr * step / warmup
    if decay == "constant":
        return lr
    p = min((step - warmup) / (decay_steps - warmup), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * p)) if decay == "cosine" else 1 - p
    return min_lr + (lr - min_lr) * shape


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_the_schedule_at_chosen_steps_is_the_closed_form(decay):
    schedule = LearningRate(lr=3e-4, warmup_steps=4, decay=decay, decay_steps=20, min_lr=3e-5)
    for step in (1, 2, 4, 5, 12, 19, 20, 25):
        want = closed_form(step, lr=3e-4, warmup=4, decay=decay, decay_steps=20, min_lr=3e-5)
        assert schedule.at(step) == pytest.approx(want, rel=1e-12), step
    assert schedule.at(2) == pytest.approx(1.5e-4)  # half-way up the warm-up
    assert schedule.at(4) == pytest.approx(3e-4)  # the warm-up ends at the peak
    if decay != "constant":
        assert schedule.at(12) == pytest.approx((3e-4 + 3e-5) / 2)  # half-way down, for cosine and linear alike
        assert schedule.at(20) == schedule.at(25) == pytest.approx(3e-5)


def test_without_schedule_options_every_step_trains_at_lr_as_before():
    args = parse_args([], argv=["--steps", "7", "--lr", "0.5"])
    schedule = LearningRate.of(args)
    assert args.lr_decay == LrDecay.CONSTANT and args.warmup_steps == 0
    assert args.decay_steps == 7 and args.min_lr == pytest.approx(0.05)  # the defaults: --steps, 0.1 x --lr
    assert [schedule.at(s) for s in range(1, 8)] == [0.5] * 7
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    assert schedule.apply(optimizer, 3) == 0.5 and optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("argv, message", [
    (["--warmup-steps", "-1"], "--warmup-steps -1 must be >= 0"),
    (["--lr-decay", "cosine", "--warmup-steps", "10"], "--lr-decay cosine needs --decay-steps (10) > --warmup-steps (10)"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm 0.0 must be > 0"),
    (["--weight-decay", "0.1", "--optimizer", "sgd"], "--weight-decay is AdamW's; --optimizer sgd takes none"),
])
def test_options_that_make_no_sense_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(None, argv=["--steps", "10", *argv])
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- compiled runs


def compiled(tmp_path: Path, plan) -> Path:
    """``plan`` compiled into tmp_path/build, with init.pt: the model as seed 1234 builds it."""
    out = tmp_path / "build"
    compile_plan(plan, out)
    torch.manual_seed(1234)
    torch.save(load_model_file(plan.model.file, plan.model.args).build_model().state_dict(), out / "init.pt")
    return out


def run_plain(out: Path, args: list[str]) -> subprocess.CompletedProcess:
    """A plan of one process run as ``python train.py``."""
    return subprocess.run([sys.executable, "train.py", *args], cwd=out, env=subprocess_env(), capture_output=True,
                          text=True, timeout=TORCHRUN_TIMEOUT_S)


# warm-up and cosine decay, and AdamW's two parameter groups through a checkpoint; --decay-steps last
SCHEDULE = ["--optimizer", "adamw", "--lr", "1e-2", "--weight-decay", "0.1", "--warmup-steps", "2", "--lr-decay",
            "cosine", "--decay-steps", "6"]


@pytest.mark.slow
def test_a_run_resumed_at_step_3_of_6_continues_its_schedule_exactly(tmp_path, mlp_path):
    out = compiled(tmp_path, build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], num_microbatches=2))
    whole = run_plain(out, ["--steps", "6", *SCHEDULE, "--init-from", "init.pt", "--save-final", "whole.pt",
                            "--metrics", "whole.jsonl"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run_plain(out, ["--steps", "3", *SCHEDULE, "--init-from", "init.pt", "--checkpoint-dir", "ckpt",
                            "--metrics", "resumed.jsonl"])
    assert first.returncode == 0, first.stderr[-3000:]
    other = run_plain(out, ["--steps", "6", *SCHEDULE[:-1], "5", "--checkpoint-dir", "ckpt"])
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1] == (
        "hetpar: checkpoint ckpt/step-00000003 was written with --decay-steps 6 (this run: 5); a resumed run "
        "continues the loop it began (the schedule is a function of the step): resume with the checkpoint's "
        "options, or give --checkpoint-dir an empty directory to start from step 0")
    second = run_plain(out, ["--steps", "6", *SCHEDULE, "--checkpoint-dir", "ckpt", "--save-final", "resumed.pt",
                             "--metrics", "resumed.jsonl"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from ckpt/step-00000003 (step 3)" in second.stderr
    assert [r["loss"] for r in read_metrics(out / "resumed.jsonl")] == [r["loss"] for r in read_metrics(out / "whole.jsonl")]
    resumed, want = torch.load(out / "resumed.pt", weights_only=True), torch.load(out / "whole.pt", weights_only=True)
    assert all(torch.equal(resumed[k], want[k]) for k in want)
    init = torch.load(out / "init.pt", weights_only=True)
    assert not torch.equal(want["0.weight"], init["0.weight"])  # it trained


# ----------------------------------------------------------------------------- clipping


def reference(plan, init_state: dict, *, steps: int, lr: float, clip: float | None = None,
              dtype: torch.dtype = torch.float32) -> tuple[list[float], list[float], dict]:
    """One process, SGD on the whole global batch, ``torch.nn.utils.clip_grad_norm_`` when
    ``clip``: the losses, the norms it returned (before clipping) and the final state."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    model = model_file.build_model().to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in init_state.items()})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = model_file.batches(plan.global_batch_size, 0)
    losses, norms = [], []
    for _ in range(steps):
        inputs, targets = next(data)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
        targets = targets.to(dtype) if targets.is_floating_point() else targets
        opt.zero_grad()
        loss = model_file.loss(model(*inputs), targets)
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def assert_clips_like_one_process(plan, tmp_path: Path, steps: int = 3, lr: float = 0.1) -> str:
    """Run ``plan`` with ``--clip-grad-norm`` half the first step's norm and check its logged
    pre-clip norms and final weights against one process's ([Note: float tolerance]); its stderr."""
    from test_distributed import assert_within_rounding

    out = compiled(tmp_path, plan)
    init = torch.load(out / "init.pt", weights_only=True)
    _, unclipped, _ = reference(plan, init, steps=1, lr=lr, clip=float("inf"))
    clip = unclipped[0] / 2  # below every step's norm: clipping really happens
    result = run_torchrun(out / "train.py", plan.cluster.world_size, [
        "--steps", str(steps), "--optimizer", "sgd", "--lr", str(lr), "--clip-grad-norm", str(clip),
        "--init-from", "init.pt", "--save-final", "final.pt", "--metrics", "m.jsonl"])
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(out / "m.jsonl")
    _, _, ref_state = reference(plan, init, steps=steps, lr=lr, clip=clip)
    exact_losses, exact_norms, exact_state = reference(plan, init, steps=steps, lr=lr, clip=clip, dtype=torch.float64)
    assert all(n > clip for n in exact_norms)
    torch.testing.assert_close([r["grad_norm"] for r in records], exact_norms, rtol=1e-4, atol=0)
    final = torch.load(out / "final.pt", weights_only=True)
    assert_within_rounding("sgd", steps, [r["loss"] for r in records], final, ref_state, exact_losses, exact_state)
    return result.stderr


@pytest.mark.slow
def test_clipping_under_tp_2_by_pp_2_clips_by_the_one_process_norm(tmp_path, gpt_path):
    """The tp shards' squares summed, the blocks' replicated norms and biases counted once,
    both stages added ([Note: global gradient norm])."""
    plan = build_plan(gpt_path, GPT_ARGS, splits=[[0, 1], [2, 3]], tensor_parallel=2, tp_blocks=True,
                      num_microbatches=2)
    stderr = assert_clips_like_one_process(plan, tmp_path)
    assert " | grad norm " in stderr


@pytest.mark.slow
def test_clipping_counts_a_tied_weight_and_the_replicas_once(tmp_path):
    """dp 2 x pp 2 of a GPT whose head is tied to its embedding: the two stages' copies and
    the two replicas' equal gradients count once each."""
    no_dropout = {**GPT_ARGS, "dropout": 0.0}  # whose masks one process and a pipeline draw differently
    plan = build_plan(ROOT / "benchmarks" / "published" / "gpt.py", no_dropout, splits=[[0, 1], [2, 3]],
                      data_parallel=2, num_microbatches=2, schedule="gpipe")
    assert "weights tied across stages" in assert_clips_like_one_process(plan, tmp_path)


@pytest.mark.slow
def test_clipping_sums_the_shards_of_zero_3(tmp_path, mlp_path):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=2, num_microbatches=2, zero_stage=3)
    assert_clips_like_one_process(plan, tmp_path)


# ----------------------------------------------------------------------------- weight decay


def test_weight_decay_skips_norms_and_biases():
    from hetpar.runtime.training import make_optimizer

    model = load_model_file(Path(__file__).resolve().parent.parent / "examples" / "gpt.py", GPT_ARGS).build_model()
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = make_optimizer("adamw", model.parameters(), 1e-3, weight_decay=0.1)
    decayed, kept = ({names[id(p)] for p in g["params"]} for g in optimizer.param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert decayed == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert "tok_emb.weight" in decayed and "blocks.0.attn.q.weight" in decayed
    assert kept and all(n.endswith(".bias") or n.split(".")[-2].startswith("ln") for n in kept), kept  # the LayerNorms
    plain = make_optimizer("adamw", model.parameters(), 1e-3)  # without the option: torch's default, every parameter
    assert len(plain.param_groups) == 1 and plain.param_groups[0]["weight_decay"] == 0.01
    with pytest.raises(ValueError, match="weight decay is AdamW's"):
        make_optimizer("sgd", model.parameters(), 1e-3, weight_decay=0.1)


# ----------------------------------------------------------------------------- step lines


def test_step_lines_carry_tokens_per_s_lr_grad_norm_and_time_left(tmp_path, capsys, gpt_path):
    from hetpar.runtime.training import StepLogger, tokens_per_sample

    assert tokens_per_sample(load_model_file(gpt_path, GPT_ARGS)) == GPT_ARGS["seq_len"]
    assert tokens_per_sample(load_model_file(gpt_path.with_name("mlp.py"), MLP_ARGS)) is None  # not token ids
    logger = StepLogger(enabled=True, total_steps=10, global_batch_size=8, metrics=tmp_path / "m.jsonl",
                        tokens_per_sample=16)
    logger.log(1, 2.5, 0.5, lr=3e-4, grad_norm=1.25)
    logger.log(2, 2.4, 1.5, lr=3e-4)
    logger.close()
    first, second = read_metrics(tmp_path / "m.jsonl")
    assert first == {"kind": "step", "step": 1, "loss": 2.5, "step_time_s": 0.5, "samples_per_s": 16.0,
                     "tokens_per_s": 256.0, "time_left_s": 4.5, "lr": 3e-4, "grad_norm": 1.25}
    assert second["tokens_per_s"] == second["samples_per_s"] * 16 and second["time_left_s"] == 8.0  # mean 1 s x 8
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "step  1/10 | loss 2.500000 |    500.0 ms |      16.0 samples/s | 256 tokens/s | lr 0.0003 | " \
                       "grad norm 1.25 | 0:00:04 left"
    assert lines[1].endswith("| 0:00:08 left")


def test_step_lines_carry_mfu_from_the_plans_flops_and_peak(tmp_path, capsys):
    """MFU = the plan's model FLOPs per step / step time / the devices' summed peak; none
    where the plan gives either as 0."""
    from hetpar.runtime.training import StepLogger

    logger = StepLogger(enabled=True, total_steps=2, global_batch_size=8, metrics=tmp_path / "m.jsonl",
                        model_flops_per_step=3e12, peak_flops_per_s=20e12)
    logger.log(1, 2.5, 0.5)
    logger.close()
    (record,) = read_metrics(tmp_path / "m.jsonl")
    assert record["mfu"] == 3e12 / 0.5 / 20e12  # 30%
    assert "| MFU 30.0% |" in capsys.readouterr().err
    logger = StepLogger(enabled=True, total_steps=2, global_batch_size=8, metrics=tmp_path / "n.jsonl",
                        model_flops_per_step=3e12)
    logger.log(1, 2.5, 0.5)
    logger.close()
    assert "mfu" not in read_metrics(tmp_path / "n.jsonl")[0]


def test_a_searched_plan_carries_the_models_flops_and_its_devices_peak(gpt_path):
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.capture import trace_model
    from hetpar.planner.options import SearchOptions
    from hetpar.rewriters.program import program_source

    cluster = parse_cluster("1x2xA100-80GB")
    plan = plan_model(gpt_path, cluster, SearchOptions(global_batch_size=8, dtype="bf16"), model_args=GPT_ARGS)
    graph = trace_model(load_model_file(gpt_path, GPT_ARGS))
    assert plan.predicted.model_flops_per_step == sum(l.fwd_flops + l.bwd_flops for l in graph.layers) * 8 > 0
    assert plan.predicted.peak_flops_per_s == 2 * 312e12  # two A100s' bf16 dense peak
    source = program_source(plan)
    assert f"MODEL_FLOPS_PER_STEP = {plan.predicted.model_flops_per_step!r}" in source
    assert "PEAK_FLOPS_PER_S = 624000000000000.0" in source


@pytest.mark.slow
def test_a_program_logs_tokens_per_s_as_samples_per_s_times_t(tmp_path, gpt_path):
    out = compiled(tmp_path, build_plan(gpt_path, GPT_ARGS, splits=[[0, 1, 2, 3]], num_microbatches=2))
    done = run_plain(out, ["--steps", "3", "--warmup-steps", "2", "--lr", "0.01", "--metrics", "m.jsonl"])
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_metrics(out / "m.jsonl")
    assert [r["lr"] for r in records] == [0.005, 0.01, 0.01]
    assert all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * GPT_ARGS["seq_len"]) for r in records)
    assert records[-1]["time_left_s"] == 0 and records[0]["time_left_s"] > 0
    assert " tokens/s | lr 0.005 | " in done.stderr and " left" in done.stderr
