"""Valid input never crashes the planner (issue 22): property-based tests over hetpar plan's inputs.

The generators and the invariant live in tests/fuzz_cases.py; benchmarks/fuzz.py runs
them at length. Here a fixed-seed sample keeps CI fast: each case is planned in-process
(planner.api.plan_model, as `hetpar plan` calls it) with a short CP-SAT work limit and
each model size traced once, then its plan explained and compiled, or its error
checked to be one of the CLI's one-line domain errors.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import run_torchrun
from fuzz_cases import MODELS, Case, Group, Outcome, cached_trace, cases, check_one_line, run_case, use_cached_traces
from hetpar.commands.common import DOMAIN_ERRORS

WORK_LIMIT_S = 0.5  # CP-SAT deterministic seconds per candidate: the small models here solve well within it
FUZZ = settings(derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _cached_traces(monkeypatch):
    use_cached_traces(monkeypatch)


def _run(case: Case):
    with tempfile.TemporaryDirectory(prefix="hetpar-fuzz-") as tmp:
        outcome = run_case(case, Path(tmp), work_limit_s=WORK_LIMIT_S)
    event(outcome.kind)  # pytest --hypothesis-show-statistics: how many cases planned
    return outcome


@settings(FUZZ, max_examples=120)
@given(cases(max_world=16, models=MODELS[:4] + MODELS[6:8]))
def test_plan_is_a_valid_plan_or_one_line(case):
    _run(case)


@settings(FUZZ, max_examples=30)
@given(cases(max_groups=2, max_nodes=2, max_world=16, objectives=("cost",)))
def test_cost_objective_is_a_valid_plan_or_one_line(case):
    _run(case)


@st.composite
def estimate_configs(draw):
    """What `hetpar estimate` takes: a model, a cluster and one configuration; mostly one that fits the cluster."""
    model, args, num_layers = draw(st.sampled_from(MODELS[:4] + MODELS[6:8]))
    groups = draw(st.lists(st.tuples(st.integers(1, 2), st.sampled_from((1, 2, 4, 8)),
                                     st.sampled_from(("A100-80GB", "V100-32GB", "H100-80GB", "T4-16GB", "Ascend910B", "cpu"))),
                           min_size=1, max_size=2))
    pick = lambda values: draw(st.sampled_from(values))  # noqa: E731
    mostly = lambda: draw(st.integers(0, 5)) > 0  # noqa: E731 - a consistent choice, now and then not
    world = sum(n * d for n, d, _ in groups)
    dp = pick([d for d in (1, 2, 4, 8) if world % d == 0])
    tp = pick([d for d in (1, 2, 4) if world // dp % d == 0])
    pp = world // (dp * tp) if mostly() else pick((1, 2, 3))
    mbs = pick((1, 2, 4))
    schedule = pick(("1f1b", "gpipe", "interleaved", "zb"))
    v = pick((2, 3)) if schedule == "interleaved" and mostly() else 1
    config = dict(global_batch_size=dp * mbs * pick((1, 2, 3, 4)) * (pp if schedule == "interleaved" else 1),
                  dp=dp, tp=tp, pp=pp, micro_batch_size=mbs, schedule=schedule, virtual_stages=v,
                  recompute=pick(("none", "selective", "full")), zero_stage=pick((0, 0, 1, 2, 3)),
                  optimizer=pick(("adamw", "adam", "sgd")), overlap_grad_reduce=draw(st.booleans()))
    if draw(st.booleans()) and pp * v <= num_layers:
        cuts = sorted(draw(st.lists(st.integers(1, num_layers - 1), min_size=pp * v - 1, max_size=pp * v - 1, unique=True)))
        config["stage_layers"] = tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_layers]))
    if draw(st.booleans()):
        config["stage_devices"] = tuple(pick([g[2] for g in groups]) for _ in range(pp))
    return model, args, "+".join(f"{n}x{d}x{t}" for n, d, t in groups), config


@settings(FUZZ, max_examples=150)
@given(estimate_configs())
def test_estimate_is_finite_or_one_line(drawn):
    """`hetpar estimate`'s library call on random configurations: finite numbers, or a one-line domain error."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.commands.common import default_dtype
    from hetpar.planner.estimate import EstimateConfig, estimate
    from hetpar.runtime.model_file import load_model_file

    from fuzz_cases import EXAMPLES

    model, args, spec, config = drawn
    try:
        cluster = parse_cluster(spec)
        graph = cached_trace(load_model_file(EXAMPLES / model, dict(args)))
        result = estimate(graph, cluster, EstimateConfig(dtype=default_dtype(cluster.device_types()), **config))
    except DOMAIN_ERRORS as exc:
        check_one_line(exc)
        event("error")
        return
    event("estimate")
    p = result.predicted
    assert math.isfinite(p.step_time_s) and p.step_time_s > 0
    assert all(math.isfinite(v) and v >= 0 for v in (p.bubble_time_s, p.dp_comm_time_s, p.pp_comm_time_s, p.tp_comm_time_s))
    assert all(math.isfinite(m) and m >= 0 for m in p.peak_memory_bytes)
    assert math.isfinite(result.mfu)


