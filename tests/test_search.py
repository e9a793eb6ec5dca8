"""The CP-SAT split search against brute force on every instance small enough to enumerate."""

import itertools

import numpy as np
import pytest

from hetpar.planner.costing import CostTables, evaluate_split
from hetpar.planner.estimate import equal_split
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import solve_split
from hetpar.planner.solver import to_ticks
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
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.planner.search import enumerate_candidates, lower_bound_s, search, solve_candidate
    from hetpar.runtime.model_file import load_model_file

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
    from hetpar.planner.costing import compose_tables, type_sequence
    from hetpar.planner.search import solve_type_orders

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
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.planner.search import search
    from hetpar.runtime.model_file import load_model_file

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
    from hetpar.planner.capture import trace_model
    from hetpar.runtime.model_file import load_model_file

    return trace_model(load_model_file("examples/gpt.py", {"n_layers": 6, "hidden": 256, "heads": 4, "seq_len": 64}))


def test_pinned_stage_layers_and_devices_are_honoured():
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.search import search

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
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.errors import PlanningError
    from hetpar.planner.search import search

    with pytest.raises(PlanningError, match=message):
        search(_gpt_graph(), parse_cluster("1x4xV100-32GB+1x4xA100-80GB"), SearchOptions(global_batch_size=16, dtype="fp16", **pins))


def _solver_and_brute_force(graph, cluster, options):
    """Per candidate of the search: the solver's objective and brute force's over every type order, split
    and mode (degrees included), and brute force's over plans whose stages share one degree."""
    from hetpar.planner.costing import build_tables, compose_tables, tables_by_type, type_sequence
    from hetpar.planner.search import enumerate_candidates, solve_split, solve_type_orders
    from tests.search_tables import brute_force

    out = []
    for cand in enumerate_candidates(graph, cluster, options):
        counts = dict(cand.stages_per_type)
        if len(counts) > 1:
            typed = tables_by_type(graph, cluster, cand, options.dtype)
            every = [compose_tables(typed, type_sequence(list(order), counts)) for order in itertools.permutations(typed)]
            split = solve_type_orders(typed, counts, options)
        else:
            every = [build_tables(graph, cluster, cand, options.dtype)]
            split = solve_split(every[0], options)
        one_degree = lambda modes, c=cand: len({c.modes[k].tp for k in modes}) == 1  # noqa: E731
        best = [b[0] for t in every if (b := brute_force(t)) is not None]
        uniform = [b[0] for t in every if (b := brute_force(t, one_degree)) is not None]
        out.append((cand, split and split.cost.objective_s, min(best, default=None), min(uniform, default=None)))
    return out


def test_stages_of_different_degrees_beat_every_one_degree_plan():
    """A100 nodes of two devices and a V100 node of one: one degree for all stages can only be 1 (three
    stages); a stage of degree 2 on the A100s and one of 1 on the V100 is faster. Brute force over every
    candidate, type order, split and mode agrees with the solver, and finds no one-degree plan as fast."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.planner.search import search
    from hetpar.runtime.model_file import load_model_file

    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 4, "hidden": 2048, "heads": 16, "seq_len": 512, "vocab": 32000}))
    cluster = parse_cluster("1x2xA100-80GB+1x1xV100-32GB")
    options = SearchOptions(global_batch_size=16, dtype="fp16", workers=1, micro_batch_size=4)
    rows = _solver_and_brute_force(graph, cluster, options)
    for cand, solved, best, _ in rows:
        assert (solved is None) == (best is None), cand.describe()
        if best is not None:
            assert solved == pytest.approx(best, rel=1e-4), cand.describe()
    best_mixed = min(best for _, _, best, _ in rows if best is not None)
    best_uniform = min(uniform for _, _, _, uniform in rows if uniform is not None)
    assert best_mixed < best_uniform * 0.99
    plan = search(graph, cluster, options)
    assert sorted((s.device_type, s.tensor_parallel) for s in plan.stages) == [("A100-80GB", 2), ("V100-32GB", 1)]
    types = cluster.device_types()
    assert all(types[r] == s.device_type for s in plan.stages for rep in s.ranks for r in rep)


def test_a_plan_of_mixed_degrees_is_estimated_as_the_search_predicted():
    """The plan's prediction comes from planner.estimate on the plan's own ranks ([Note: plan prediction]);
    explaining the plan estimates it again from the plan file's fields and must agree."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.planner.explain import explain_plan
    from hetpar.planner.search import search
    from hetpar.runtime.model_file import load_model_file

    args = {"n_layers": 4, "hidden": 2048, "heads": 16, "seq_len": 512, "vocab": 32000}
    graph = trace_model(load_model_file("examples/gpt.py", args))
    cluster = parse_cluster("1x2xA100-80GB+1x1xV100-32GB")
    plan = search(graph, cluster, SearchOptions(global_batch_size=16, dtype="fp16", workers=1))
    assert len({s.tensor_parallel for s in plan.stages}) > 1
    again = explain_plan(plan).estimate
    assert [s.ranks for s in again.stages] == [s.ranks for s in plan.stages[: plan.pipeline_parallel]]
    assert again.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    assert again.predicted.peak_memory_bytes == plan.predicted.peak_memory_bytes


