"""Ways for data-parallel replicas to agree (issue: slow links, bad workers, uneven
machines): compression with error feedback, robust aggregation, local SGD and
straggler-aware shares. The arithmetic is checked in-process on hand-worked cases; the
programs run for real under torchrun on CPU with gloo and are compared with plain data
parallelism, with the single-process reference, or with a single-process simulation of
the same algorithm."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import build_plan, run_torchrun
from hetpar.rewriters.torchrun import compile_plan
from hetpar.runtime.compression import pack_bits, sign_compress, sign_decompress, topk_compress, topk_decompress, unpack_bits
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.rebalance import split_by_speed
from hetpar.runtime.robust import coordinate_rule, krum_choice, squared_distances
from hetpar.runtime.shard import replica_rows
from hetpar.runtime.training import read_metrics
from test_distributed import LR, MLP_ARGS, adam_sensitivity, assert_within_rounding, reference_run, _to, _to_state


# ----------------------------------------------------------------------------- the arithmetic, by hand


def test_topk_error_feedback_carries_the_dropped_mass():
    """F = 1/2 of [3, -1, 0.5, -4]: -4 and 3 are sent, -1 and 0.5 stay behind; the next
    step's gradient [0, 0, 0.6, 0] adds to them, so -1 and 1.1 go out then."""
    g1 = torch.tensor([3.0, -1.0, 0.5, -4.0])
    indices, values, residual = topk_compress(g1, None, k=2)
    assert sorted(indices.tolist()) == [0, 3]
    assert dict(zip(indices.tolist(), values.tolist())) == {0: 3.0, 3: -4.0}
    assert residual.tolist() == [0.0, -1.0, 0.5, 0.0]
    sent = torch.zeros(4).index_add_(0, indices.long(), values)
    assert torch.equal(sent + residual, g1)  # nothing lost: sent plus kept is the gradient
    indices, values, residual = topk_compress(torch.tensor([0.0, 0.0, 0.6, 0.0]), residual, k=2)
    assert dict(zip(indices.tolist(), values.tolist())) == {1: -1.0, 2: pytest.approx(1.1)}
    assert residual.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_topk_of_everything_is_the_plain_mean():
    a, b = torch.tensor([1.5, -2.0, 0.25]), torch.tensor([0.5, 4.0, -0.25])
    payloads = [topk_compress(g, None, k=3) for g in (a, b)]
    assert all(r.abs().sum() == 0 for *_, r in payloads)
    dense = topk_decompress(torch.stack([p[0] for p in payloads]), torch.stack([p[1] for p in payloads]), 3)
    assert torch.equal(dense, (a + b) / 2)


def test_scaled_sign_by_hand():
    """[1, -3, 2, 0]: mean magnitude 1.5; 0 counts as non-negative; the residual keeps the rest."""
    g = torch.tensor([1.0, -3.0, 2.0, 0.0])
    bits, scale, residual = sign_compress(g, None)
    assert scale.tolist() == [1.5]
    assert bits.tolist() == [0b1101]  # elements 0, 2, 3 non-negative
    assert residual.tolist() == [-0.5, -1.5, 0.5, -1.5]
    decoded = sign_decompress(bits.unsqueeze(0), scale.unsqueeze(0), 4)
    assert torch.equal(decoded + residual, g)
    other = sign_decompress(torch.stack([bits, bits ^ 0xFF]), torch.tensor([[1.5], [0.5]]), 4)
    assert other.tolist() == [0.5, -0.5, 0.5, 0.5]  # (1.5 - 0.5) / 2 where replica 1's bits flip


