"""The CP-SAT split search against brute force on every instance small enough to enumerate."""

import itertools

import numpy as np
import pytest

from planner.costs import CostTables, evaluate_split
from planner.search import SearchOptions, equal_split, solve_split, to_ticks
from tests.search_tables import compositions, random_tables

INSTANCES = [(seed, L, P, m, tight) for seed, (L, P, m, tight) in enumerate(
    (L, P, m, tight) for L in (2, 5, 8) for P in (1, 2, 3, 4) if P <= L for m in (1, 4) for tight in (False, True)
)]


@pytest.mark.parametrize("seed,num_layers,num_stages,num_microbatches,tight", INSTANCES)
def test_solver_matches_brute_force(seed, num_layers, num_stages, num_microbatches, tight):
    tables = random_tables(np.random.default_rng(seed), num_layers, num_stages, num_microbatches, memory=1.3 if tight else 100)
    options = SearchOptions(global_batch_size=num_microbatches * 2, dtype="fp32", time_limit_s=10, workers=1)
    fitting = [evaluate_split(tables, b) for b in compositions(num_layers, num_stages)]
    fitting = [c for c in fitting if c.fits(tables)]
    result = solve_split(tables, options)
    if not fitting:
        assert result is None
        return
    best = min(c.objective_s for c in fitting)
    assert result is not None and result.status == "optimal"
    assert result.cost.fits(tables)
    # The solver works in ticks of objective/1e6; its optimum may differ by rounding only.
    assert result.cost.objective_s == pytest.approx(best, rel=1e-4)


def test_uneven_stages_get_uneven_splits():
    """A stage on a device twice as fast should take about twice the layers."""
    tables = random_tables(np.random.default_rng(0), 9, 2, 8, memory=100)
    fast, slow = 1e-3, 2e-3
    zero = np.zeros_like(tables.time_s)
    tables = CostTables(**{**tables.__dict__, "time_s": zero + np.array([fast, slow]), "fwd_s": zero, "weight_s": zero,
                           "cut_s": np.zeros_like(tables.cut_s), "epilogue_s": zero})
    result = solve_split(tables, SearchOptions(global_batch_size=16, dtype="fp32"))
    assert result.bounds == [(0, 5), (6, 8)]


def test_equal_split_gives_remainder_to_early_stages():
    assert equal_split(10, 4) == [(0, 2), (3, 5), (6, 7), (8, 9)]
    assert equal_split(3, 3) == [(0, 0), (1, 1), (2, 2)]


def test_ticks_round_to_nearest():
    assert to_ticks(2.5e-3, 1e-3) == 2 or to_ticks(2.5e-3, 1e-3) == 3
    assert to_ticks(1.0, 1e-6) == 1_000_000


@pytest.mark.parametrize("cluster_spec,dtype,schedule", [("1x4xcpu", "fp32", None), ("1x2xA100-80GB+1x2xV100-32GB", "fp16", None),
                                                          ("1x4xcpu", "fp32", "gpipe"), ("1x4xcpu", "fp32", "interleaved")])
def test_pruned_search_finds_the_best_candidate(cluster_spec, dtype, schedule):
    """The bound-pruned search returns the best plan over every candidate solved exhaustively."""
    from cost_models.cluster import parse_cluster
    from planner.search import enumerate_candidates, lower_bound_s, search, solve_candidate
    from planner.trace import trace_model
    from runtime.model_file import load_model_file

    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 4, "hidden": 64, "seq_len": 16}))
    cluster = parse_cluster(cluster_spec)
    options = SearchOptions(global_batch_size=8, dtype=dtype, workers=1, schedule=schedule)
    plan = search(graph, cluster, options)
    exhaustive = []
    for cand in enumerate_candidates(graph, cluster, options):
        _, split = solve_candidate(graph, cluster, cand, options)
        if split is not None:
            exhaustive.append(split.cost.objective_s)
            assert lower_bound_s(graph, cluster, cand, dtype) <= split.cost.objective_s * (1 + 1e-9)
    assert plan.solver.objective_s == pytest.approx(min(exhaustive), rel=1e-6)


def typed_instance(seed, num_layers, num_stages):
    rng = np.random.default_rng(seed)
    fast = random_tables(rng, num_layers, num_stages, 4, memory=1.3 if seed % 2 == 0 else 100)
    slow = random_tables(rng, num_layers, num_stages, 4, memory=100)
    slow = CostTables(**{**slow.__dict__, "time_s": 2.5 * slow.time_s, "capacity_bytes": slow.capacity_bytes * 0.8})
    return {"A100-80GB": fast, "V100-32GB": slow}