@pytest.mark.parametrize("dp,degrees,width", [(1, [2, 4, 1, 1], 4), (2, [1, 2, 1], 4), (1, [8, 4, 2, 1, 1], 8), (3, [2, 2], 2)])
def test_stage_blocks_keep_tensor_parallel_groups_inside_a_node(dp, degrees, width):
    from hetpar.planner.costing import pack_stage_ranks

    world = dp * sum(degrees)
    stages = pack_stage_ranks(list(range(world)), dp, degrees)
    assert sorted(r for s in stages for rep in s for r in rep) == list(range(world))
    for stage, tp in zip(stages, degrees):
        assert len(stage) == dp and all(len(rep) == tp for rep in stage)
        assert all(len({r // width for r in rep}) == 1 for rep in stage)


def test_candidates_the_solver_does_not_settle_leave_the_search_feasible_with_its_gap(monkeypatch):
    """Pipelined candidates get a time limit too short to settle them (Unresolved): the search keeps
    their lower bounds open and reports status feasible with a gap that the true optimum respects.
    CP-SAT alone: the dynamic programme has no limit to hit."""
    import dataclasses

    import hetpar.planner.search.solve as search_module
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.runtime.model_file import load_model_file

    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 8, "hidden": 64, "seq_len": 16}))
    cluster = parse_cluster("1x4xcpu")
    options = SearchOptions(global_batch_size=8, dtype="fp32", workers=1, split_solver="cp-sat")
    full = search_module.search(graph, cluster, options)
    solve_split = search_module.solve_split

    def hurried(tables, opts, *args, **kw):
        if tables.candidate.pp > 1:
            opts = dataclasses.replace(opts, time_limit_s=1e-6)
        return solve_split(tables, opts, *args, **kw)

    monkeypatch.setattr(search_module, "solve_split", hurried)
    hurried_plan = search_module.search(graph, cluster, options)
    assert full.solver.status == "optimal" and full.solver.objective_gap == 0
    assert hurried_plan.solver.status == "feasible" and hurried_plan.solver.objective_gap > 0
    assert hurried_plan.pipeline_parallel == 1  # only unpipelined candidates were settled
    proven = hurried_plan.solver.objective_s * (1 - hurried_plan.solver.objective_gap)
    assert proven <= full.solver.objective_s * (1 + 1e-6) <= hurried_plan.solver.objective_s * (1 + 1e-6)
    assert full.pipeline_parallel > 1 or full.solver.objective_s == pytest.approx(hurried_plan.solver.objective_s)


@pytest.mark.slow
def test_a_searched_plan_of_mixed_degrees_trains_like_one_process(tmp_path, gpt_path):
    """Three stages on four devices: the search gives one stage degree 2 and two degree 1 (their blocks
    largest first), and the compiled program trains like one process."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from tests.test_distributed import GPT_ARGS, assert_trains_like_one_process

    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=2, pp=3, dp=1)
    plan = plan_model(gpt_path, parse_cluster("1x4xcpu"), options, model_args=GPT_ARGS)
    assert sorted(s.tensor_parallel for s in plan.stages) == [1, 1, 2]
    assert_trains_like_one_process(plan, tmp_path)


def test_on_a_mixed_cluster_the_plan_is_the_finalist_that_simulates_fastest():
    """[Note: finalists re-ranked]: an 8-block GPT on 4 V100 + 4 T4, batch 16. The linear
    objective's optimum is not the plan the simulation prefers; the search returns the
    latter, keeps the others with both numbers, and its proof line says which it bounds."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.plan import proof_scope

    from pathlib import Path

    gpt = Path(__file__).resolve().parent.parent / "benchmarks" / "published" / "gpt.py"
    args = dict(n_layers=8, hidden=512, heads=8, seq_len=512, vocab=8192)
    plan = plan_model(gpt, parse_cluster("1x4xV100-16GB+1x4xT4-16GB"),
                      SearchOptions(global_batch_size=16, dtype="fp16"), model_args=args)
    info = plan.solver
    simulated = [a["simulated_step_s"] for a in plan.alternatives if "simulated_step_s" in a]
    assert info.finalists == 1 + len(simulated) == 4
    assert all(plan.predicted.step_time_s <= s for s in simulated)
    linear = [a["step_time_s"] for a in plan.alternatives if "simulated_step_s" in a]
    assert info.best_objective_s == min(linear + [info.objective_s]) < info.objective_s  # re-ranking moved the choice
    assert proof_scope(plan).endswith("fastest of the search's 4 finalists")
    one_type = plan_model(gpt, parse_cluster("1x8xV100-16GB"),
                          SearchOptions(global_batch_size=16, dtype="fp16"), model_args=args)
    assert one_type.solver.finalists == 1 and one_type.solver.objective_s == one_type.solver.best_objective_s


