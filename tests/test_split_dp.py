"""The split by dynamic programming ([Note: split by dynamic programming] in planner.search.split_dp)
against brute force, under cutoffs and pins, and against CP-SAT on a traced model."""

from dataclasses import replace

import numpy as np
import pytest

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.costing import CostTables, evaluate_split
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import search
from hetpar.planner.capture import trace_model
from hetpar.planner.search.split_dp import dp_eligible, dp_relaxes, solve_split_dp
from hetpar.runtime.model_file import load_model_file
from tests.conftest import ROOT
from tests.search_tables import PLAIN, RECOMPUTE, ZERO, brute_force, random_tables

# (layers, pp, micro-batches, schedule, modes, memory, degrees, devices, unsplit): the cases CP-SAT's
# brute-force tests do not reach: three ranks with stage degrees, zero-bubble with ZeRO, one micro-batch
# (no pace term), a layer that a degree cannot split.
CASES = [
    (6, 3, 4, "1f1b", RECOMPUTE, 1.2, (1, 2), 5, ()),
    (7, 3, 2, "zb", RECOMPUTE, 0.9, (1, 2, 4), 6, ((2, 4),)),
    (6, 2, 1, "1f1b", ZERO, 1.0, (1,), None, ()),
    (7, 3, 6, "zb", ZERO, 0.8, (1,), None, ()),
    (8, 4, 8, "1f1b", PLAIN, 100, (1, 2), 6, ((0, 2), (5, 2))),
    (5, 1, 3, "gpipe", ZERO, 0.7, (1,), None, ()),
]


def _brute(tables):
    return brute_force(tables, accept=lambda modes: tables.tp_sum_ok(list(modes)))


def _against_brute_force(tables, brute):
    """(brute force's best, the programme's answer); where nothing fits, the programme finds nothing either."""
    best, found = brute(tables), solve_split_dp(tables)
    if best is None:
        assert found.bounds is None
    return best, found


@pytest.mark.parametrize("case", CASES, ids=[f"L{c[0]}-pp{c[1]}-m{c[2]}-{c[3]}-K{len(c[4])}-deg{len(c[6])}" for c in CASES])
@pytest.mark.parametrize("seed", range(3))
def test_programme_matches_brute_force(case, seed):
    L, pp, m, schedule, modes, memory, degrees, devices, unsplit = case
    rng = np.random.default_rng(100 * seed + len(CASES))
    tables = random_tables(rng, L, pp, m, modes=modes, schedule=schedule, memory=memory, degrees=degrees, devices=devices,
                           unsplit=unsplit)
    assert dp_eligible(tables)
    best, found = _against_brute_force(tables, _brute)
    if best is None:
        return
    cost = evaluate_split(tables, found.bounds, found.modes)
    assert cost.fits(tables)
    assert cost.objective_s == pytest.approx(best[0], rel=1e-12)
    # a cutoff above the optimum keeps it, one at or below it leaves nothing of interest
    for slack in (1e-9, 1e-3, 1e-2, 5e-2, 0.2, 1.0):  # however close above: the caps may leave one point to solve
        above = solve_split_dp(tables, cutoff_s=best[0] * (1 + slack))
        assert evaluate_split(tables, above.bounds, above.modes).objective_s == pytest.approx(best[0], rel=1e-12), slack
    assert solve_split_dp(tables, cutoff_s=best[0]).bounds is None
    assert solve_split_dp(tables, cutoff_s=best[0] * (1 - 1e-9)).bounds is None


@pytest.mark.parametrize("seed", range(4))
def test_a_pinned_split_keeps_its_sizes_and_takes_its_best_modes(seed):
    rng = np.random.default_rng(seed)
    tables = random_tables(rng, 7, 3, 4, modes=ZERO, memory=0.9)
    sizes = [(3, 2, 2), (1, 1, 5), (2, 4, 1), (5, 1, 1)][seed]
    edges = np.cumsum((0, *sizes))
    bounds = [(int(edges[c]), int(edges[c + 1]) - 1) for c in range(3)]
    fitting = [evaluate_split(tables, bounds, list(modes)) for modes in np.ndindex(*(len(ZERO),) * 3)]
    fitting = [c for c in fitting if c.fits(tables)]
    found = solve_split_dp(tables, fixed_sizes=sizes)
    if not fitting:
        assert found.bounds is None
        return
    assert found.bounds == bounds
    best = min(c.objective_s for c in fitting)
    assert evaluate_split(tables, found.bounds, found.modes).objective_s == pytest.approx(best, rel=1e-12)


def test_equally_fast_modes_go_to_the_plainest():
    """Full recompute costing exactly what no recompute costs (and keeping less): the programme keeps none."""
    rng = np.random.default_rng(3)
    tables = random_tables(rng, 6, 2, 4, modes=RECOMPUTE, memory=100)
    same = {name: np.repeat(getattr(tables, name)[:1], 2, axis=0) for name in
            ("time_s", "fwd_s", "weight_s", "gather_fwd_s", "gather_bwd_s", "epilogue_s", "gather_fwd_latency_s",
             "gather_bwd_latency_s", "epilogue_latency_s")}
    tied = CostTables(**{**tables.__dict__, **same})
    found = solve_split_dp(tied)
    assert [tied.candidate.modes[k].recompute for k in found.modes] == ["none", "none"]