def test_model_table_matches_the_traces():
    """fuzz_cases.MODELS' layer counts (stage-layer pins are drawn from them) are what the tracer sees."""
    from hetpar.runtime.model_file import load_model_file

    from fuzz_cases import EXAMPLES

    for model, args, num_layers in MODELS:
        assert len(cached_trace(load_model_file(EXAMPLES / model, dict(args))).layers) == num_layers, (model, args)


# The commands of issue 22, each once a traceback.
GPT_2 = (("n_layers", 2), ("hidden", 1024), ("heads", 4))
ISSUE_22 = {
    "min_throughput_mixed_nics": Case(
        model="gpt.py", model_args=(("n_layers", 12), ("hidden", 1024), ("heads", 4)), num_layers=14,
        groups=(Group(2, 2, "A100-80GB", 100, 4), Group(2, 8, "T4-16GB", 25, 1)), toml=False, global_batch=8,
        min_throughput=1e6),
    "tp_pin_hetero_dp": Case(
        model="gpt.py", model_args=GPT_2, num_layers=4,
        groups=(Group(2, 1, "Ascend910B", 25, 1), Group(1, 2, "V100-32GB"), Group(1, 4, "A100-80GB", 100, 4)),
        toml=False, global_batch=64, pins=(("tp", 2),)),
    "selective_recompute_three_types": Case(
        model="gpt.py", model_args=GPT_2, num_layers=4,
        groups=(Group(2, 8, "V100-32GB"), Group(2, 4, "H100-80GB", 25, 1), Group(2, 2, "Ascend910B")),
        toml=False, global_batch=64, pins=(("recompute", "selective"),)),
    "cost_objective_mixed": Case(
        model="gpt.py", model_args=(("n_layers", 24), ("hidden", 2048), ("heads", 16), ("seq_len", 2048), ("vocab", 51200)),
        num_layers=26, groups=(Group(1, 8, "A100-80GB"), Group(1, 8, "V100-32GB")), toml=False, global_batch=256,
        objective="cost", prices=(("A100-80GB", 1.8), ("V100-32GB", 0.6)), min_throughput=50),
    "plain_mixed": Case(
        model="gpt.py", model_args=(("n_layers", 4), ("hidden", 1024), ("heads", 4)), num_layers=6,
        groups=(Group(2, 4, "V100-32GB", 25, 1), Group(2, 1, "T4-16GB", 25, 1)), toml=False, global_batch=8),
}


@pytest.mark.parametrize("name", list(ISSUE_22))
def test_issue_22_commands_plan_or_say_why(name, tmp_path):
    outcome = run_case(ISSUE_22[name], tmp_path, work_limit_s=1.0, compile_plans=False)
    if name == "min_throughput_mixed_nics":
        assert outcome.kind == "error"
        assert "below --min-throughput 1e+06" in outcome.message and "samples/s" in outcome.message
    else:
        assert outcome.kind == "plan", outcome.message


