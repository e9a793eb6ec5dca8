"""``--objective cost``: the cheapest plan that meets a throughput target, over sub-clusters.

The search (planner.search) finds the fastest plan on all of a cluster's devices. A
user who pays per device-hour may do better on fewer of them: fewer devices run each
step longer but cost less per second. ``cheapest_plan`` tries sub-clusters (some of
each node group's nodes, or a divisor of one node's devices) and returns the plan of
least dollars per step among those that reach the throughput target, each sub-cluster
planned by a black-box ``solve`` (the search, or planner.api's choice between the
search and heterogeneous data parallelism).

[Note: sub-cluster bound]
A plan's step on n_k devices of each type k takes at least T_lb seconds, the optimum
of the linear program

    minimise T  subject to  sum_k x[l, k] = 1 for every layer l,
                            B * sum_l c[l, k] * x[l, k] <= n_k * T for every type k,  x >= 0,

B the global batch and c[l, k] the fewest device-seconds one sample's forward and
backward of layer l take on a type-k device (over the tensor-parallel degrees the
search may use, tp devices busy for the layer's time at that degree, at micro-batch
size B, where launch overheads weigh least: a layer's time per sample never grows with
the micro-batch, [Note: layer time] in cost_models/compute.py). x[l, k] is the share of
layer l's work that type-k devices do: every sample's layers are done somewhere, and
the step lasts at least as long as the busiest device of each type works, which is at
least that type's average. Communication, bubbles and the optimizer step only add. So
a sub-cluster costs at least T_lb * (its $/hour) / 3600 per step and reaches at most
B / T_lb samples/s.
That bound is cheap but ignores bubbles, memory and links; a sub-cluster whose
turn comes gets a tighter one before it is searched: the least of the search's own
candidate bounds ([Note: candidate bound] in planner.search.bounds: bubble, cuts and gradient
all-reduce included), and, where heterogeneous data parallelism applies, T_lb plus the
cheapest gradient all-reduce any replica size can have (planner.strategies.hetero_dp.sync_floor_s),
since those replicas all-reduce after they all finish. Sub-clusters are taken in order
of their current bound (a best-first queue), and the loop stops when the least bound
left is no cheaper than the best plan found, so the plan returned is the cheapest of
all sub-clusters under the cost model, as a brute force over all of them finds.
A sub-cluster whose devices together hold less memory than the model's weights,
gradients and optimizer state and one sample's smallest activations is skipped without
a search.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping

from ortools.linear_solver import pywraplp

from hetpar.cost_models.cluster import Cluster
from hetpar.cost_models.compute import layer_timing
from hetpar.cost_models.energy import NoPowerError, device_energy_j, grams_co2, idle_power_w, power_w
from hetpar.cost_models.memory import stage_memory
from hetpar.planner.errors import PlanningError
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions, misfit_fix
from hetpar.planner.plan import ParallelPlan
from hetpar.planner.search import enumerate_candidates, lower_bound_s, memory_may_fit, search
from hetpar.planner.solver import divisors
from hetpar.planner.strategies.hetero_dp import sync_floor_s
from hetpar.planner.strategies.subcluster import GroupUse, group_uses, subcluster
from hetpar.vocabulary import ObjectiveKind, Recompute, Switch

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, kw_only=True)
class Objective:
    """What a plan minimises: step time on all devices ("time"), dollars per step ("cost") or
    joules per step ("energy") over sub-clusters; each subject to ``min_throughput_samples_per_s``."""

    kind: str = ObjectiveKind.TIME
    usd_per_device_hour: dict[str, float] = field(default_factory=dict)  # device type -> price of one device-hour (--price)
    min_throughput_samples_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in tuple(ObjectiveKind):
            raise PlanningError(f"unknown objective {self.kind!r}; use one of {', '.join(ObjectiveKind)}")
        if not self.min_throughput_samples_per_s >= 0:
            raise PlanningError(f"--min-throughput must be >= 0 samples/s, got {self.min_throughput_samples_per_s}")


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    """A sub-cluster, and what its plans cost at least: ``step * per_s + fixed`` for any step of at least ``step_lb_s``."""

    cluster: Cluster
    per_s: float  # dollars per second (cost), or watts its devices draw waiting (energy)
    step_lb_s: float
    fixed: float = 0.0  # energy: the fewest joules above idle its devices compute for ([Note: energy bound])

    @property
    def cost_lb(self) -> float:
        return self.step_lb_s * self.per_s + self.fixed


def resolve_prices(cluster: Cluster, given: Mapping[str, float]) -> dict[str, float]:
    """The $/device-hour of each of the cluster's device types: ``given`` (--price), else the cluster file's.

    Raises:
        PlanningError: a price for a type the cluster lacks, a negative price, a type with
            two prices in the cluster file, or a type with no price at all.
    """
    types = list(cluster.count_by_type())
    by_lower = {t.lower(): t for t in types}
    prices: dict[str, float] = {}
    for name, usd in given.items():
        if name.strip().lower() not in by_lower:
            raise PlanningError(f"--price names {name!r}, which is not in the cluster ({', '.join(types)})")
        if not usd >= 0:
            raise PlanningError(f"--price {name}={usd}: a price must be a number >= 0 (US dollars per device-hour)")
        prices[by_lower[name.strip().lower()]] = float(usd)
    for g in cluster.groups:
        t = g.device.name
        if t in given or t in prices or g.usd_per_device_hour is None:
            continue
        other = next((h.usd_per_device_hour for h in cluster.groups if h.device.name == t and h.usd_per_device_hour is not None
                      and h.usd_per_device_hour != g.usd_per_device_hour), None)
        if other is not None:
            raise PlanningError(f"the cluster file gives {t} two prices ({g.usd_per_device_hour} and {other} $/device-hour); "
                                f"give one with --price {t}=USD")
        prices[t] = g.usd_per_device_hour
    missing = [t for t in types if t not in prices]
    if missing:
        raise PlanningError(
            f"--objective cost needs a price for {', '.join(missing)}: pass --price {missing[0]}=USD_PER_DEVICE_HOUR "
            "or set usd_per_device_hour in the cluster file (docs/cluster-format.md)"
        )
    return prices


def usd_per_step(plan: ParallelPlan, prices: Mapping[str, float]) -> float:
    """Dollars one step of ``plan`` costs: its step time times its devices' price per second."""
    return plan.predicted.step_time_s * sum(prices[t] for t in plan.cluster.device_types) / SECONDS_PER_HOUR