def test_interleaved_candidates_stay_with_cp_sat():
    tables = random_tables(np.random.default_rng(0), 6, 2, 4, schedule="interleaved", virtual_stages=2)
    assert not dp_eligible(tables)


@pytest.fixture(scope="module")
def gpt():
    return trace_model(load_model_file(ROOT / "examples" / "gpt.py", {"n_layers": 6, "hidden": 256, "heads": 4, "seq_len": 256}))


@pytest.mark.parametrize("cluster", ["2x2xA100-80GB", "1x2xA100-80GB+1x2xV100-32GB"])
def test_the_search_finds_what_cp_sat_finds_on_a_traced_model(gpt, cluster):
    """The whole search on examples/gpt.py, each candidate of one chunk per rank by the programme, then by
    CP-SAT alone: the same least objective (CP-SAT's to within its ticks), both proven optimal."""
    options = SearchOptions(global_batch_size=16, dtype="fp32", max_virtual_stages=1)
    by_programme = search(gpt, parse_cluster(cluster), options)
    by_cp_sat = search(gpt, parse_cluster(cluster), replace(options, split_solver="cp-sat"))
    assert by_programme.solver.status == by_cp_sat.solver.status == "optimal"
    assert by_programme.solver.best_objective_s == pytest.approx(by_cp_sat.solver.best_objective_s, rel=1e-5)
    assert by_programme.solver.best_objective_s <= by_cp_sat.solver.best_objective_s * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_interleaved_relaxation_bounds_the_optimum_and_its_split_fits(seed):
    """[Note: interleaved relaxation]: its bound is at most brute force's optimum, its split fits and costs at
    least that, it claims the optimum only where it has it, and a cutoff at or below its bound rules out all."""
    rng = np.random.default_rng(seed)
    pp, v = (2, 2) if seed % 2 else (2, 3)
    tables = random_tables(rng, 7, pp, 4, modes=RECOMPUTE, schedule="interleaved", virtual_stages=v,
                           memory=[0.9, 1.4, 100][seed % 3])
    assert dp_relaxes(tables)
    best, found = _against_brute_force(tables, brute_force)
    if best is None:
        return
    assert found.lower_s <= best[0] * (1 + 1e-12)
    if found.bounds is not None:
        cost = evaluate_split(tables, found.bounds, found.modes)
        assert cost.fits(tables) and cost.objective_s >= best[0] * (1 - 1e-12)
        assert not found.exact or cost.objective_s == pytest.approx(best[0], rel=1e-12)
    ruled_out = solve_split_dp(tables, cutoff_s=found.lower_s * (1 - 1e-9))
    assert ruled_out.bounds is None and ruled_out.exact


def test_a_plan_the_programme_settles_never_imports_cp_sat(tmp_path):
    """With the trace cached and no interleaved candidate, `hetpar plan` runs no CP-SAT model and so never
    imports CP-SAT (a third of a second, with the pandas it imports), and still proves its plan optimal."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "HETPAR_TRACE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    code = ("import sys\nfrom hetpar.cli import app\n"
            "try:\n    app(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('cp-sat imported:', 'ortools.sat.python.cp_model' in sys.modules)\n")
    args = ["plan", str(ROOT / "examples" / "gpt.py"), "-a", "n_layers=4", "-a", "hidden=64", "-a", "seq_len=32",
            "-c", "1x4xcpu", "-b", "8", "--virtual-stages", "1"]
    for run in range(2):
        out = tmp_path / f"plan{run}.json"
        done = subprocess.run([sys.executable, "-c", code, *args, "-o", str(out)], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    assert "cp-sat imported: False" in done.stdout  # the second run, from the cache
    assert json.loads(out.read_text())["solver"]["status"] == "optimal"


def test_a_cutoff_above_the_optimum_keeps_it_where_the_caps_leave_one_point():
    """One micro-batch (no pace term) and a cut across a WAN that outweighs the layers: under a cutoff a
    little above the optimum each maximum keeps one value, and that point of the caps must still be solved
    (it was once dropped, and a faster plan with it)."""
    from hetpar.planner.costing import build_tables
    from hetpar.planner.search import enumerate_candidates
    from tests.test_zones import WIDE_GPT, zoned

    graph = trace_model(load_model_file(ROOT / "examples" / "gpt.py", WIDE_GPT))
    cluster = zoned(("eu", "1x4xA100-40GB"), ("us", "1x4xA100-40GB"), gbps=10, latency_ms=20)
    options = SearchOptions(global_batch_size=8, dtype="fp16", workers=1)
    checked = 0
    for cand in enumerate_candidates(graph, cluster, options):
        if cand.virtual_stages != 1 or cand.pp < 2:
            continue
        tables = build_tables(graph, cluster, cand, options.dtype, options.optimizer, cache={})
        best = solve_split_dp(tables)
        if best.bounds is None:
            continue
        optimum = evaluate_split(tables, best.bounds, best.modes).objective_s
        for slack in (1e-6, 1e-3, 1e-2, 5e-2):
            above = solve_split_dp(tables, cutoff_s=optimum * (1 + slack))
            assert above.bounds is not None, (cand.describe(), slack)
            assert evaluate_split(tables, above.bounds, above.modes).objective_s == pytest.approx(optimum, rel=1e-12)
        checked += 1
    assert checked
