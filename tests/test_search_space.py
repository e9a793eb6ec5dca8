"""The search space of issue 5: per-stage recompute and ZeRO modes inside the CP-SAT model,
every schedule's linear step time, and the plan pins that go with them."""

import random
import zlib
from dataclasses import replace

import numpy as np
import pytest

from hetpar.cost_models.pipeline import bubble_time_s, linear_step_time_s
from hetpar.planner.costing import CostTables, evaluate_split
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import solve_split
from hetpar.planner.search.split_dp import dp_eligible
from hetpar.runtime.schedule import Kind, build_schedule, simulate_timed
from tests.cli_helpers import assert_one_line_error, hetpar
from tests.search_tables import RECOMPUTE, ZERO, brute_force, random_tables

OPTIONS = SearchOptions(global_batch_size=8, dtype="fp32", time_limit_s=20, workers=1)

# (layers, pp, virtual stages, micro-batches, schedule, modes, memory): small enough to enumerate every
# split and every mode of every chunk, tight and ample memory.
SPACE = [
    (L, pp, v, m, schedule, modes, memory)
    for schedule, pp, v, m in (("1f1b", 2, 1, 4), ("1f1b", 3, 1, 2), ("gpipe", 2, 1, 3), ("zb", 2, 1, 4), ("zb", 3, 1, 2),
                               ("zb", 3, 1, 5), ("interleaved", 2, 2, 4), ("interleaved", 2, 3, 2), ("interleaved", 1, 3, 2))
    for modes in (RECOMPUTE, ZERO) if modes is RECOMPUTE or schedule in ("1f1b", "gpipe")  # ZeRO runs under 1F1B and GPipe
    for L in (pp * v + 1, 6, 8) if L >= pp * v and (modes is RECOMPUTE or pp * v <= 2 or L <= 6)
    for memory in (0.9, 1.4, 100)
]


@pytest.mark.parametrize("num_layers,pp,v,m,schedule,modes,memory", SPACE)
def test_solver_matches_brute_force_over_splits_and_modes(num_layers, pp, v, m, schedule, modes, memory):
    rng = np.random.default_rng(zlib.crc32(repr((num_layers, pp, v, m, schedule, len(modes), memory)).encode()))
    tables = random_tables(rng, num_layers, pp, m, modes=modes, schedule=schedule, virtual_stages=v, memory=memory)
    _solver_equals_brute_force(tables)


def _solver_equals_brute_force(tables):
    """The solver's split is optimal, fits, and costs what brute force's best does; None when nothing fits.
    Candidates the dynamic programme takes are solved by CP-SAT too ([Note: split by dynamic programming]):
    the programme's objective is exact, CP-SAT's within its ticks."""
    best = brute_force(tables)
    solvers = ("auto", "cp-sat") if dp_eligible(tables) else ("auto",)
    for solver in solvers:
        result = solve_split(tables, replace(OPTIONS, split_solver=solver))
        if best is None:
            assert result is None
            continue
        assert result is not None and result.status == "optimal"
        assert result.cost.fits(tables)
        assert result.cost.objective_s == pytest.approx(best[0], rel=1e-9 if solver == "auto" else 1e-4)
    return result if best is not None else None


def test_zero_is_chosen_when_memory_forces_it_and_not_when_it_only_costs_time():
    """The same tables, ample then tight memory: ZeRO-3 costs gathers and saves memory."""
    modes = tuple(m for m in ZERO if m.recompute == "none")
    rng = np.random.default_rng(7)
    ample = random_tables(rng, 6, 2, 4, modes=modes, memory=100)
    # Every ZeRO mode syncs slower than plain data parallelism, ZeRO-3's gathers outlast the compute.
    slower = np.array([1.0 + 0.5 * (m.zero_stage > 0) for m in modes])[:, None, None]
    slow_gathers = CostTables(**{**ample.__dict__, "gather_fwd_s": ample.gather_fwd_s + ample.time_s,
                                 "epilogue_s": ample.epilogue_s.max(axis=0) * slower})
    result = solve_split(slow_gathers, OPTIONS)
    assert [modes[k].zero_stage for k in result.modes] == [0, 0]
    plain_need = max(evaluate_split(slow_gathers, result.bounds, [0, 0]).stage_memory_bytes)
    tight = CostTables(**{**slow_gathers.__dict__, "capacity_bytes": slow_gathers.capacity_bytes * 0 + plain_need * 0.5})
    assert solve_split(_only(tight, [0]), OPTIONS) is None  # without ZeRO nothing fits
    result = solve_split(tight, OPTIONS)
    assert result is not None and any(modes[k].zero_stage > 0 for k in result.modes)


