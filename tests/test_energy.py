"""--objective energy: the sub-cluster plan of fewest joules per step that meets a throughput target, against
brute force; the energy model by hand; grams of CO2 from the zones' grid intensity."""

from __future__ import annotations

import itertools
import json

import pytest

from cli_helpers import assert_one_line_error, hetpar
from conftest import ROOT
from hetpar.cost_models.cluster import cluster_from_dict, parse_cluster
from hetpar.cost_models.devices import get_device
from hetpar.cost_models.energy import IDLE_POWER_FRACTION, JOULES_PER_KWH
from hetpar.planner.capture import trace_model
from hetpar.planner.errors import PlanningError
from hetpar.planner.options import SearchOptions
from hetpar.planner.search import search
from hetpar.planner.strategies import Objective, least_energy_plan, step_energy
from hetpar.planner.strategies.subcluster import group_uses, subcluster
from hetpar.runtime.model_file import load_model_file

GPT_ARGS = {"n_layers": 4, "hidden": 256, "heads": 4, "seq_len": 128, "vocab": 512}
CLUSTER = "1x2xA100-80GB+1x4xV100-32GB"


@pytest.fixture(scope="module")
def gpt():
    return trace_model(load_model_file(ROOT / "examples" / "gpt.py", GPT_ARGS))


@pytest.fixture(scope="module")
def options():
    return SearchOptions(global_batch_size=32, dtype="fp16", workers=1, time_limit_s=5)


@pytest.fixture(scope="module")
def brute_force(gpt, options):
    """Every sub-cluster's plan and its joules per step (None if nothing fits)."""
    cluster = parse_cluster(CLUSTER)
    out = {}
    for uses in itertools.product(*(group_uses(g) for g in cluster.groups)):
        if any(u.nodes for u in uses):
            sub = subcluster(cluster, list(uses))
            try:
                plan = search(gpt, sub, options)
            except PlanningError:
                continue
            out[sub.spec] = (plan, step_energy(plan, sub)[0])
    return out


@pytest.mark.parametrize("quantile", [0.0, 0.5, 1.0])
def test_energy_objective_picks_the_brute_force_least(gpt, options, brute_force, quantile):
    """Targets at quantiles of the throughputs sub-clusters reach; the plan's joules are the least of those that meet it."""
    reached = sorted(p.predicted.throughput_samples_per_s for p, _ in brute_force.values())
    target = reached[round(quantile * (len(reached) - 1))]
    plan = least_energy_plan(gpt, parse_cluster(CLUSTER), options, Objective(kind="energy", min_throughput_samples_per_s=target))
    least = min(j for p, j in brute_force.values() if p.predicted.throughput_samples_per_s >= target)
    assert plan.predicted.throughput_samples_per_s >= target
    assert plan.predicted.energy_j_per_step == pytest.approx(least, rel=1e-9)
    assert plan.predicted.co2_g_per_step is None  # no zone gives its grid intensity


def test_step_energy_by_hand(gpt, options):
    """Each rank computes m (forward + backward) of its stage at power_w and waits the rest at the idle fraction;
    grams follow each zone's intensity."""
    cluster = cluster_from_dict({
        "zone": [{"name": "hydro", "carbon_g_per_kwh": 20.0}, {"name": "coal", "carbon_g_per_kwh": 800.0}],
        "link": [{"zones": ["hydro", "coal"], "gbps": 100, "latency_ms": 5}],
        "group": [{"nodes": 1, "devices_per_node": 2, "device": "A100-80GB", "zone": "hydro"},
                  {"nodes": 1, "devices_per_node": 2, "device": "V100-32GB", "zone": "coal"}],
    }, spec="two-grids.toml")
    plan = search(gpt, cluster, options)
    p = plan.predicted
    joules, grams = 0.0, 0.0
    for r, stage in enumerate(plan.stages[: plan.pipeline_parallel]):
        busy = plan.num_microbatches * (p.stage_fwd_s[r] + p.stage_bwd_s[r])
        for rank in (x for replica in stage.ranks for x in replica):
            watts = get_device(cluster.device_types()[rank]).power_w
            used = busy * watts + (p.step_time_s - busy) * IDLE_POWER_FRACTION * watts
            joules += used
            grams += used / JOULES_PER_KWH * (20.0 if rank < 2 else 800.0)
    assert step_energy(plan, cluster) == (pytest.approx(joules, rel=1e-12), pytest.approx(grams, rel=1e-12))


def test_energy_objective_needs_every_device_power(gpt, options):
    with pytest.raises(PlanningError, match="--objective energy: cpu has no power_w in its profile"):
        least_energy_plan(gpt, parse_cluster("1x2xcpu"), options, Objective(kind="energy"))


def test_cli_energy_objective_reports_joules_and_grams(tmp_path):
    cluster = tmp_path / "green.toml"
    cluster.write_text('[[zone]]\nname = "north"\ncarbon_g_per_kwh = 30\n\n'
                       '[[group]]\nnodes = 1\ndevices_per_node = 2\ndevice = "A100-80GB"\nzone = "north"\n')
    plan_path = tmp_path / "plan.json"
    result = hetpar("plan", str(ROOT / "examples" / "mlp.py"), "-c", str(cluster), "-b", "16", "--objective", "energy",
                    "-o", str(plan_path))
    assert result.returncode == 0, result.stderr
    predicted = json.loads(plan_path.read_text())["predicted"]
    assert predicted["co2_g_per_step"] == pytest.approx(predicted["energy_j_per_step"] / JOULES_PER_KWH * 30, rel=1e-12)
    assert f"energy: {predicted['energy_j_per_step']:.4g} J per step" in result.stderr
    refused = hetpar("plan", str(ROOT / "examples" / "mlp.py"), "-c", "1x2xcpu", "-b", "16", "--objective", "energy")
    assert_one_line_error(refused, "cpu has no power_w")
