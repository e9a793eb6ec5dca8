"""Issue 33's whole path, as a user takes it: a Hugging Face checkpoint directory and a
token file -> ``hetpar plan --hf`` (the shipped hetpar/models/hf_causal_lm.py) ->
``hetpar compile`` -> 20 steps at dp 2, tp 2, pp 2 and cp 2 from the checkpoint's weights on
the file's rows -> ``--save-hf``; ``from_pretrained`` loads the result and its logits
are the trained state's; the losses, and the held-out losses of ``--eval-data``, are one
process's on the same rows; a run resumed at step 10 ends as the uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from conftest import run_torchrun
from test_distributed import assert_within_rounding
from test_token_data import GLOBAL_BATCH, LR, SEQ, VOCAB, reference_losses, save_tiny_llama, write_tokens

from hetpar.commands.common import model_extra_files, model_source
from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.options import SearchOptions
from hetpar.rewriters import compile_plan
from hetpar.runtime.training import read_metrics

STEPS = 20
EVAL_EVERY, EVAL_BATCHES = 10, 3  # held-out losses after steps 10 and 20, over 3 of the file's 7 batches
DEGREES = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2), "cp2": dict(cp=2)}

tf = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_workflow")
    model = save_tiny_llama(root / "llama", seed=1)
    write_tokens(root / "train.bin", 6000, vocab=VOCAB, seed=1)
    write_tokens(root / "val.bin", 1000, vocab=VOCAB, seed=2)  # 62 sequences: 7 global batches
    return root, model.state_dict()


def _plan(root, degrees: dict):
    model_file, args = model_source(None, str(root / "llama"), SEQ, None)
    world = degrees.get("dp", 1) * degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("cp", 1)
    options = SearchOptions(global_batch_size=GLOBAL_BATCH, dtype="fp32", schedule="1f1b", micro_batch_size=2,
                            **{"dp": 1, "tp": 1, "pp": 1, "cp": 1, **degrees})
    return plan_model(model_file, parse_cluster(f"1x{world}xcpu"), options, model_args=args)


def _train(build, root, *, steps: int, out: str, checkpoint_dir=None):
    extra = ["--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", "10"] if checkpoint_dir else []
    result = run_torchrun(build / "train.py", 2, [
        "--steps", str(steps), "--optimizer", "sgd", "--lr", str(LR), "--init-from", str(root / "llama"),
        "--data", str(root / "train.bin"), "--save-final", f"{out}.pt", "--save-hf", str(build / out),
        "--eval-data", str(root / "val.bin"), "--eval-every", str(EVAL_EVERY), "--eval-batches", str(EVAL_BATCHES),
        "--metrics", f"{out}.jsonl", *extra])
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(DEGREES))
def test_checkpoint_and_token_file_to_a_trained_checkpoint(corpus, tmp_path, layout):
    root, init_state = corpus
    plan = _plan(root, DEGREES[layout])
    assert (plan.data_parallel, plan.stages[0].tensor_parallel, plan.pipeline_parallel,
            plan.stages[0].context_parallel) == tuple(DEGREES[layout].get(k, 1) for k in ("dp", "tp", "pp", "cp"))
    build = tmp_path / "build"
    compile_plan(plan, build, extra_files=model_extra_files(plan))
    _train(build, root, steps=STEPS, out="trained", checkpoint_dir=tmp_path / "ckpt" if layout == "pp2" else None)

    losses = [r["loss"] for r in read_metrics(build / "trained.jsonl")]
    final = torch.load(build / "trained.pt", weights_only=True)
    ref_losses, ref_state = reference_losses(plan, init_state, root / "train.bin", STEPS)
    exact_evals: dict[int, float] = {}
    exact_losses, exact_state = reference_losses(plan, init_state, root / "train.bin", STEPS, dtype=torch.float64,
                                                 held_out=(root / "val.bin", EVAL_EVERY, EVAL_BATCHES, exact_evals))
    assert_within_rounding("sgd", STEPS, losses, final, ref_state, exact_losses, exact_state)
    assert ref_losses[-1] < ref_losses[0]
    evals = read_metrics(build / "trained.jsonl", kind="eval")  # a held-out loss as one process's, a mean's rounding
    assert [r["step"] for r in evals] == [10, 20] and {r["sequences"] for r in evals} == {EVAL_BATCHES * GLOBAL_BATCH}
    torch.testing.assert_close([r["loss"] for r in evals], [exact_evals[10], exact_evals[20]], rtol=1e-4, atol=0)

    saved = tf.AutoModelForCausalLM.from_pretrained(build / "trained")
    trained = tf.AutoModelForCausalLM.from_pretrained(root / "llama")
    trained.load_state_dict(final)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(saved(tokens).logits, trained(tokens).logits, rtol=0, atol=0)

    if layout == "pp2":  # resumed at step 10 from the first run's checkpoint, it ends where that run ended
        (tmp_path / "resume").mkdir()
        for step_dir in (tmp_path / "ckpt").iterdir():
            if "20" not in step_dir.name:
                step_dir.rename(tmp_path / "resume" / step_dir.name)
        result = _train(build, root, steps=STEPS, out="resumed", checkpoint_dir=tmp_path / "resume")
        assert "(step 10)" in result.stderr
        resumed = read_metrics(build / "resumed.jsonl")
        assert [r["step"] for r in resumed] == list(range(11, STEPS + 1))
        torch.testing.assert_close([r["loss"] for r in resumed], losses[10:], rtol=1e-5, atol=0)
        resumed_evals = read_metrics(build / "resumed.jsonl", kind="eval")
        assert [r["step"] for r in resumed_evals] == [20]
        torch.testing.assert_close(resumed_evals[0]["loss"], evals[1]["loss"], rtol=1e-5, atol=0)
        again = torch.load(build / "resumed.pt", weights_only=True)
        for key in final:
            torch.testing.assert_close(again[key], final[key], rtol=1e-5, atol=1e-6)