@pytest.mark.parametrize("seed", range(8))
def test_partition_pace_is_the_least_slowest_run_over_every_split_and_type_order(seed):
    """[Note: partition pace] against brute force: every split of the layers into pp runs of at least one
    layer, every order of the types' blocks, each run's time its layers' least times on its rank's type."""
    import itertools

    from hetpar.planner.costing import Candidate, StageMode
    from hetpar.planner.search.bounds import _BoundLayers, _partition_pace

    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(3, 9))
    counts = {"A100-80GB": int(rng.integers(1, 3)), "V100-32GB": int(rng.integers(1, 3))}
    pp = sum(counts.values())
    # two offered degrees per type; a degree that cannot split a layer is infinite there
    layers = {}
    for device_type in counts:
        times = rng.uniform(0.5, 2.0, (2, num_layers)) * (2.5 if device_type == "V100-32GB" else 1.0)
        times[1, rng.integers(num_layers)] = np.inf
        if device_type == "V100-32GB" and seed % 2:  # a layer this type cannot hold at any degree
            times[:, rng.integers(num_layers)] = np.inf
        layers[device_type] = _BoundLayers(times=times, weights=np.zeros_like(times), device_s=times, epilogue=np.zeros(num_layers),
                                           latency=0.0)
    cand = Candidate(dp=1, pp=pp, micro_batch_size=1, num_microbatches=4, schedule="1f1b",
                     modes=(StageMode(tp=1), StageMode(tp=2)), stages_per_type=tuple(counts.items()))
    least = {t: b.times.min(axis=0) for t, b in layers.items()}
    best = np.inf
    for order in itertools.permutations(counts):
        types = [t for t in order for _ in range(counts[t])]
        for cuts in itertools.combinations(range(1, num_layers), pp - 1):
            edges = (0, *cuts, num_layers)
            best = min(best, max(float(least[t][a:b].sum()) for t, a, b in zip(types, edges, edges[1:])))
    pace = _partition_pace(None, cand, layers, None, {})
    if not np.isfinite(best):
        assert pace == 0.0
    else:
        assert pace == pytest.approx(best, rel=1e-9) and pace <= best
    # a pinned sequence is bounded on its own
    pinned = tuple(t for t in reversed(list(counts)) for _ in range(counts[t]))
    alone = min((max(float(least[t][a:b].sum()) for t, a, b in zip(pinned, (0, *c), (*c, num_layers)))
                 for c in itertools.combinations(range(1, num_layers), pp - 1)), default=np.inf)
    assert _partition_pace(None, cand, layers, pinned, {}) == pytest.approx(alone if np.isfinite(alone) else 0.0, rel=1e-9)


@pytest.mark.parametrize("cluster_spec", ["1x2xV100-16GB", "1x2xA100-80GB+1x2xV100-32GB"])
def test_bounds_hold_where_sequence_parallelism_is_cheaper_than_tensor_parallelism_alone(cluster_spec):
    """Sequence parallelism divides the repeated elementwise work's memory traffic by tp, so a stage under it
    can be faster than at tp alone: the candidate bound and the degree budget bound must hold for such
    splits too (they once took tp alone's times and pruned a faster plan)."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.planner.search import enumerate_candidates, lower_bound_s, solve_candidate
    from hetpar.planner.search.bounds import budget_may_beat
    from hetpar.runtime.model_file import load_model_file

    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 256}))
    cluster = parse_cluster(cluster_spec)
    options = SearchOptions(global_batch_size=16, dtype="fp32", workers=1)
    with_sp = 0
    for cand in enumerate_candidates(graph, cluster, options):
        _, split = solve_candidate(graph, cluster, cand, options)
        if split is None:
            continue
        with_sp += any(cand.modes[k].sp for k in split.modes)
        assert lower_bound_s(graph, cluster, cand, options.dtype) <= split.cost.objective_s * (1 + 1e-9), cand.describe()
        assert budget_may_beat(graph, cluster, cand, options, {}, split.cost.objective_s * (1 + 1e-9)), cand.describe()
    assert with_sp  # some candidate's best split runs sequence parallelism