def _only(tables, keep):
    """``tables`` offering only the modes ``keep`` (indices)."""
    per_mode = ("time_s", "fwd_s", "weight_s", "gather_fwd_s", "gather_bwd_s", "gather_fwd_latency_s", "gather_bwd_latency_s",
                "epilogue_s", "epilogue_latency_s", "memory_bytes")
    cand = replace(tables.candidate, modes=tuple(tables.candidate.modes[k] for k in keep))
    return CostTables(**{**tables.__dict__, "candidate": cand, **{n: getattr(tables, n)[keep] for n in per_mode}})


# --- [Note: linear step time] against the simulator ------------------------------------------


def _simulated(schedule, p, m, v, fwd, b_input, weight):
    """Makespan of ``schedule`` with per-chunk forward, input-gradient and weight-gradient seconds."""
    split = schedule == "zb"

    def duration(a):
        if a.kind is Kind.FORWARD:
            return fwd[a.stage]
        if a.kind is Kind.WEIGHT:
            return weight[a.stage]
        return b_input[a.stage] + (0.0 if split else weight[a.stage])

    return simulate_timed(build_schedule(schedule, p, m, v), duration).makespan_s


def _linear(schedule, p, m, v, fwd, b_input, weight):
    times = [f + b + w for f, b, w in zip(fwd, b_input, weight)]
    return linear_step_time_s(schedule, num_stages=p, num_microbatches=m, chunk_time_s=times, rank_epilogue_s=[0.0] * p,
                              chunk_weight_s=weight, virtual_stages=v)


GRID = [(s, p, m, v) for s, v in (("1f1b", 1), ("gpipe", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3))
        for p in range(1, 6) for m in range(1, 11) if s != "interleaved" or m % p == 0]


@pytest.mark.parametrize("schedule,p,m,v", GRID)
def test_linear_step_time_is_exact_for_equal_stages(schedule, p, m, v):
    fwd, b_input, weight = 1.0 / v, 1.3 / v, 0.8 / v
    chunks = p * v
    linear = _linear(schedule, p, m, v, [fwd] * chunks, [b_input] * chunks, [weight] * chunks)
    assert linear == pytest.approx(_simulated(schedule, p, m, v, [fwd] * chunks, [b_input] * chunks, [weight] * chunks))
    if schedule != "zb" or m >= p:  # the closed forms (ZB-H1's needs m >= p)
        per_rank = v * (fwd + b_input + weight)
        bubble = bubble_time_s(schedule, num_stages=p, num_microbatches=m, fwd_s=v * fwd, bwd_s=v * (b_input + weight),
                               weight_s=v * weight, virtual_stages=v)
        assert linear == pytest.approx(m * per_rank + bubble)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)])
def test_linear_step_time_tracks_the_simulator_on_unequal_stages(schedule, v):
    """Within the band [Note: linear step time] states; 1F1B's is an upper bound."""
    rng = random.Random(3)
    for _ in range(200):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        if schedule == "interleaved":
            m = p * rng.randint(1, 3)
        fwd = [rng.uniform(0.5, 1.5) for _ in range(p * v)]
        b_input = [f * rng.uniform(0.8, 1.5) for f in fwd]
        weight = [f * rng.uniform(0.5, 1.2) for f in fwd]
        ratio = _linear(schedule, p, m, v, fwd, b_input, weight) / _simulated(schedule, p, m, v, fwd, b_input, weight)
        assert 0.9 <= ratio <= 1.35
        if schedule == "1f1b":
            assert ratio >= 1 - 1e-9


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3), ("interleaved", 4)])
def test_activation_multipliers_match_the_action_lists(schedule, v):
    from hetpar.planner.costing import activation_multipliers
    from hetpar.planner.costing.in_flight import _counted_multipliers

    for p in range(1, 6):
        for m in range(1, 31):
            if schedule == "interleaved" and m % p:
                continue
            assert activation_multipliers(schedule, p, m, v) == pytest.approx(_counted_multipliers(schedule, p, m, v))