@pytest.mark.parametrize("seed,num_layers,num_stages,counts", [
    (s, L, P, c) for s, (L, P, c) in enumerate([(4, 2, (1, 1)), (6, 3, (2, 1)), (6, 3, (1, 2)), (7, 4, (2, 2)), (8, 3, (3, 0))])
])
def test_type_orders_match_brute_force(seed, num_layers, num_stages, counts):
    """Device-type order and the split, chosen together, against enumerating both."""
    from planner.costs import compose_tables
    from planner.search import solve_type_orders, type_sequence

    tables = typed_instance(seed, num_layers, num_stages)
    stages_per_type = {k: n for k, n in zip(tables, counts) if n}
    tables = {k: tables[k] for k in stages_per_type}
    best = None
    for order in itertools.permutations(tables):
        composed = compose_tables(tables, type_sequence(list(order), stages_per_type))
        for bounds in compositions(num_layers, num_stages):
            cost = evaluate_split(composed, bounds)
            if cost.fits(composed) and (best is None or cost.objective_s < best):
                best = cost.objective_s
    result = solve_type_orders(tables, stages_per_type, SearchOptions(global_batch_size=8, dtype="fp32", workers=1))
    if best is None:
        assert result is None
        return
    assert result is not None and result.status == "optimal"
    assert result.cost.objective_s == pytest.approx(best, rel=1e-4)
    assert sorted(result.types) == sorted(k for k, n in stages_per_type.items() for _ in range(n))


def test_mixed_cluster_stages_choose_their_device_types():
    """On A100 + V100 the slow type gets fewer layers, and the plan's ranks are the devices of its type."""
    from cost_models.cluster import parse_cluster
    from planner.search import search
    from planner.trace import trace_model
    from runtime.model_file import load_model_file

    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 8, "hidden": 1024, "heads": 16, "seq_len": 512, "vocab": 1024}))
    cluster = parse_cluster("1x4xV100-32GB+1x4xA100-80GB")
    plan = search(graph, cluster, SearchOptions(global_batch_size=32, dtype="fp16", pp=2, tp=4, workers=1))
    types = cluster.device_types()
    by_type = {s.device_type: s for s in plan.stages}
    assert set(by_type) == {"A100-80GB", "V100-32GB"}
    for stage in plan.stages:
        assert {types[r] for rep in stage.ranks for r in rep} == {stage.device_type}
    assert len(by_type["A100-80GB"].layers) > len(by_type["V100-32GB"].layers)


def _gpt_graph():
    from planner.trace import trace_model
    from runtime.model_file import load_model_file

    return trace_model(load_model_file("examples/gpt.py", {"n_layers": 6, "hidden": 256, "heads": 4, "seq_len": 64}))


def test_pinned_stage_layers_and_devices_are_honoured():
    from cost_models.cluster import parse_cluster
    from planner.search import search

    graph = _gpt_graph()  # 8 layers
    cluster = parse_cluster("1x4xV100-32GB+1x4xA100-80GB")
    options = SearchOptions(global_batch_size=16, dtype="fp16", tp=4, stage_layers=(6, 2), stage_devices=("V100-32GB", "A100-80GB"))
    plan = search(graph, cluster, options)
    assert [len(s.layers) for s in plan.stages] == [6, 2]
    assert [s.device_type for s in plan.stages] == ["V100-32GB", "A100-80GB"]
    types = cluster.device_types()
    assert all(types[r] == s.device_type for s in plan.stages for rep in s.ranks for r in rep)


@pytest.mark.parametrize("pins,message", [
    (dict(stage_layers=(3, 3)), "sums to 6; the model has 8 layers"),
    (dict(stage_layers=(4, 4), pp=4), "gives 2 stages but --pp is 4"),
    (dict(stage_devices=("H100-80GB", "A100-80GB")), "H100-80GB not in the cluster"),
    (dict(stage_devices=("A100-80GB", "A100-80GB")), "puts 2 of 2 stages on A100-80GB: 8 devices"),
])
def test_bad_stage_pins_are_explained(pins, message):
    from cost_models.cluster import parse_cluster
    from planner.search import PlanningError, search

    with pytest.raises(PlanningError, match=message):
        search(_gpt_graph(), parse_cluster("1x4xV100-32GB+1x4xA100-80GB"), SearchOptions(global_batch_size=16, dtype="fp16", **pins))