# Cases the fuzzer found, each a broken invariant or crash once; a plan now (the invariant checked in full).
FOUND = {
    # a bubble of -7e-21 s, the makespan less the busy time rounded
    "one_stage_bubble": Case(model="mlp.py", model_args=(("depth", 1),), num_layers=2, groups=(Group(2, 8, "T4-16GB", 200, 1),),
                             toml=False, global_batch=256, min_throughput=50),
    # stages on Megatron's layout over two device types: explain refused the plan (stage devices A100, A100)
    "megatron_over_mixed": Case(model="mlp.py", model_args=(("depth", 1),), num_layers=2,
                                groups=(Group(1, 2, "GH200-96GB", 12.5, 4), Group(3, 2, "A100-80GB")), toml=False, global_batch=24,
                                pins=(("schedule", "1f1b"), ("recompute", "full")), dtype="fp32"),
    # --stage-layers without --virtual-stages: interleaved candidates had twice the chunks the pin gives (max() of nothing)
    "stage_layers_unpinned_v": Case(model="gpt.py", model_args=MODELS[2][1], num_layers=6, groups=(Group(1, 2, "cpu"),), toml=False,
                                    global_batch=8, pins=(("stage_layers", (3, 3)),)),
    # heterogeneous data parallelism dropped the --zero pin
    "zero_pin_mixed": Case(model="gpt.py", model_args=MODELS[0][1], num_layers=3, groups=(Group(3, 1, "A100-40GB"), Group(1, 3, "A100-80GB")),
                           toml=False, global_batch=2, pins=(("zero", 1),)),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_fuzzer_findings_plan(name, tmp_path):
    outcome = run_case(FOUND[name], tmp_path, work_limit_s=1.0)
    assert outcome.kind == "plan", outcome.message


def test_non_positive_time_limit_is_one_line(tmp_path):
    """CP-SAT given a negative time limit answered as if nothing fit ("needs 0.0 GiB")."""
    case = Case(model="gpt.py", model_args=MODELS[0][1], num_layers=3, groups=(Group(1, 2, "cpu"),), toml=False, global_batch=8)
    outcome = run_case(case, tmp_path, time_limit_s=-1.0)
    assert outcome.message == "--time-limit must be a positive number of seconds, got -1"


def test_degree_misfit_is_not_called_memory(tmp_path):
    """A layout that fails on a layer's tensor-parallel splits once read "needs inf GiB on stage 1". (Context
    parallelism would take the devices tp cannot: pinned off.)"""
    case = Case(model="gpt.py", model_args=MODELS[0][1], num_layers=3, groups=(Group(1, 8, "H200-141GB"), Group(3, 8, "Ascend910B")),
                toml=False, global_batch=12, pins=(("dp", 2), ("schedule", "1f1b"), ("cp", 1)), dtype="fp32")
    outcome = run_case(case, tmp_path)
    assert outcome.kind == "error"
    assert outcome.message.startswith("no plan: layer blocks.0 splits only 2 ways") and "inf" not in outcome.message


def test_unreachable_cost_target_names_the_best_throughput(tmp_path):
    case = Case(model="gpt.py", model_args=GPT_2, num_layers=4, groups=(Group(1, 2, "A100-80GB"), Group(1, 2, "V100-32GB")),
                toml=False, global_batch=8, objective="cost", prices=(("A100-80GB", 1.8), ("V100-32GB", 0.6)), min_throughput=1e9)
    outcome = run_case(case, tmp_path, work_limit_s=1.0)
    assert outcome.kind == "error"
    assert "the fastest plan found reaches" in outcome.message and "add devices or lower the target" in outcome.message


def test_pinned_pp_reaches_per_type_stage_counts(tmp_path):
    """--pp 4 on 4 H100s + 8 A100s at dp 2 is two stages on each type (1 + 1 and 2 + 2 devices per replica),
    which none of the uniform stage counts (6, 3, 2) is."""
    case = Case(model="gpt.py", model_args=(("n_layers", 6), ("hidden", 256), ("heads", 8), ("vocab", 1000), ("seq_len", 128)),
                num_layers=8, groups=(Group(1, 4, "H100-80GB"), Group(1, 8, "A100-40GB")), toml=False, global_batch=16,
                pins=(("pp", 4), ("dp", 2)), hetero_dp="off")
    outcome = run_case(case, tmp_path, work_limit_s=1.0, compile_plans=False)
    assert outcome.kind == "plan", outcome.message


def test_dtype_a_device_lacks_is_one_line(tmp_path):
    case = Case(model="gpt.py", model_args=MODELS[0][1], num_layers=3, groups=(Group(1, 2, "V100-32GB"),), toml=False,
                global_batch=8, dtype="bf16")
    outcome = run_case(case, tmp_path)
    assert outcome == Outcome("error", "V100-32GB has no bf16; use --dtype fp16", {"type": "PlanningError"})


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    Case(model="gpt.py", model_args=MODELS[0][1], num_layers=3, groups=(Group(1, 2, "cpu"),), toml=False, global_batch=4),
    Case(model="gpt.py", model_args=MODELS[1][1], num_layers=4, groups=(Group(1, 2, "cpu"),), toml=False, global_batch=8,
         pins=(("pp", 2), ("schedule", "gpipe"))),
    Case(model="mlp.py", model_args=MODELS[7][1], num_layers=5, groups=(Group(1, 2, "cpu"),), toml=False, global_batch=8,
         pins=(("dp", 2),)),
], ids=["gpt-searched", "gpt-pp2-gpipe", "mlp-dp2"])
def test_small_cpu_plans_run_two_steps(case, tmp_path):
    """Fuzzed plans are programs: a few tiny CPU plans compiled and run under torchrun for two steps."""
    outcome = run_case(case, tmp_path, work_limit_s=2.0)
    assert outcome.kind == "plan", outcome.message
    result = run_torchrun(tmp_path / "build" / "train.py", 2, ["--steps", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