def cheapest_plan(
    model: ModelGraph,
    cluster: Cluster,
    options: SearchOptions,
    objective: Objective,
    *,
    solve: Callable[[ModelGraph, Cluster, SearchOptions], ParallelPlan] = search,
    hetero_dp: str = Switch.OFF,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """The plan of least dollars per step, over sub-clusters of ``cluster``, that meets the throughput target.

    See [Note: sub-cluster bound]. The plan's cluster is the sub-cluster it runs on; its
    ``alternatives`` gain the next cheapest sub-clusters tried.

    Args:
        solve: plans one sub-cluster (raises PlanningError when nothing fits).
        hetero_dp: whether ``solve`` returns heterogeneous data-parallel plans ("auto",
            "on") or only the search's ("off"); the bounds must hold for what it returns.
        progress: called as (done, total, description) while sub-clusters are planned.

    Raises:
        PlanningError: a device type has no price, or no sub-cluster reaches the target
            (the message brackets the best throughput reachable: [Note: unreachable target]).
    """
    start = time.perf_counter()
    prices = resolve_prices(cluster, objective.usd_per_device_hour)
    candidates = _candidates(model, cluster, options, lambda counts: sum(n * prices[t] for t, n in counts.items()) / SECONDS_PER_HOUR)
    best, tried = _least_over_subclusters(model, cluster, options, objective.min_throughput_samples_per_s, candidates,
                                          lambda plan, cand: plan.predicted.step_time_s * cand.per_s, solve, hetero_dp, progress)
    return _with_runners_up(best, tried, {"usd_per_step": lambda p: usd_per_step(p, prices)}, options, time.perf_counter() - start)


def least_energy_plan(
    model: ModelGraph,
    cluster: Cluster,
    options: SearchOptions,
    objective: Objective,
    *,
    solve: Callable[[ModelGraph, Cluster, SearchOptions], ParallelPlan] = search,
    hetero_dp: str = Switch.OFF,
    progress: Callable[[int, int, str], None] | None = None,
) -> ParallelPlan:
    """The plan of fewest joules per step, over sub-clusters of ``cluster``, that meets the throughput target.

    Each sub-cluster's plan is the fastest ``solve`` finds there, priced by [Note: energy
    model] (cost_models/energy.py); sub-clusters are pruned as for the cost objective, by
    [Note: energy bound]. The plan's ``predicted`` carries its joules (and grams of CO2
    where every zone it uses gives carbon_g_per_kwh); devices a plan leaves out are not
    counted (off, or another job's).

    Raises:
        PlanningError: a device type has no power draw in its profile, or no sub-cluster reaches the target.
    """
    start = time.perf_counter()
    try:
        idle = {k: idle_power_w(cluster.profile(k)) for k in cluster.count_by_type()}
        above = {k: power_w(cluster.profile(k)) - idle[k] for k in idle}
    except NoPowerError as exc:
        raise PlanningError(f"--objective energy: {exc}") from None
    work = _layer_work_s(model, cluster, options)
    batch = options.global_batch_size

    def busy_j(counts: dict[str, int]) -> float:  # [Note: energy bound]
        return batch * sum(min(work[k][l] * above[k] if above[k] else 0.0 for k in counts) for l in range(len(model.layers)))

    candidates = _candidates(model, cluster, options, lambda counts: sum(n * idle[k] for k, n in counts.items()), busy_j)
    best, tried = _least_over_subclusters(model, cluster, options, objective.min_throughput_samples_per_s, candidates,
                                          lambda plan, cand: step_energy(plan, cand.cluster)[0], solve, hetero_dp, progress)
    by_spec = {c.cluster.spec: c.cluster for c in candidates}
    tried = {spec: (None if p is None else with_energy(p, by_spec[spec])) for spec, p in tried.items()}
    best = tried[best.cluster.spec]
    return _with_runners_up(best, tried, {"energy_j_per_step": lambda p: p.predicted.energy_j_per_step}, options,
                            time.perf_counter() - start)


# [Note: energy bound]
# A plan on a sub-cluster of step T draws at least T * (the idle watts of its devices)
# plus, for the work its devices compute, (power_w - idle_power_w) of their type times
# the seconds they compute. Every sample's layers are computed somewhere, and a layer l
# takes at least c[l, k] device-seconds per sample on type k ([Note: sub-cluster bound]),
# so the computing adds at least B * sum_l min_k c[l, k] (power_w - idle_power_w)[k]
# over the sub-cluster's types. With T >= the sub-cluster's step bound, the sum is a lower
# bound on the joules of any plan there, of the form step * per_s + fixed that the
# best-first loop of [Note: sub-cluster bound] orders and prunes by.
def step_energy(plan: ParallelPlan, cluster: Cluster) -> tuple[float, float | None]:
    """(joules, grams of CO2 or None) one step of ``plan`` on ``cluster`` draws; see [Note: energy model].

    A pipeline rank computes m * (its micro-batch's forward + backward) of the step
    (``predicted.stage_fwd_s``, ``stage_bwd_s``) and waits the rest; a plan without
    per-stage times (heterogeneous data parallelism) is counted as computing all step long.

    Raises:
        NoPowerError: a device of the plan has no power draw in its profile.
    """
    p = plan.predicted
    step = p.step_time_s
    busy = {}
    if p.stage_fwd_s:
        for r, stage in enumerate(plan.stages[: plan.pipeline_parallel]):
            for rank in (x for replica in stage.ranks for x in replica):
                busy[rank] = plan.num_microbatches * (p.stage_fwd_s[r] + p.stage_bwd_s[r])
    joules, grams = 0.0, 0.0
    for rank in range(cluster.world_size):
        used = device_energy_j(cluster.group_of(rank).device, step, busy.get(rank, step))
        joules += used
        carbon = cluster.carbon_g_per_kwh(cluster.zone_of(rank))
        grams = None if grams is None or carbon is None else grams + grams_co2(used, carbon)
    return joules, grams


def with_energy(plan: ParallelPlan, cluster: Cluster) -> ParallelPlan:
    """``plan`` with its joules (and grams) per step on ``cluster`` in ``predicted``."""
    joules, grams = step_energy(plan, cluster)
    return replace(plan, predicted=replace(plan.predicted, energy_j_per_step=joules, co2_g_per_step=grams))


def _least_over_subclusters(model: ModelGraph, cluster: Cluster, options: SearchOptions, target: float, candidates: list[_Candidate],
                            value: Callable[[ParallelPlan, _Candidate], float], solve, hetero_dp: str,
                            progress: Callable[[int, int, str], None] | None) -> tuple[ParallelPlan, dict]:
    """The plan of least ``value`` among the sub-clusters' plans that reach ``target``, and every plan solved;
    see [Note: sub-cluster bound]."""
    # (cost bound, tight?, index): a sub-cluster is solved once its tight bound is the least bound left.
    queue = [(c.cost_lb, False, i) for i, c in enumerate(candidates)]
    heapq.heapify(queue)
    tried: dict[str, ParallelPlan | None] = {}
    best: tuple[float, ParallelPlan] | None = None
    while queue and (best is None or queue[0][0] < best[0]):  # [Note: sub-cluster bound]
        _, tight, i = heapq.heappop(queue)
        cand = candidates[i]
        if progress:
            progress(len(tried), len(candidates), f"sub-cluster {cand.cluster.spec}")
        if not tight:
            if options.global_batch_size / cand.step_lb_s < target:
                continue  # cannot reach the target whatever the plan
            step_lb = max(cand.step_lb_s, _plan_bound_s(model, cand, options, hetero_dp))
            if options.global_batch_size / step_lb >= target:
                heapq.heappush(queue, (step_lb * cand.per_s + cand.fixed, True, i))
            continue
        plan = _solve(model, cand.cluster, options, solve, tried)
        if plan is not None and plan.predicted.throughput_samples_per_s >= target:
            cost = value(plan, cand)
            if best is None or cost < best[0]:
                best = (cost, plan)
    if progress:
        progress(len(candidates), len(candidates), "done")
    if best is None:
        raise PlanningError(_unreachable(model, cluster, options, candidates, solve, tried, target, hetero_dp))
    return best[1], tried


def _candidates(model: ModelGraph, cluster: Cluster, options: SearchOptions, per_s: Callable[[dict[str, int]], float],
                fixed: Callable[[dict[str, int]], float] = lambda counts: 0.0) -> list[_Candidate]:
    """Every sub-cluster that could hold the model, with its objective's rate and [Note: sub-cluster bound].

    Args:
        per_s: devices by type -> what a second of its step costs.
        fixed: devices by type -> what its plans cost whatever the step.
    """
    work = _layer_work_s(model, cluster, options)
    need = _least_memory_bytes(model, options)
    out = []
    for uses in itertools.product(*(group_uses(g) for g in cluster.groups)):
        if not any(u.nodes for u in uses):
            continue
        counts = _devices_by_type(cluster, uses)
        memory = sum(u.devices * g.device.memory_bytes for g, u in zip(cluster.groups, uses))
        step_lb = _step_bound_s(work, counts, options.global_batch_size)
        if memory < need or math.isinf(step_lb):
            continue
        out.append(_Candidate(cluster=subcluster(cluster, list(uses)), per_s=per_s(counts), step_lb_s=step_lb,
                              fixed=fixed(counts)))
    return out


def _devices_by_type(cluster: Cluster, uses: tuple[GroupUse, ...]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for g, u in zip(cluster.groups, uses):
        if u.nodes:
            counts[g.device.name] = counts.get(g.device.name, 0) + u.devices
    return counts


def _layer_work_s(model: ModelGraph, cluster: Cluster, options: SearchOptions) -> dict[str, list[float]]:
    """c[k][l]: the fewest device-seconds one sample of layer l takes on type k; see [Note: sub-cluster bound]."""
    batch = options.global_batch_size
    widths = {g.devices_per_node for g in cluster.groups}
    tps = [t for t in divisors(max(widths)) if t <= options.max_tp and (options.tp is None or t == options.tp)] or [1]
    work: dict[str, list[float]] = {}
    for k in cluster.count_by_type():
        device = cluster.profile(k)
        work[k] = [min(_device_seconds(layer, device, tp, batch, options.dtype) for tp in tps) / batch for layer in model.layers]
    return work


def _device_seconds(layer, device, tp: int, batch: int, dtype: str) -> float:
    try:
        timing = layer_timing(layer, device, tp=tp, micro_batch_size=batch, dtype=dtype)
    except (KeyError, ValueError):
        return math.inf
    return tp * (timing.fwd_s + timing.bwd_s)


def _step_bound_s(work: dict[str, list[float]], counts: dict[str, int], batch: int) -> float:
    """T_lb of [Note: sub-cluster bound] for ``counts`` devices of each type: a linear program."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    layers = range(len(next(iter(work.values()))))
    # Variables
    # share[l, k] is the fraction of layer l's work that type-k devices do
    share = {(l, k): solver.NumVar(0.0, 1.0, f"share_{l}_{k}") for l in layers for k in counts if not math.isinf(work[k][l])}
    step = solver.NumVar(0.0, solver.infinity(), "step")
    # Constraints
    for l in layers:
        if not any((l, k) in share for k in counts):
            return math.inf
        solver.Add(sum(share[l, k] for k in counts if (l, k) in share) == 1)
    for k, n in counts.items():
        solver.Add(batch * sum(work[k][l] * share[l, k] for l in layers if (l, k) in share) <= n * step)
    # Objective
    solver.Minimize(step)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return math.inf
    return step.solution_value() * (1 - 1e-9)  # the LP's own rounding never makes the bound exceed the optimum


def _least_memory_bytes(model: ModelGraph, options: SearchOptions) -> float:
    """The fewest bytes all devices together hold for any plan: weights, gradients, optimizer state, and
    one sample's activations under full recompute."""
    return sum(stage_memory([layer], tp=1, micro_batch_size=1, in_flight=1, dtype=options.dtype, optimizer=options.optimizer,
                            recompute=Recompute.FULL).total_bytes for layer in model.layers)


def _plan_bound_s(model: ModelGraph, cand: _Candidate, options: SearchOptions, hetero_dp: str) -> float:
    """A lower bound on the step of any plan ``solve`` may return on the sub-cluster; see [Note: sub-cluster bound]."""
    searched = math.inf if hetero_dp == Switch.ON else _search_bound_s(model, cand.cluster, options)
    if hetero_dp == Switch.OFF or len(cand.cluster.count_by_type()) < 2:
        return searched
    sync_s = sync_floor_s(model, cand.cluster, options)
    return min(searched, cand.step_lb_s + sync_s) if sync_s is not None else searched


def _search_bound_s(model: ModelGraph, cluster: Cluster, options: SearchOptions) -> float:
    """The least of the search's candidate bounds ([Note: candidate bound] in planner.search.bounds)."""
    try:
        cands = enumerate_candidates(model, cluster, options)
    except PlanningError:
        return math.inf
    cache: dict = {}
    return min((lower_bound_s(model, cluster, c, options.dtype, cache, options.optimizer, options.stage_devices) for c in cands
                if memory_may_fit(model, cluster, c, options)), default=math.inf)


def _solve(model, cluster: Cluster, options, solve, tried: dict) -> ParallelPlan | None:
    if cluster.spec not in tried:
        try:
            tried[cluster.spec] = solve(model, cluster, options)
        except PlanningError:
            tried[cluster.spec] = None
    return tried[cluster.spec]


def _unreachable(model, cluster: Cluster, options: SearchOptions, candidates: list[_Candidate], solve, tried: dict, target: float,
                 hetero_dp: str) -> str:
    """Why no sub-cluster meets the target: the fastest plan found and the throughput no sub-cluster can pass
    ([Note: unreachable target]); where none has a plan at all, why the whole cluster has none (the pins, the
    batch, the dtype, memory)."""
    ranked = _by_ceiling(model, candidates, options, hetero_dp)
    found = [p for p in tried.values() if p is not None]
    rest = [c for c in sorted(candidates, key=lambda c: c.step_lb_s) if all(c is not r for _, r in ranked)]
    for cand in [] if found else [c for _, c in ranked] + rest:
        plan = _solve(model, cand.cluster, options, solve, tried)
        if plan is not None:
            found.append(plan)
            break
    if not found:
        try:
            solve(model, cluster, options)
        except PlanningError as exc:
            raise PlanningError(f"no sub-cluster of {cluster.spec} has a plan; on all of it: {exc}") from None
        raise PlanningError(f"no sub-cluster of the cluster fits the model; {misfit_fix(options.dtype)}")
    best = max(found, key=lambda p: p.predicted.throughput_samples_per_s)
    reached = best.predicted.throughput_samples_per_s
    ceiling = max(reached, ranked[0][0] if ranked else 0.0)  # the sub-clusters not ranked have loose bounds below ranked[0]'s
    return (f"no sub-cluster reaches --min-throughput {target:g} samples/s: the fastest plan found reaches {reached:.4g} samples/s "
            f"(on {best.cluster.spec}) and by the cost model's bounds none passes {ceiling:.4g}; add devices or lower the target")


# [Note: unreachable target]
# When no sub-cluster meets the throughput target, the error brackets what the cluster
# can do: the fastest plan found (the best of the sub-clusters the objective search
# solved, else the plan of the sub-cluster whose bound is highest, solved now) and the
# highest throughput bound of any sub-cluster, gbs / T of [Note: sub-cluster bound],
# tightened by the search's candidate bounds. Finding the exact best would mean
# searching every sub-cluster whose bound passes the best plan found, and at small
# batches the bounds are loose (bubbles dominate): on a 35-device, three-type cluster
# with the 1.3B GPT at batch 4 all 40 sub-clusters pass it, each a whole search,
# for an error message (the fuzzer's case; benchmarks/fuzz.py).
def _by_ceiling(model, candidates: list[_Candidate], options: SearchOptions, hetero_dp: str) -> list[tuple[float, _Candidate]]:
    """(throughput bound, sub-cluster), highest first, for the sub-clusters whose loose bound could pass the highest
    tight one: tight bounds are computed in order of the loose ones until none left can pass."""
    gbs = options.global_batch_size
    out: list[tuple[float, _Candidate]] = []
    for cand in sorted(candidates, key=lambda c: c.step_lb_s):
        if out and gbs / cand.step_lb_s <= max(b for b, _ in out):
            break
        out.append((gbs / max(cand.step_lb_s, _plan_bound_s(model, cand, options, hetero_dp)), cand))
    return sorted(out, key=lambda x: -x[0])


def _with_runners_up(plan: ParallelPlan, tried: dict, measure: dict[str, Callable[[ParallelPlan], float]], options: SearchOptions,
                     wall_s: float) -> ParallelPlan:
    """``plan`` with the next best sub-clusters tried among its alternatives (``measure``: the objective's name in
    them -> its value) and the whole objective search's wall time."""
    (name, value), = measure.items()
    others = sorted((p for p in tried.values() if p is not None and p is not plan), key=value)
    extra = [
        {"cluster": p.cluster.spec, "step_time_s": p.predicted.step_time_s,
         "throughput_samples_per_s": p.predicted.throughput_samples_per_s, name: value(p)}
        for p in others[: options.top_k]
    ]
    return replace(plan, alternatives=list(plan.alternatives) + extra,
                   solver=replace(plan.solver, search_time_s=round(wall_s, 3)))


__all__ = ["Objective", "cheapest_plan", "least_energy_plan", "resolve_prices", "step_energy", "usd_per_step",
           "with_energy", "SECONDS_PER_HOUR"]