def test_bits_pack_and_unpack():
    bits = torch.rand(21, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 3
    assert torch.equal(unpack_bits(packed, 21), bits)


def test_coordinate_rules_by_hand():
    stacked = torch.tensor([[1.0, 10.0], [2.0, -7.0], [3.0, 1.0], [100.0, 2.0]])
    assert torch.equal(coordinate_rule(stacked, "trimmed-mean", 0), stacked.sum(0) / 4)
    assert coordinate_rule(stacked, "trimmed-mean", 1).tolist() == [2.5, 1.5]  # the two middle values of each column
    assert coordinate_rule(stacked, "median").tolist() == [2.5, 1.5]
    assert coordinate_rule(stacked[:3], "median").tolist() == [2.0, 1.0]


def test_krum_averages_the_honest():
    honest = torch.tensor([[1.0, 1.0], [1.1, 0.9], [0.9, 1.2], [1.0, 0.8]])
    stacked = torch.cat([honest, torch.tensor([[50.0, -40.0]])])
    distances = squared_distances(stacked)
    assert distances[0, 4] == (49.0**2 + 41.0**2) and distances[0, 0] == 0
    # scores: the sum of each replica's 5 - 1 - 2 = 2 nearest: 0.06, 0.04, 0.18, 0.06 for the
    # honest ones, thousands for replica 4; the 5 - 1 = 4 lowest are averaged
    assert krum_choice(distances, bad=1) == [0, 1, 2, 3]
    # tolerating 2: scores are the nearest distance, 0.02 for 0, 1 and 3, 0.05 for 2; the 3 lowest
    assert krum_choice(distances, bad=2) == [0, 1, 3]


def test_split_by_speed():
    assert split_by_speed(8, [1.0, 1.0]) == [4, 4]
    assert split_by_speed(8, [1.0, 3.0]) == [6, 2]  # three times slower: a third of the samples
    assert split_by_speed(4, [1.0, 1000.0]) == [3, 1]  # never fewer than one
    assert split_by_speed(7, [1.0, 1.0, 1.0]) == [3, 2, 2]  # the leftover to the lowest replica among equals
    assert sum(split_by_speed(12, [0.3, 0.7, 0.1, 0.2])) == 12


# ----------------------------------------------------------------------------- the programs


def run_program(plan, tmp_path, optimizer: str, steps: int, *extra: str, init_state=None):
    """Compile and run ``plan`` from ``init_state`` (a fresh build_model under seed 1234 when None);
    returns (losses, final state, stderr, init state)."""
    out = tmp_path / "build"
    compile_plan(plan, out)
    if init_state is None:
        torch.manual_seed(1234)
        init_state = load_model_file(plan.model.file, plan.model.args).build_model().state_dict()
    torch.save(init_state, out / "init.pt")
    args = ["--steps", str(steps), "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--init-from", "init.pt",
            "--save-final", "final.pt", "--metrics", "m.jsonl", *extra]
    result = run_torchrun(out / "train.py", plan.cluster.world_size, args)
    assert result.returncode == 0, result.stderr[-4000:]
    losses = [r["loss"] for r in read_metrics(out / "m.jsonl")]
    return losses, torch.load(out / "final.pt", weights_only=True), result.stderr, init_state


def dp_plan(mlp_path, dp: int, **fields):
    plan = build_plan(mlp_path, MLP_ARGS, splits=[[0, 1, 2, 3]], data_parallel=dp, num_microbatches=2)
    return dataclasses.replace(plan, **fields)


@pytest.mark.slow
def test_topk_of_everything_trains_exactly_like_plain_all_reduce(tmp_path, mlp_path):
    """F = 1: every element sent, in order, nothing kept back: the same sums as the all-reduce of two replicas."""
    plain, plain_final, _, init = run_program(dp_plan(mlp_path, 2), tmp_path / "plain", "sgd", 3)
    losses, final, stderr, _ = run_program(dp_plan(mlp_path, 2, grad_compression="topk:1"), tmp_path / "topk", "sgd", 3,
                                           init_state=init)
    assert "top-1 compression with error feedback, all-gathered over 2 replicas" in stderr
    assert losses == plain
    assert all(torch.equal(final[k], v) for k, v in plain_final.items())


@pytest.mark.slow
def test_bf16_compression_trains_within_bf16_rounding(tmp_path, mlp_path):
    """Each averaged gradient rounded to bf16's 8 significant bits: relative error at most 2**-8
    per element and step, so the parameters stay within that share of the updates made."""
    plan = dp_plan(mlp_path, 2, grad_compression="bf16")
    losses, final, stderr, init = run_program(plan, tmp_path, "sgd", 3)
    assert "through bf16_compress_hook" in stderr
    ref_losses, ref_state = reference_run(plan, init, "sgd")
    moved = max(float((ref_state[k] - init[k]).abs().max()) for k in init)  # the largest total update
    for key, ref in ref_state.items():
        assert float((final[key] - ref).abs().max()) <= 3 * 2**-8 * moved + 1e-6, key
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2**-6, atol=0)