# --- Pins on hetpar plan -------------------------------------------------------------------

GPT_ARGS = ("examples/gpt.py", "-c", "1x2xcpu", "-b", "8", "-a", "n_layers=4", "-a", "hidden=64", "-a", "seq_len=16", "--time-limit", "5")


def _planned(*pins):
    import json

    result = hetpar("plan", *GPT_ARGS, *pins, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_pins_virtual_stages():
    plan = _planned("--virtual-stages", "2")
    assert (plan["schedule"], plan["virtual_stages"]) == ("interleaved", 2)
    pp = len(plan["stages"]) // 2
    assert [s["ranks"] for s in plan["stages"][pp:]] == [s["ranks"] for s in plan["stages"][:pp]]


def test_plan_pins_zero_on_every_stage():
    plan = _planned("--zero", "2", "--dp", "2")
    assert plan["data_parallel"] == 2 and {s["zero_stage"] for s in plan["stages"]} == {2}


@pytest.mark.parametrize("pins,fragments", [
    (["--zero", "1", "--dp", "1"], ["--zero 1", "--dp 1"]),
    (["--zero", "2", "--schedule", "zb"], ["--zero 2", "1f1b or gpipe"]),
    (["--virtual-stages", "2", "--schedule", "1f1b"], ["--virtual-stages 2 needs --schedule interleaved"]),
    (["--virtual-stages", "4", "--pp", "2"], ["--pp 2 * --virtual-stages 4 = 8 stages", "6 layers"]),
])
def test_impossible_plan_pins_are_one_line_errors(pins, fragments):
    assert_one_line_error(hetpar("plan", *GPT_ARGS, *pins), *fragments)


def test_zero_on_a_real_model_when_memory_forces_it_and_only_then():
    """A 1B-parameter GPT does not fit four T4s as plain data parallelism; a small one does, and
    takes ZeRO only where the cost model says it makes the step faster."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.capture import trace_model
    from hetpar.planner.errors import PlanningError
    from hetpar.planner.search import search
    from hetpar.runtime.model_file import load_model_file

    cluster = parse_cluster("1x4xT4-16GB")
    options = dict(global_batch_size=8, dtype="fp16", pp=1, tp=1, workers=1)
    big = trace_model(load_model_file("examples/gpt.py", {"n_layers": 4, "hidden": 4096, "heads": 32, "seq_len": 128, "vocab": 32000}))
    with pytest.raises(PlanningError, match="no plan fits in memory"):
        search(big, cluster, SearchOptions(zero=0, **options))
    assert any(s.zero_stage for s in search(big, cluster, SearchOptions(**options)).stages)
    small = trace_model(load_model_file("examples/gpt.py", {"n_layers": 2, "hidden": 256, "heads": 4, "seq_len": 64}))
    chosen = search(small, cluster, SearchOptions(**options))
    plain = search(small, cluster, SearchOptions(zero=0, **options))
    if any(s.zero_stage for s in chosen.stages):
        assert chosen.solver.objective_s < plain.solver.objective_s
    else:
        assert chosen.solver.objective_s == pytest.approx(plain.solver.objective_s)


@pytest.mark.parametrize("num_layers,pp,v,m,schedule,modes,memory", SPACE[::3])
def test_pace_bound_never_rules_out_a_better_split(num_layers, pp, v, m, schedule, modes, memory):
    """[Note: pace bound]: a cutoff just above the brute-force optimum keeps the candidate."""
    from hetpar.planner.search import may_beat

    rng = np.random.default_rng(zlib.crc32(repr((num_layers, pp, v, m, schedule, len(modes), memory)).encode()))
    tables = random_tables(rng, num_layers, pp, m, modes=modes, schedule=schedule, virtual_stages=v, memory=memory)
    best = brute_force(tables)
    if best is not None:
        assert may_beat(tables, best[0] * (1 + 1e-6))


# --- Per-stage tensor-parallel degrees ([Note: per-stage tensor parallelism]) ----------------

# (layers, pp, degrees, devices per replica, modes, memory, layers that cannot split 2 ways)
DEGREE_SPACE = [
    (L, pp, degrees, devices, modes, memory, unsplit)
    for pp, degrees, devices in ((2, (1, 2), 3), (3, (1, 2), 4), (3, (1, 2), 5), (2, (2, 4), 6), (3, (1, 2, 4), 6), (2, (1, 2, 4), 5))
    for modes in (RECOMPUTE, ZERO[::3])
    for L in (pp + 1, 6)
    for memory in (0.6, 100)
    for unsplit in ((), ((1, 2), (2, 2)))
]


@pytest.mark.parametrize("num_layers,pp,degrees,devices,modes,memory,unsplit", DEGREE_SPACE)
def test_solver_matches_brute_force_over_stage_degrees(num_layers, pp, degrees, devices, modes, memory, unsplit):
    """Splits, modes and each stage's degree, the degrees summing to the devices per replica, layers that
    a degree cannot split kept off it: the solver against every assignment."""
    rng = np.random.default_rng(zlib.crc32(repr((num_layers, pp, degrees, devices, len(modes), memory, unsplit)).encode()))
    tables = random_tables(rng, num_layers, pp, 4, modes=modes, memory=memory, degrees=degrees, devices=devices, unsplit=unsplit)
    result = _solver_equals_brute_force(tables)
    if result is None:
        return
    chosen = [tables.candidate.modes[k] for k in result.modes]
    assert sum(m.tp for m in chosen) == devices
    assert not any((l, m.tp) in set(unsplit) for (a, b), m in zip(result.bounds, chosen) for l in range(a, b + 1))


@pytest.mark.parametrize("num_layers,pp,degrees,devices,modes,memory,unsplit", DEGREE_SPACE[::4])
def test_pace_bound_with_degrees_never_rules_out_a_better_split(num_layers, pp, degrees, devices, modes, memory, unsplit):
    """[Note: degree budget bound] inside may_beat: a cutoff just above the brute-force optimum keeps the candidate."""
    from hetpar.planner.search import may_beat

    rng = np.random.default_rng(zlib.crc32(repr((num_layers, pp, degrees, devices, len(modes), memory, unsplit)).encode()))
    tables = random_tables(rng, num_layers, pp, 4, modes=modes, memory=memory, degrees=degrees, devices=devices, unsplit=unsplit)
    best = brute_force(tables)
    if best is not None:
        assert may_beat(tables, best[0] * (1 + 1e-6))


def test_degree_sums_per_device_type_in_every_type_order():
    """Two device types, each with its own share of devices: the type order, split, modes and degrees together."""
    import itertools
    from hetpar.planner.costing import compose_tables, type_sequence
    from hetpar.planner.search import solve_type_orders

    rng = np.random.default_rng(11)
    shares = {"A100-80GB": 3, "V100-32GB": 2}
    typed = {}
    for device_type, slow in zip(shares, (1.0, 2.5)):
        t = random_tables(rng, 6, 3, 4, modes=RECOMPUTE, memory=1.0, degrees=(1, 2), devices=None)
        cand = replace(t.candidate, tp_sum=tuple(sorted(shares.items())))
        typed[device_type] = CostTables(**{**t.__dict__, "candidate": cand, "time_s": slow * t.time_s, "device_types": [device_type] * 3})
    counts = {"A100-80GB": 2, "V100-32GB": 1}
    best = min((b for order in itertools.permutations(typed)
                if (b := brute_force(compose_tables(typed, type_sequence(list(order), counts)))) is not None), default=None)
    result = solve_type_orders(typed, counts, OPTIONS)
    assert best is not None and result is not None and result.status == "optimal"
    assert result.cost.objective_s == pytest.approx(best[0], rel=1e-4)
    composed = compose_tables(typed, result.types)
    for device_type, share in shares.items():
        assert sum(composed.candidate.modes[result.modes[r]].tp for r in range(3) if result.types[r] == device_type) == share
