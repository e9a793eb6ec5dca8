"""Heterogeneous data parallelism: replicas on one device type each, shares balanced by speed."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from conftest import ROOT
from hetpar.cost_models.cluster import Cluster, parse_cluster
from hetpar.cost_models.collectives import grad_sync_scale
from hetpar.cost_models.devices import get_device
from hetpar.planner.api import fastest_plan, plan_graph
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanningError
from hetpar.planner.estimate import EstimateConfig, estimate
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import search
from hetpar.planner.strategies import balance_shares, hetero_dp_plan, replica_classes, replica_sizes
from hetpar.runtime.model_file import load_model_file

GPT_ARGS = {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 512}
MIXED = "1x2xA100-80GB+1x2xV100-32GB"


@pytest.fixture(scope="module")
def gpt():
    return trace_model(load_model_file(ROOT / "examples" / "gpt.py", GPT_ARGS))


def options(batch: int, **pins) -> SearchOptions:
    return SearchOptions(global_batch_size=batch, dtype="fp16", workers=1, time_limit_s=5, **pins)


def brute_force_shares(time_s, classes, total):
    best = None
    for shares in itertools.product(range(1, total + 1), repeat=len(classes)):
        if sum(shares) == total:
            slowest = max(time_s(k, b) for k, b in zip(classes, shares))
            best = slowest if best is None else min(best, slowest)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_balanced_shares_match_brute_force(seed):
    """Random non-decreasing replica times, some with a memory limit past which they do not fit."""
    rng = random.Random(seed)
    kinds = rng.randint(1, 3)
    per_sample = [rng.uniform(0.5, 3.0) for _ in range(kinds)]
    fixed = [rng.uniform(0.0, 2.0) for _ in range(kinds)]
    limit = [rng.choice([math.inf, rng.randint(2, 5)]) for _ in range(kinds)]

    def time_s(k, b):
        return math.inf if b > limit[k] else fixed[k] + per_sample[k] * b

    classes = [rng.randrange(kinds) for _ in range(rng.randint(2, 4))]
    total = rng.randint(len(classes), 9)
    shares = balance_shares(time_s, classes, total)
    best = brute_force_shares(time_s, classes, total)
    if best is None or math.isinf(best):
        assert shares is None
        return
    assert sum(shares) == total and min(shares) >= 1
    assert max(time_s(k, b) for k, b in zip(classes, shares)) == pytest.approx(best)
    # a limit at the optimum keeps it; any lower limit leaves no shares
    within = balance_shares(time_s, classes, total, below_s=best)
    assert within is not None and max(time_s(k, b) for k, b in zip(classes, within)) == pytest.approx(best)
    assert balance_shares(time_s, classes, total, below_s=best * (1 - 1e-9)) is None


@pytest.mark.parametrize("seed", range(8))
def test_balanced_shares_of_large_batches_match_a_scan_of_every_time(seed):
    """Totals of hundreds, times with plateaus and curvature: the least slowest time equals the least
    of every replica time at which each class's largest fitting size (found by scanning) covers the total."""
    rng = random.Random(100 + seed)
    kinds = rng.randint(2, 3)
    coef = [(rng.uniform(0.0, 2.0), rng.uniform(0.2, 3.0), rng.uniform(0.0, 0.01), rng.choice([1, 2, 4])) for _ in range(kinds)]
    limit = [rng.choice([math.inf, rng.randint(30, 120)]) for _ in range(kinds)]

    def time_s(k, b):
        fixed, per, curve, step = coef[k]
        steps = -(-b // step) * step  # plateaus: sizes run in steps of ``step``
        return math.inf if b > limit[k] else fixed + per * steps + curve * steps * steps

    classes = [rng.randrange(kinds) for _ in range(rng.randint(2, 6))]
    total = rng.randint(len(classes), 400)
    most = total - len(classes) + 1

    def covers(t):
        caps = [max([b for b in range(1, most + 1) if time_s(k, b) <= t], default=0) for k in classes]
        return min(caps) > 0 and sum(caps) >= total

    times = sorted({time_s(k, b) for k in set(classes) for b in range(1, most + 1)} - {math.inf})
    best = next((t for t in times if covers(t)), None)
    shares = balance_shares(time_s, classes, total)
    if best is None:
        assert shares is None
        return
    assert sum(shares) == total and min(shares) >= 1
    assert max(time_s(k, b) for k, b in zip(classes, shares)) == best


def test_shares_are_proportional_to_speed():
    """Times proportional to the samples: each replica's share is within one sample of total * its speed / all speeds."""
    speeds = {0: 3.0, 1: 1.0, 2: 2.0}
    classes = [0, 0, 1, 2]
    total = 96
    shares = balance_shares(lambda k, b: b / speeds[k], classes, total)
    all_speed = sum(speeds[k] for k in classes)
    for k, share in zip(classes, shares):
        assert abs(share - total * speeds[k] / all_speed) <= 1


def test_replica_sizes_tile_every_group_and_divide_the_batch():
    cluster = parse_cluster("2x4xA100-80GB+1x2xV100-32GB")
    assert replica_sizes(cluster, options(40)) == [1, 2]  # 10 or 5 replicas; 4 would leave the V100 node half used
    assert replica_sizes(cluster, options(40, dp=5)) == [2]
    classes = replica_classes(cluster, 2)
    assert [(c.device_type, c.first_rank, c.count, c.replica_cluster.spec) for c in classes] == [
        ("A100-80GB", 0, 4, "1x2xA100-80GB"), ("V100-32GB", 8, 1, "1x2xV100-32GB")]


def test_hetero_plan_gives_faster_replicas_more_samples_in_proportion(gpt):
    """On A100 and V100 replicas of one device each, the shares follow each replica's speed, as
    planner.estimate predicts it for a replica alone."""
    batch = 64
    plan = hetero_dp_plan(gpt, parse_cluster(MIXED), options(batch, pp=1))
    assert plan.replica_batch_shares is not None and plan.data_parallel == 4
    assert sum(plan.replica_batch_shares) * plan.num_microbatches == batch
    types = [plan.cluster.device_types[s[0]] for s in plan.stages[0].ranks]
    per_type = {t: {b for b, u in zip(plan.replica_batch_shares, types) if u == t} for t in types}
    fast, slow = max(per_type["A100-80GB"]), min(per_type["V100-32GB"])
    assert fast > slow

    def replica_speed(device):
        one = Cluster(spec=f"1x1x{device}", groups=(parse_cluster(f"1x1x{device}").groups[0],))
        b = max(per_type[device])
        run = estimate(gpt, one, EstimateConfig(global_batch_size=b * plan.num_microbatches, dp=1, tp=1, pp=1, micro_batch_size=b,
                                                dtype="fp16", recompute=plan.stages[0].recompute))
        return b * plan.num_microbatches / (run.predicted.step_time_s - run.time.optimizer_s)

    speed = {t: replica_speed(t) for t in per_type}
    total = sum(plan.replica_batch_shares)
    for share, t in zip(plan.replica_batch_shares, types):
        assert abs(share - total * speed[t] / sum(speed[u] for u in types)) <= 1.5


def test_hetero_plan_prediction_is_the_slowest_replica_plus_the_all_reduce(gpt):
    plan = hetero_dp_plan(gpt, parse_cluster(MIXED), options(64))
    p = plan.predicted
    assert p.dp_comm_time_s > 0
    assert p.step_time_s == pytest.approx(p.compute_time_s + p.bubble_time_s + p.pp_comm_time_s + p.tp_comm_time_s + p.dp_comm_time_s)
    assert p.throughput_samples_per_s == pytest.approx(64 / p.step_time_s)


def test_the_all_reduce_costs_what_the_slowest_type_pays_inside_a_step(gpt):
    """A measured profile's grad_sync_scale (what the gradient all-reduce costs inside a
    training step over its alpha-beta time) applies to the replicas' sync as it does in
    planner/estimate.py; the slowest type taking part sets it."""
    plain = parse_cluster(MIXED)
    v100 = plain.groups[1]
    slow_sync = dataclasses.replace(v100.device, grad_sync_scale=3.0, sources={**v100.device.sources, "grad_sync_scale": "this test"})
    scaled = dataclasses.replace(plain, groups=(plain.groups[0], dataclasses.replace(v100, device=slow_sync)))
    base = hetero_dp_plan(gpt, plain, options(64, pp=1, tp=1))
    slowed = hetero_dp_plan(gpt, scaled, options(64, pp=1, tp=1))
    assert [s.ranks for s in slowed.stages] == [s.ranks for s in base.stages]
    assert slowed.predicted.dp_comm_time_s == pytest.approx(3 * base.predicted.dp_comm_time_s)


@pytest.mark.parametrize("spec,batch", [(MIXED, 64), ("1x2xA100-80GB+1x2xT4-16GB", 32), ("1x4xA100-80GB+1x4xV100-32GB", 128)])
def test_the_pruned_plan_is_the_best_of_every_layout_and_micro_batch_count(gpt, spec, batch):
    """hetero_dp_plan skips a layout's micro-batch count m when a bound says it cannot beat
    the best so far, and balances on estimates without the transfer breakdown: every m of
    every layout balanced with full estimates finds no faster plan."""
    from hetpar.planner.strategies import hetero_dp as h
    from hetpar.planner.solver import divisors

    cluster, opts = parse_cluster(spec), options(batch)
    plan = hetero_dp_plan(gpt, cluster, opts)

    def every_m(layout):
        """(step, m, shares) of ``layout`` at its best m, every m balanced with full estimates."""
        classes = replica_classes(cluster, layout.sizes())
        replica_class = [k for k, c in enumerate(classes) for _ in range(c.count)]
        runs, out = {}, (math.inf, None, None)
        for m in divisors(batch):
            if batch // m < len(replica_class):
                continue

            def time_s(k, b, m=m):
                run = h._replica_run(gpt, classes[k], layout, opts, b, m, runs)
                return math.inf if run is None else run.predicted.step_time_s - run.time.optimizer_s

            shares = balance_shares(time_s, replica_class, batch // m)
            if shares is None or any(math.isinf(time_s(k, b)) for k, b in zip(replica_class, shares)):
                continue
            chosen = {(k, b): h._replica_run(gpt, classes[k], layout, opts, b, m, runs) for k, b in zip(replica_class, shares)}
            step = h._predicted(gpt, cluster, classes, layout, opts, replica_class, shares, chosen).step_time_s
            out = min(out, (step, m, shares), key=lambda o: o[0])
        return out

    uniform = [layout for size in replica_sizes(cluster, opts)
               for layout in h._layouts(gpt, cluster, replica_classes(cluster, size), opts)]
    step, m, shares = min((every_m(layout) for layout in uniform), key=lambda o: o[0])
    # the layouts of mixed degrees tried from the best uniform plan's m and mean share ([Note: heterogeneous data
    # parallelism], step 5), balanced the same way
    mixed = h._mixed_layouts(gpt, cluster, [(layout, m, max(1, round(sum(shares) / len(shares)))) for layout in uniform], opts)
    best = min([step] + [every_m(layout)[0] for layout in mixed])
    assert plan.predicted.step_time_s == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("spec,batch", [(MIXED, 64), (MIXED, 512), ("1x2xA100-80GB+1x2xT4-16GB", 32), ("1x4xA100-80GB+1x4xV100-32GB", 128)])
def test_auto_is_never_slower_than_either_kind_and_records_the_other(gpt, spec, batch):
    cluster = parse_cluster(spec)
    searched = search(gpt, cluster, options(batch))
    hetero = hetero_dp_plan(gpt, cluster, options(batch))
    chosen = fastest_plan(gpt, cluster, options(batch))
    assert chosen.predicted.step_time_s <= min(searched.predicted.step_time_s, hetero.predicted.step_time_s)
    other = chosen.alternatives[0]
    assert other["kind"] == ("pipeline" if chosen.replica_batch_shares is not None else "hetero_dp")
    assert other["step_time_s"] == pytest.approx(max(searched.predicted.step_time_s, hetero.predicted.step_time_s))
    assert plan_graph(gpt, cluster, options(batch), hetero_dp="off").replica_batch_shares is None


def _plan_summary(graph, spec: str, batch: int):
    plan = fastest_plan(graph, parse_cluster(spec), options(batch))
    return plan.predicted.step_time_s, plan.replica_batch_shares, [s.ranks for s in plan.stages], plan.alternatives[0]["kind"]


def test_a_pool_worker_plans_as_the_caller_does(gpt):
    """A multiprocessing.Pool worker is daemonic and may not start the process the heterogeneous data-parallel
    plan runs in beside the search ([Note: both cores] in planner/api.py): there the two run one after the other,
    to the same plan."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        in_worker = pool.apply(_plan_summary, (gpt, MIXED, 64))
    assert in_worker == _plan_summary(gpt, MIXED, 64)


def test_hetero_dp_on_a_single_type_cluster_is_one_clear_error(gpt):
    with pytest.raises(PlanningError, match="needs at least two device types"):
        plan_graph(gpt, parse_cluster("1x4xA100-80GB"), options(64), hetero_dp="on")
    with pytest.raises(PlanningError, match="no replica size tiles every node group .* and dp = 2"):
        hetero_dp_plan(gpt, parse_cluster("1x2xA100-80GB+1x1xV100-32GB"), options(64, dp=2, tp=1))


def test_groups_run_their_replicas_at_different_degrees_where_that_is_faster(gpt):
    """[Note: heterogeneous data parallelism], step 5: one A100 at tp 1 beside two V100s at tp 2 (dp 2), faster
    here than every replica at one degree and than the pipelines across types; its prediction is the slowest
    replica plus the whole-gradient sync of [Note: replicas of different degrees], and hetpar explain estimates
    the plan to the same step. Compiled stages, as the CLI plans NVIDIA GPUs (eager, this small a model is bound
    by its kernels' bytes, [Note: bytes bound], and three replicas at tp 1 win)."""
    from hetpar.cost_models.collectives import all_gather_time_s, all_reduce_time_s, broadcast_time_s
    from hetpar.cost_models.compute import dtype_bytes
    from hetpar.planner.api import compiled_graph
    from hetpar.planner.explain import estimate_config
    from hetpar.planner.strategies import estimate_shares

    cluster = parse_cluster("1x1xA100-80GB+1x2xV100-32GB")
    gpt = compiled_graph(gpt)
    plan = hetero_dp_plan(gpt, cluster, options(64, compiled=True))
    (stage,) = plan.stages
    assert stage.ranks == [[0], [1, 2]] and stage.mixed_degrees
    assert plan.predicted.step_time_s < hetero_dp_plan(gpt, cluster, options(64, tp=1, compiled=True)).predicted.step_time_s
    assert plan_graph(gpt, cluster, options(64, compiled=True)).predicted.step_time_s == plan.predicted.step_time_s
    whole = sum(layer.params_at(1) for layer in gpt.layers) * dtype_bytes("fp16")
    sync = all_reduce_time_s(whole, [0, 1], cluster) + all_gather_time_s(whole, [1, 2], cluster) \
        + broadcast_time_s(whole, [1, 2], cluster)
    assert plan.predicted.dp_comm_time_s == pytest.approx(sync * max(grad_sync_scale(g.device) for g in cluster.groups))
    again = estimate_shares(gpt, cluster, estimate_config(plan, gpt))
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)


def test_a_dp_pin_is_met_by_replicas_of_different_degrees(gpt):
    """Two A100s and one V100 in two replicas: the A100s at tp 2, the V100 alone."""
    plan = hetero_dp_plan(gpt, parse_cluster("1x2xA100-80GB+1x1xV100-32GB"), options(64, dp=2))
    assert all(s.replica_degrees == [2, 1] for s in plan.stages)
    assert plan.data_parallel == 2 and sum(plan.replica_batch_shares) * plan.num_microbatches == 64


def slow_cpu_cluster() -> Cluster:
    """One CPU worker and one three times slower (a profile made for the test: the planner must give it a smaller share)."""
    cpu = get_device("cpu")
    slow = dataclasses.replace(cpu, name="cpu-slow", peak_flops_per_s={k: v / 3 for k, v in cpu.peak_flops_per_s.items()},
                               mem_bw_bytes_per_s=cpu.mem_bw_bytes_per_s / 3,
                               op_overhead_s=3 * (getattr(cpu, "op_overhead_s", None) or 5e-6),
                               sources={**cpu.sources, "op_overhead_s": "made up for this test: three times the cpu's"})
    group = parse_cluster("1x1xcpu").groups[0]
    return Cluster(spec="1x1xcpu+1x1xcpu-slow", groups=(group, dataclasses.replace(group, device=slow)))


@pytest.mark.slow
def test_a_searched_hetero_plan_trains_like_one_process(tmp_path, mlp_path):
    from test_distributed import MLP_ARGS, assert_trains_like_one_process

    graph = trace_model(load_model_file(mlp_path, MLP_ARGS))
    plan = plan_graph(graph, slow_cpu_cluster(), SearchOptions(global_batch_size=8, dtype="fp32", workers=1), hetero_dp="on")
    assert plan.data_parallel == 2 and plan.replica_batch_shares[0] > plan.replica_batch_shares[1]
    assert_trains_like_one_process(plan, tmp_path)