def replica_gradients(plan, init_state: dict) -> list[torch.Tensor]:
    """Each replica's flat gradient (parameter order) of its rows of the first batch, in one process."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    inputs, targets = next(model_file.batches(plan.global_batch_size, 0))
    grads = []
    for r in range(plan.data_parallel):
        model = model_file.build_model()
        model.load_state_dict(init_state)
        rows = replica_rows(plan.replica_micro_batch_sizes, plan.num_microbatches, r)
        model_file.loss(model(*(x[rows.start:rows.stop] for x in inputs)), targets[rows.start:rows.stop]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return grads


@pytest.mark.slow
def test_sign_compression_sends_one_bit_and_a_scale(tmp_path, mlp_path):
    """One SGD step under sign compression (the model's gradients fit one bucket): replica r
    sends sign(g_r) and s_r = mean |g_r|, so every element moves by lr * (+-s_0 +- s_1) / 2,
    that is by lr * (s_0 + s_1) / 2 or lr * |s_0 - s_1| / 2, whichever signs it has."""
    plan = dp_plan(mlp_path, 2, grad_compression="sign")
    _, final, stderr, init = run_program(plan, tmp_path, "sgd", 1)
    assert "scaled sign compression with error feedback, all-gathered over 2 replicas" in stderr
    s0, s1 = (float(g.abs().mean()) for g in replica_gradients(plan, init))
    lr = LR["sgd"]
    moved = torch.cat([(final[k] - v).reshape(-1) for k, v in init.items()]).abs().double()
    agree, differ = lr * (s0 + s1) / 2, lr * abs(s0 - s1) / 2
    rounding = 4 * torch.finfo(torch.float32).eps * max(float(v.abs().max()) for v in init.values())
    nearest = torch.minimum((moved - agree).abs(), (moved - differ).abs())
    assert float(nearest.max()) <= rounding + 1e-4 * agree, (agree, differ, float(nearest.max()))
    assert float((moved - agree).abs().min()) <= rounding  # some elements' replicas agree in sign


def local_sgd_simulation(plan, init_state: dict, optimizer: str, steps: int, every: int, dtype: torch.dtype,
                         grads: list | None = None):
    """[Note: local SGD] in one process: each replica a whole model trained on its rows of
    each batch; parameters and optimizer state averaged after every ``every``-th step and the
    last. Returns (the mean of the replicas' losses per step, replica 0's final state).
    ``grads``: one list per replica gets each step's gradients, by state_dict key."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    dp, m = plan.data_parallel, plan.num_microbatches
    models = [model_file.build_model().to(dtype) for _ in range(dp)]
    for model in models:
        model.load_state_dict(_to_state(init_state, dtype))
    opts = [torch.optim.SGD(mm.parameters(), lr=LR[optimizer]) if optimizer == "sgd"
            else torch.optim.AdamW(mm.parameters(), lr=LR[optimizer]) for mm in models]
    data = model_file.batches(plan.global_batch_size, 0)
    losses = []
    for step in range(1, steps + 1):
        inputs, targets = _to(next(data), dtype)
        step_losses = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            rows = replica_rows(plan.replica_micro_batch_sizes, m, r)
            loss = model_file.loss(model(*(x[rows.start:rows.stop] for x in inputs)), targets[rows.start:rows.stop])
            opt.zero_grad()
            loss.backward()
            if grads is not None:
                if len(grads) <= r:
                    grads.append([])
                grads[r].append({k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})
            opt.step()
            step_losses.append(loss.item())
        losses.append(sum(step_losses) / dp)
        if step % every == 0 or step == steps:
            with torch.no_grad():
                for tensors in zip(*(list(mm.parameters()) for mm in models)):
                    mean = sum(tensors) / dp
                    for t in tensors:
                        t.copy_(mean)
                for states in zip(*([o.state[p] for p in o.param_groups[0]["params"]] for o in opts)):
                    for key in states[0]:
                        if key != "step":
                            mean = sum(s[key] for s in states) / dp
                            for s in states:
                                s[key].copy_(mean)
    return losses, models[0].state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_local_sgd_equals_its_single_process_simulation(tmp_path, mlp_path, optimizer):
    """K = 4 over 6 steps: syncs after steps 4 and 6 (the last); the replicas train apart in between."""
    plan = dp_plan(mlp_path, 2, sync_every=4)
    losses, final, stderr, init = run_program(plan, tmp_path, optimizer, 6)
    assert "local SGD: parameters and optimizer state averaged over 2 replicas every 4 steps" in stderr
    ref_grads, exact_grads = [], []
    ref_losses, ref_state = local_sgd_simulation(plan, init, optimizer, 6, 4, torch.float32, ref_grads)
    exact_losses, exact_state = local_sgd_simulation(plan, init, optimizer, 6, 4, torch.float64, exact_grads)
    # a replica starts each period from the mean of all: its rounding carries every replica's, so their sum bounds it
    per_replica = [adam_sensitivity(r, e) for r, e in zip(ref_grads, exact_grads)]
    sensitivity = {k: sum(s[k] for s in per_replica) for k in per_replica[0]}
    assert_within_rounding(optimizer, 6, losses, final, ref_state, exact_losses, exact_state, sensitivity)
    plain_losses, plain_state = reference_run(plan, init, optimizer, steps=6)
    assert max(float((plain_state[k] - v).abs().max()) for k, v in ref_state.items()) > 1e-4  # another algorithm


@pytest.mark.slow
def test_local_sgd_inside_nodes_every_step_across_every_k(tmp_path, mlp_path):
    """Four replicas on two nodes of two: replicas 0-1 and 2-3 all-reduce gradients every step,
    so the run is two-replica local SGD over pairs that each see twice the rows."""
    plan = dp_plan(mlp_path, 4, sync_every=3, sync_scope="node")
    plan = dataclasses.replace(plan, cluster=dataclasses.replace(plan.cluster, spec="2x2xcpu"))
    losses, final, stderr, init = run_program(plan, tmp_path, "sgd", 5)
    assert "every 3 steps, all-reduce over 2 replicas inside the node every step" in stderr
    pairs = dataclasses.replace(plan, data_parallel=2, micro_batch_size=4,
                                stages=[dataclasses.replace(plan.stages[0], ranks=[[0], [1]])],
                                cluster=dataclasses.replace(plan.cluster, spec="1x2xcpu", world_size=2, device_types=["cpu"] * 2),
                                sync_scope="all")
    ref_losses, ref_state = local_sgd_simulation(pairs, init, "sgd", 5, 3, torch.float32)
    exact_losses, exact_state = local_sgd_simulation(pairs, init, "sgd", 5, 3, torch.float64)
    assert_within_rounding("sgd", 5, losses, final, ref_state, exact_losses, exact_state)


@pytest.mark.slow
def test_robust_aggregation_against_one_bad_replica(tmp_path, mlp_path, monkeypatch):
    """Replica 3 of 4 sends noise of std 100 (runtime.faults, asked for through
    HETPAR_TEST_FAULTS: [Note: test faults]): the mean follows it away, the
    trimmed mean and Krum stay within a few percent of the clean run's loss; with no bad
    replica the trimmed mean with B = 0 is the mean, so it trains like one process."""
    clean = dp_plan(mlp_path, 4, aggregation="trimmed-mean:0")
    losses, final, _, init = run_program(clean, tmp_path / "clean", "sgd", 6)
    ref_losses, ref_state = reference_run(clean, init, "sgd", steps=6)
    exact_losses, exact_state = reference_run(clean, _to_state(init, torch.float64), "sgd", steps=6, dtype=torch.float64)
    assert_within_rounding("sgd", 6, losses, final, ref_state, exact_losses, exact_state)
    after_updates = {}  # each run's mean loss over the steps after its first update, on the same batches
    monkeypatch.setenv("HETPAR_TEST_FAULTS", "bad-gradients=3")
    for rule in ("mean", "trimmed-mean:1", "krum:1"):
        losses, _, stderr, _ = run_program(dp_plan(mlp_path, 4, aggregation=rule), tmp_path / rule, "sgd", 6,
                                           init_state=init)
        after_updates[rule] = sum(losses[1:]) / 5
    clean_after = sum(ref_losses[1:]) / 5
    assert not after_updates["mean"] <= 10 * clean_after, after_updates  # far off, or not a number
    for rule in ("trimmed-mean:1", "krum:1"):
        assert abs(after_updates[rule] - clean_after) <= 0.05 * clean_after, (rule, after_updates, clean_after)


@pytest.mark.slow
def test_a_slowed_replica_gets_fewer_samples_and_training_stays_exact(tmp_path, mlp_path, monkeypatch):
    """Rank 1 sleeps 5 ms per sample in each forward: after the first rebalance (every 2
    steps) it holds fewer of the 8 samples per micro-batch; the batch and its weighting are
    unchanged, so SGD equals one process."""
    plan = dp_plan(mlp_path, 2, rebalance_every=2)
    plan = dataclasses.replace(plan, micro_batch_size=4, global_batch_size=16)
    monkeypatch.setenv("HETPAR_TEST_FAULTS", "slowdown=1:0.005")  # [Note: test faults]
    losses, final, stderr, init = run_program(plan, tmp_path, "sgd", 6)
    moves = [line for line in stderr.splitlines() if "replica micro-batch sizes" in line]
    assert moves and moves[0].startswith("hetpar: step 2: replica micro-batch sizes [4, 4] -> ")
    after = json.loads(moves[-1].split(" -> ")[1].split(" (")[0])
    assert after[1] < after[0] and sum(after) == 8
    ref_losses, ref_state = reference_run(plan, init, "sgd", steps=6)
    exact_losses, exact_state = reference_run(plan, _to_state(init, torch.float64), "sgd", steps=6, dtype=torch.float64)
    assert_within_rounding("sgd", 6, losses, final, ref_state, exact_losses, exact_state)
