"""Heterogeneous data parallelism: replicas of one stage layout on different device types.

On a mixed cluster the search (planner.search) pipelines across device types: each
stage's replicas share one type. The other way to use such a cluster is to give every
data-parallel replica devices of a single type and let the faster replicas take more
samples (``ParallelPlan.replica_batch_shares``), which the runtime executes with a
weighted gradient average (runtime.shard.loss_weight). ``hetero_dp_plan`` builds the
best such plan; planner.api keeps whichever of the two is faster.

[Note: heterogeneous data parallelism]
A plan's replicas share everything but their ranks and their micro-batch size: the
layers per stage, the tensor- and pipeline-parallel degrees, the schedule, recompute
and the number of micro-batches m. So:

1. Replica size R (devices per replica) divides every node group's devices, and a
   replica fills whole nodes or a divisor of one (so its tensor-parallel groups stay in
   a node, as the search keeps them). Group g then hosts n_g = devices_g / R replicas
   of its device type, ranks in cluster order; dp = world / R.
2. The stage layout of a replica of size R comes from the search itself, run on one
   replica of each device type (dp pinned to 1) with that replica's share of the batch
   at the device's achievable matmul rate: the fast type's best layout and the slow
   type's best layout are both tried.
3. For a layout and m, replica d with micro-batch size b_d runs its pipeline in
   T_g(b_d) seconds, predicted by planner.estimate on the replica's own devices (the
   schedule simulated action by action, memory checked). Shares minimise
   max_d T(b_d) subject to sum_d b_d = global batch / m, b_d >= 1 (``balance_shares``;
   T is non-decreasing in b, so this is a bisection on the time). The plan's global
   batch is m times the shares' sum (its micro_batch_size their mean, rounded down),
   so any dp <= global batch / m will do. An m is
   not balanced when its step cannot beat the best found so far, of any layout: every
   replica takes at least one sample and some replica at least the mean share, so the
   step is at least max_g T_g(1) and min_g T_g(mean); nor when no shares bring the
   slowest replica under the best step less the sync (the balance's first test, at that
   limit). Each class's largest size within a time limit is searched from the size it
   took at the last limit ([Note: galloping caps]). The balancing estimates without
   the transfer breakdown (the same step time, one simulation instead of two) and
   keeps each class's collective times across its estimates; the chosen shares are
   estimated in full (a test holds the result equal to balancing every m in full).
4. Step time: the slowest replica's pipeline, then the gradient all-reduce of each
   stage over its replicas (the group spans device types, so it runs at the slowest
   link; cost_models.collectives; times the largest ``grad_sync_scale`` of the types
   taking part, as planner.estimate charges a measured profile's sync inside a step),
   then the slowest replica's optimizer step. The
   all-reduce moves the same bytes whatever the shares, so the shares minimise the
   first term alone.
5. Node groups may run their replicas at different tensor-parallel degrees (replica
   sizes tp_g * pp; [Note: replicas of different degrees] in runtime/mixed_sync.py):
   after the layouts of one replica size, each layout tried is tried again with the
   groups' degrees that train the most samples per second over all devices at the best
   plan's m and mean share (each group's replica estimated at each degree that fits;
   ``_mixed_layouts``), among the combinations whose degrees differ and whose replica
   count is 2 to global batch / m (and meets a --dp pin). Where no one replica size
   tiles every group, the layouts come from searching one replica of each group at
   each size that tiles it, at its own m and micro-batch size (``_group_layouts``). A
   stage's gradients are then synced whole (step 4 prices an all-gather and a
   broadcast inside each replica and the all-reduce of the whole stage over the
   replicas' first ranks), and its sharding is its layers' (``stage_sharding``, as
   the search assembles a plan). This is a choice of degrees, not a search over every
   combination.

``StagePlan.device_type`` of such a plan is the type of the stage's first replica; the
type of every rank is in ``plan.cluster.device_types``.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from hetpar.cost_models.cluster import Cluster
from hetpar.cost_models.collectives import all_gather_time_s, all_reduce_time_s, broadcast_time_s, grad_sync_scale
from hetpar.cost_models.grad_sync import collective_over, sync_seconds
from hetpar.cost_models.compute import dtype_bytes
from hetpar.cost_models.devices import ProfileError
from hetpar.cost_models.layers import tp_misfit
from hetpar.planner.errors import PlanningError
from hetpar.planner.estimate import Estimate, EstimateConfig, EstimateError, estimate, stage_split
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions
from hetpar.planner.plan import ClusterRef, ModelRef, ParallelPlan, Predicted, SolverInfo, StagePlan
from hetpar.planner.search import search, stage_sharding
from hetpar.planner.solver import divisors
from hetpar.planner.strategies.subcluster import shorthand
from hetpar.vocabulary import Schedule

# Bisection on the slowest replica's time stops within this relative width; T takes
# discrete values, so the shares found are those of the optimum unless two share
# vectors' times lie closer than this.
_TIME_TOLERANCE = 1e-12


@dataclass(frozen=True, kw_only=True)
class ReplicaClass:
    """The replicas one node group hosts: ``count`` replicas of ``replica_cluster``'s devices."""

    group: int  # index in the cluster's groups
    device_type: str
    first_rank: int  # global rank of the first device of the first replica
    count: int
    replica_cluster: Cluster  # one replica's devices, as a cluster of their own


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What every replica of a heterogeneous data-parallel plan shares, and each node group's tensor-parallel
    degree (one for all, or [Note: replicas of different degrees])."""

    tps: tuple[int, ...]  # tensor-parallel degree of the replicas of each node group, in group order
    pp: int
    stage_layers: tuple[int, ...]
    schedule: str
    stage_recompute: tuple[str, ...]  # per stage
    tp_sharding: tuple[dict, ...]  # per stage, from the search's plan
    tp_parts: tuple[dict, ...] = ()  # per stage, from the search's plan (none: no fused projection split)

    @property
    def mixed(self) -> bool:
        """Whether the node groups' replicas differ in tensor-parallel degree."""
        return len(set(self.tps)) > 1

    def sizes(self) -> tuple[int, ...]:
        """Devices per replica of each node group: tp * pp."""
        return tuple(t * self.pp for t in self.tps)


@dataclass(frozen=True, kw_only=True)
class _Choice:
    layout: Layout
    num_microbatches: int
    shares: list[int]  # micro-batch size of each replica
    runs: dict[tuple[int, int], Estimate]  # (class index, micro-batch size) -> the replica's estimate
    classes: list[int]  # class index of each replica
    predicted: Predicted


def replica_classes(cluster: Cluster, size: int | Sequence[int]) -> list[ReplicaClass] | None:
    """The replicas of ``size`` devices (one size, or one per node group) each group hosts; None when a size
    does not tile its group.

    See [Note: heterogeneous data parallelism], step 1.
    """
    sizes = [size] * len(cluster.groups) if isinstance(size, int) else list(size)
    if not all(_tiles(g, size) for g, size in zip(cluster.groups, sizes, strict=True)):
        return None
    return [_class_of_group(cluster, index, size) for index, size in enumerate(sizes)]


def _tiles(g, size: int) -> bool:
    """Whether replicas of ``size`` devices tile node group ``g``, each filling whole nodes or a divisor of one."""
    return not (g.num_devices % size or (g.devices_per_node % size and size % g.devices_per_node))


def replica_sizes(cluster: Cluster, options: SearchOptions) -> list[int]:
    """Replica sizes R that tile every group, give 2 <= dp = world / R <= the global batch, and meet a --dp pin."""
    world = cluster.world_size
    out = []
    for size in divisors(world):
        dp = world // size
        if dp < 2 or options.global_batch_size < dp or (options.dp is not None and options.dp != dp):
            continue
        if replica_classes(cluster, size) is not None:
            out.append(size)
    return out


def sync_floor_s(model: ModelGraph, cluster: Cluster, options: SearchOptions) -> float | None:
    """The least time the gradient all-reduce across replicas takes in any heterogeneous data-parallel
    plan on ``cluster``; None when no such plan exists.

    With replicas of R devices some rank holds at least 1/R of the gradients (tensor
    parallelism splits no parameter into more parts than its degree), all-reduced over
    one rank of each replica.
    """
    if len(cluster.count_by_type()) < 2:
        return None
    if not options.sync.plain:
        return 0.0  # compression, robust rules, local SGD: priced per plan, no floor kept here
    grad_bytes = sum(l.params_at(1) for l in model.layers) * dtype_bytes(options.dtype)
    floors = []
    for size in replica_sizes(cluster, options):
        firsts = [c.first_rank + i * size for c in replica_classes(cluster, size) for i in range(c.count)]
        floors.append(all_reduce_time_s(grad_bytes / size, firsts, cluster))
    least_scale = min(grad_sync_scale(g.device) for g in cluster.groups)  # a floor: the least any replica pays
    return min(floors) * least_scale if floors else None


def balance_shares(time_s: Callable[[int, int], float], classes: list[int], total: int,
                   below_s: float = math.inf) -> list[int] | None:
    """Micro-batch sizes b_d >= 1 summing to ``total`` that minimise max_d time_s(classes[d], b_d).

    Args:
        time_s: (class, micro-batch size) -> seconds; non-decreasing in the size, ``inf``
            where it does not fit.
        classes: the class of each replica.
        total: samples per micro-batch step over all replicas.
        below_s: only shares whose slowest replica takes at most this long are of interest.

    Returns:
        One size per replica, or None when no sizes fit (within ``below_s``).
    """
    kinds = sorted(set(classes))
    count = {k: classes.count(k) for k in kinds}
    most = total - len(classes) + 1  # one replica takes at most this many, the others one each
    if most < 1:
        return None
    # [Note: galloping caps]: each class's largest size within a time limit is searched from the size
    # the last limit gave it, its replicas' equal share at first; the time is non-decreasing in the size,
    # so the answer is the same as a bisection over [0, most] and the sizes estimated lie near it
    near = {k: max(1, min(most, total // len(classes))) for k in kinds}

    def fits(k: int, b: int, limit_s: float) -> bool:
        t = time_s(k, b)
        return t <= limit_s and not math.isinf(t)

    def cap(k: int, limit_s: float) -> int:
        """The largest size one replica of class k runs within ``limit_s`` (0 if none)."""
        b = near[k]
        if fits(k, b, limit_s):
            lo, step = b, 1  # lo fits: gallop up until a size does not
            while lo < most:
                up = min(most, lo + step)
                if not fits(k, up, limit_s):
                    hi = up - 1
                    break
                lo, step = up, 2 * step
            else:
                hi = lo
        else:
            hi, step = b - 1, 1  # hi + 1 does not fit: gallop down until a size does
            lo = 0
            while hi > 0:
                down = max(1, hi + 1 - step)
                if fits(k, down, limit_s):
                    lo = down
                    break
                hi, step = down - 1, 2 * step
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(k, mid, limit_s) else (lo, mid - 1)
        near[k] = max(1, lo)
        return lo

    def enough(limit_s: float) -> bool:
        caps = {k: cap(k, limit_s) for k in kinds}
        return all(caps.values()) and sum(count[k] * caps[k] for k in kinds) >= total

    if not enough(below_s):
        return None
    lo = max(time_s(k, 1) for k in kinds)
    hi = min(below_s, max(time_s(k, max(1, cap(k, math.inf))) for k in kinds))
    if enough(lo):
        hi = lo
    while hi - lo > _TIME_TOLERANCE * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    shares = [cap(k, hi) for k in classes]
    for _ in range(sum(shares) - total):  # trim the excess from the slowest replicas
        d = max((d for d in range(len(shares)) if shares[d] > 1), key=lambda d: time_s(classes[d], shares[d]))
        shares[d] -= 1
    return shares


def hetero_dp_plan(model: ModelGraph, cluster: Cluster, options: SearchOptions) -> ParallelPlan:
    """The fastest plan whose data-parallel replicas each run on one device type; see
    [Note: heterogeneous data parallelism].

    Raises:
        PlanningError: the cluster has one device type, the pins rule heterogeneous data
            parallelism out, no replica size tiles the cluster, or nothing fits; says why.
    """
    if len(cluster.count_by_type()) < 2:
        raise PlanningError("heterogeneous data parallelism needs at least two device types in the cluster")
    if options.micro_batch_size is not None or options.stage_devices is not None:
        raise PlanningError("heterogeneous data parallelism chooses each replica's micro-batch size and device type; "
                            "drop --micro-batch-size and --stage-devices")
    if options.zero or (options.virtual_stages or 1) > 1:
        raise PlanningError("heterogeneous data parallelism runs ZeRO 0 and one model chunk per pipeline rank; "
                            "drop --zero and --virtual-stages")
    sizes = replica_sizes(cluster, options)
    mixing = options.tp is None and options.sync.plain  # step 5 of the Note
    if not sizes and not mixing:
        raise PlanningError(
            f"heterogeneous data parallelism: no replica size tiles every node group of {cluster.spec} with "
            f"dp at most --global-batch {options.global_batch_size}" + (f" and dp = {options.dp}" if options.dp else "")
        )
    start = time.perf_counter()
    best: _Choice | None = None
    layouts = 0
    tried: list[Layout] = []
    for size in sizes:
        classes = replica_classes(cluster, size)
        for layout in _layouts(model, cluster, classes, options):
            layouts += 1
            tried.append(layout)
            choice = _best_choice(model, cluster, classes, layout, options, best.predicted.step_time_s if best else math.inf)
            if choice is not None and (best is None or choice.predicted.step_time_s < best.predicted.step_time_s):
                best = choice
    # step 5: at the best plan's m and mean share, or, where no replica size tiles every group, at each group's own
    # replica layouts' (searched here)
    bases = [(layout, best.num_microbatches, max(1, round(sum(best.shares) / len(best.shares)))) for layout in tried] \
        if best is not None else _group_layouts(model, cluster, options) if mixing else []
    for layout in _mixed_layouts(model, cluster, bases, options) if mixing else ():
        layouts += 1
        choice = _best_choice(model, cluster, replica_classes(cluster, layout.sizes()), layout, options,
                              best.predicted.step_time_s if best else math.inf)
        if choice is not None and (best is None or choice.predicted.step_time_s < best.predicted.step_time_s):
            best = choice
    if best is None:
        raise PlanningError(f"heterogeneous data parallelism: no replica layout fits on every device type of {cluster.spec}")
    info = SolverInfo(status="heuristic", search_time_s=round(time.perf_counter() - start, 3), candidates=layouts,
                      objective_s=best.predicted.step_time_s)
    return _assemble(model, cluster, options, best, info)


def _layouts(model: ModelGraph, cluster: Cluster, classes: list[ReplicaClass], options: SearchOptions) -> list[Layout]:
    """The best layout of one replica of each device type at its share of the batch; step 2 of the Note."""
    speed = [c.replica_cluster.world_size * cluster.profile(c.device_type).achievable_matmul_flops(options.dtype) for c in classes]
    total_speed = sum(s * c.count for s, c in zip(speed, classes))
    out: dict[tuple, Layout] = {}
    for k in {c.device_type: i for i, c in reversed(list(enumerate(classes)))}.values():
        batch = max(1, round(options.global_batch_size * speed[k] / total_speed))
        try:
            plan = search(model, classes[k].replica_cluster, _replica_options(options, batch))
        except PlanningError:
            continue
        if plan.virtual_stages != 1 or plan.replica_batch_shares is not None or len({s.tensor_parallel for s in plan.stages}) > 1:
            continue  # a replica has one degree on every stage (Layout.tps)
        layout = Layout(tps=(plan.stages[0].tensor_parallel,) * len(cluster.groups), pp=plan.pipeline_parallel,
                        stage_layers=tuple(len(s.layers) for s in plan.stages), schedule=plan.schedule.value,
                        stage_recompute=tuple(s.recompute for s in plan.stages),
                        tp_sharding=tuple(dict(s.tp_sharding) for s in plan.stages),
                        tp_parts=tuple(dict(s.tp_parts) for s in plan.stages))
        out.setdefault((layout.tps, layout.pp, layout.stage_layers, layout.schedule, layout.stage_recompute), layout)
    return list(out.values())


def _mixed_layouts(model: ModelGraph, cluster: Cluster, bases: list[tuple[Layout, int, int]], options: SearchOptions
                   ) -> list[Layout]:
    """Layouts whose node groups run their replicas at different tensor-parallel degrees ([Note: replicas of
    different degrees] in runtime/mixed_sync.py): for each base layout with its number of micro-batches m and
    micro-batch size b, the groups' degrees (each one that fits there) that train the most samples per second
    over all devices, where the groups' degrees differ and the replicas number 2 to global batch / m (and meet
    a --dp pin). Step 5 of [Note: heterogeneous data parallelism]."""
    out: dict[tuple, Layout] = {}
    for base, m, b in bases:
        rates = [_degree_rates(model, cluster, g, base, options, b, m) for g in range(len(cluster.groups))]

        def allowed(tps: tuple[int, ...]) -> bool:
            dp = sum(g.num_devices // (t * base.pp) for g, t in zip(cluster.groups, tps))
            return len(set(tps)) > 1 and 2 <= dp <= options.global_batch_size // m and options.dp in (None, dp)

        combos = [tps for tps in itertools.product(*(sorted(r) for r in rates)) if allowed(tps)]
        if not combos:
            continue
        # the most samples per second over all devices; ties to the lower degrees
        tps = max(combos, key=lambda tps: (sum(g.num_devices * r[t] for g, r, t in zip(cluster.groups, rates, tps)),
                                           [-t for t in tps]))
        bounds = list(itertools.accumulate(base.stage_layers, initial=0))
        split = [stage_sharding(model, a, b - 1) for a, b in zip(bounds, bounds[1:])]
        layout = replace(base, tps=tps, tp_sharding=tuple(sh for sh, _ in split), tp_parts=tuple(p for _, p in split))
        out.setdefault((layout.tps, layout.pp, layout.stage_layers, layout.schedule, layout.stage_recompute), layout)
    return list(out.values())


def _group_layouts(model: ModelGraph, cluster: Cluster, options: SearchOptions) -> list[tuple[Layout, int, int]]:
    """The best layout of one replica of each node group, at every size that tiles the group (alone), with the
    searched plan's m and micro-batch size; the replica takes the batch in proportion to its devices' speed."""
    rate = [cluster.profile(g.device.name).achievable_matmul_flops(options.dtype) for g in cluster.groups]
    total = sum(r * g.num_devices for r, g in zip(rate, cluster.groups))
    out: dict[tuple, tuple[Layout, int, int]] = {}
    for index, g in enumerate(cluster.groups):
        for size in divisors(g.num_devices):
            if not _tiles(g, size):
                continue
            klass = _class_of_group(cluster, index, size)
            batch = max(1, round(options.global_batch_size * size * rate[index] / total))
            try:
                plan = search(model, klass.replica_cluster, _replica_options(options, batch))
            except PlanningError:
                continue
            if plan.virtual_stages != 1 or len({s.tensor_parallel for s in plan.stages}) > 1:
                continue
            layout = Layout(tps=(1,) * len(cluster.groups), pp=plan.pipeline_parallel,
                            stage_layers=tuple(len(s.layers) for s in plan.stages), schedule=plan.schedule.value,
                            stage_recompute=tuple(s.recompute for s in plan.stages), tp_sharding=(), tp_parts=())
            key = (layout.pp, layout.stage_layers, layout.schedule, layout.stage_recompute)
            out.setdefault(key, (layout, plan.num_microbatches, plan.micro_batch_size))
    return list(out.values())


def _degree_rates(model: ModelGraph, cluster: Cluster, group: int, base: Layout, options: SearchOptions, b: int,
                  m: int) -> dict[int, float]:
    """Samples per second per device of a replica of group ``group`` at each degree t that fits it (t * pp
    devices, inside a node, tiling the group, every stage's layers split t ways), running m micro-batches of b."""
    g = cluster.groups[group]
    rates = {}
    for t in divisors(g.devices_per_node):
        size = t * base.pp
        if not _tiles(g, size):
            continue
        if tp_misfit(model.layers, t) is not None:  # every layer is in some stage
            continue
        klass = _class_of_group(cluster, group, size)
        layout = replace(base, tps=tuple(t if k == group else 1 for k in range(len(cluster.groups))))
        run = _replica_run(model, klass, layout, options, b, m, {}, breakdown=False)
        if run is not None:
            rates[t] = b / ((run.predicted.step_time_s - run.time.optimizer_s) * size)
    return rates


def _class_of_group(cluster: Cluster, group: int, size: int) -> ReplicaClass:
    """Node group ``group``'s replicas of ``size`` devices (which tile it), ranks in cluster order."""
    g = cluster.groups[group]
    nodes, per_node = (1, size) if size <= g.devices_per_node else (size // g.devices_per_node, g.devices_per_node)
    one = replace(g, num_nodes=nodes, devices_per_node=per_node)
    return ReplicaClass(group=group, device_type=g.device.name, first_rank=sum(h.num_devices for h in cluster.groups[:group]),
                        count=g.num_devices // size, replica_cluster=Cluster(spec=shorthand([one]), groups=(one,)))


def _replica_options(options: SearchOptions, batch: int) -> SearchOptions:
    """The search's options for one replica taking ``batch`` samples: dp 1, one chunk per pipeline rank, no ZeRO
    (a single replica has nothing to shard over)."""
    pins = {"global_batch_size": batch, "dp": 1, "top_k": 0}
    pins.update({name: value for name, value in (("virtual_stages", 1), ("zero", 0)) if hasattr(options, name)})
    return replace(options, **pins)


def _best_choice(model, cluster, classes: list[ReplicaClass], layout: Layout, options: SearchOptions,
                 to_beat_s: float = math.inf) -> _Choice | None:
    """The best number of micro-batches and shares for ``layout``; steps 3 and 4 of the Note. None when
    nothing fits or nothing is faster than ``to_beat_s`` (another layout's best step)."""
    gbs = options.global_batch_size
    replica_class = [k for k, c in enumerate(classes) for _ in range(c.count)]
    dp = len(replica_class)
    runs: dict[tuple[int, int, int], Estimate | None] = {}
    quick: dict[tuple[int, int, int], Estimate | None] = {}
    memos: dict[int, dict] = {}  # per replica class: its collectives' seconds, kept across the estimates
    sync_s = _sync_s(model, cluster, classes, layout, options)  # what every step of the layout adds
    if sync_s >= to_beat_s:
        return None

    best: _Choice | None = None
    for m in divisors(gbs)[::-1]:  # many micro-batches first: short bubbles, a best plan early for the bound below
        if gbs // m < dp or (layout.schedule == Schedule.INTERLEAVED and m % layout.pp):
            continue

        def time_s(k: int, b: int, m: int = m) -> float:
            run = _replica_run(model, classes[k], layout, options, b, m, quick, breakdown=False, memos=memos)
            return math.inf if run is None else run.predicted.step_time_s - run.time.optimizer_s

        # Every replica takes at least one sample per micro-batch, some replica at least the mean share, and
        # the pipeline time grows with the share, so the step is at least the slowest class at one and the
        # quickest class at the mean, plus the sync: an m that cannot beat the best so far (of any layout)
        # needs no balance.
        to_beat = min(best.predicted.step_time_s if best else math.inf, to_beat_s) - sync_s
        kinds, mean = set(replica_class), -(-(gbs // m) // dp)
        if max(time_s(k, 1) for k in kinds) >= to_beat or min(time_s(k, mean) for k in kinds) >= to_beat:
            continue
        shares = balance_shares(time_s, replica_class, gbs // m, below_s=to_beat)
        if shares is None:
            continue
        # The trim in balance_shares leaves sizes its bisection never estimated: estimate them here.
        chosen = {(k, b): _replica_run(model, classes[k], layout, options, b, m, runs, memos=memos)
                  for k, b in zip(replica_class, shares)}
        if any(run is None for run in chosen.values()):
            continue
        predicted = _predicted(model, cluster, classes, layout, options, replica_class, shares, chosen)
        if best is None or predicted.step_time_s < best.predicted.step_time_s:
            best = _Choice(layout=layout, num_microbatches=m, shares=shares, runs=chosen, classes=replica_class, predicted=predicted)
    return best


def _replica_config(layout: Layout, klass: ReplicaClass, options: SearchOptions, b: int, m: int) -> EstimateConfig:
    return EstimateConfig(global_batch_size=b * m, dp=1, tp=layout.tps[klass.group], pp=layout.pp, micro_batch_size=b, dtype=options.dtype,
                          schedule=layout.schedule, optimizer=options.optimizer, stage_layers=layout.stage_layers,
                          stage_recompute=layout.stage_recompute)


def _replica_run(model, klass: ReplicaClass, layout: Layout, options: SearchOptions, b: int, m: int, cache: dict, *,
                 breakdown: bool = True, memos: dict | None = None) -> Estimate | None:
    """planner.estimate of one replica of ``klass`` at micro-batch size b, m micro-batches; None if it does not fit.
    ``memos`` keeps each class's collective seconds across calls (``estimate``'s memo)."""
    key = (klass.group, b, m)
    if key not in cache:
        config = _replica_config(layout, klass, options, b, m)
        try:
            run = estimate(model, klass.replica_cluster, config, breakdown=breakdown,
                           memo=memos.setdefault(klass.group, {}) if memos is not None else None)
        except (EstimateError, ProfileError, ValueError):
            run = None
        cache[key] = run if run is not None and run.fits else None
    return cache[key]


def _stage_ranks(classes: list[ReplicaClass], layout: Layout) -> list[list[list[int]]]:
    """ranks[s][d][t] of pipeline rank s, replica d, tensor-parallel index t, in each replica estimate's own order."""
    firsts = [(c.first_rank + i * layout.tps[c.group] * layout.pp, layout.tps[c.group]) for c in classes
              for i in range(c.count)]
    return [[[f + s * tp + t for t in range(tp)] for f, tp in firsts] for s in range(layout.pp)]


def _stage_params(model: ModelGraph, tp: int, first: int, last: int) -> float:
    """Parameters one rank of a stage holds, a tied copy on a stage without layer 0 included."""
    params = sum(model.layers[l].params_at(tp) for l in range(first, last + 1))
    if first > 0:
        params += sum(model.layers[l].tied_at(tp) for l in range(first, last + 1))
    return params


def _mixed_sync_s(model: ModelGraph, cluster: Cluster, options: SearchOptions, rows: list[list[int]], first: int,
                  last: int) -> float:
    """The gradient sync of one stage whose replicas (``rows``: ranks[d]) differ in tensor-parallel degree, as
    runtime.mixed_sync runs it ([Note: replicas of different degrees]): each replica's gradients made whole
    (an all-gather over its tp group), all-reduced whole over the replicas' first ranks, broadcast back over
    each tp group. The replicas' gathers and broadcasts run side by side: the slowest counts."""
    whole = _stage_params(model, 1, first, last) * dtype_bytes(options.dtype)
    inside = max(all_gather_time_s(whole, row, cluster) + broadcast_time_s(whole, row, cluster) for row in rows)
    return all_reduce_time_s(whole, [row[0] for row in rows], cluster) + inside


def _sync_s(model, cluster, classes, layout: Layout, options) -> float:
    """The gradient sync of step 4 in the Note: the slowest stage's (the same bytes whatever the shares)."""
    ranks = _stage_ranks(classes, layout)
    sync_s, first = 0.0, 0
    for s, n in enumerate(layout.stage_layers):
        group = [rep[0] for rep in ranks[s]]
        # As planner/estimate/step_costs.py's data-parallel sync: what it costs inside a training step
        # (a measured profile's grad_sync_scale), set by the slowest device type taking part.
        scale = max(grad_sync_scale(cluster.group_of(rank).device) for rank in group)
        seconds = _mixed_sync_s(model, cluster, options, ranks[s], first, first + n - 1) if layout.mixed else \
            sync_seconds(options.sync, _stage_params(model, layout.tps[0], first, first + n - 1),
                         dtype_bytes(options.dtype), len(group),
                         min((cluster.group_of(rank).device for rank in group), key=lambda d: d.mem_bw_bytes_per_s),
                         collective_over(group, cluster, concurrent=layout.tps[0]))
        sync_s = max(sync_s, seconds * scale)
        first += n
    return sync_s


def _predicted(model, cluster, classes, layout: Layout, options, replica_class, shares, runs) -> Predicted:
    """The step of step 4 in the Note, broken down on the slowest replica."""
    slowest = max(runs.values(), key=lambda r: r.predicted.step_time_s - r.time.optimizer_s)
    sync_s = _sync_s(model, cluster, classes, layout, options)
    optimizer_s = max(r.time.optimizer_s for r in runs.values())
    step = slowest.predicted.step_time_s - slowest.time.optimizer_s + sync_s + optimizer_s
    t = slowest.time
    return Predicted(
        step_time_s=step,
        throughput_samples_per_s=options.global_batch_size / step,
        peak_memory_bytes=[max(r.predicted.peak_memory_bytes[s] for r in runs.values()) for s in range(layout.pp)],
        compute_time_s=t.compute_s + optimizer_s,
        bubble_time_s=t.bubble_s,
        dp_comm_time_s=sync_s,
        pp_comm_time_s=t.pp_comm_s,
        tp_comm_time_s=t.tp_comm_s,
    )


def _assemble(model: ModelGraph, cluster: Cluster, options: SearchOptions, choice: _Choice, info: SolverInfo) -> ParallelPlan:
    layout = choice.layout
    ranks = _stage_ranks(_classes_of(cluster, layout), layout)
    stages, first = [], 0
    for s, n in enumerate(layout.stage_layers):
        stages.append(StagePlan(index=s, layers=list(range(first, first + n)), device_type=cluster.device_types()[ranks[s][0][0]],
                                tensor_parallel=len(ranks[s][0]), ranks=ranks[s], tp_sharding=dict(layout.tp_sharding[s]),
                                tp_parts=dict(layout.tp_parts[s]) if layout.tp_parts else {},
                                recompute=layout.stage_recompute[s]))
        first += n
    dp = len(choice.shares)
    return ParallelPlan(
        model=ModelRef(file=model.file, args=dict(model.args), fingerprint=model.fingerprint, layer_names=model.layer_names),
        cluster=ClusterRef(spec=cluster.spec, world_size=cluster.world_size, device_types=cluster.device_types()),
        global_batch_size=options.global_batch_size,
        micro_batch_size=sum(choice.shares) // dp,
        num_microbatches=choice.num_microbatches,
        schedule=Schedule(layout.schedule),
        data_parallel=dp,
        dtype=options.dtype,
        stages=stages,
        predicted=choice.predicted,
        solver=info,
        replica_batch_shares=list(choice.shares),
    )


def estimate_shares(model: ModelGraph, cluster: Cluster, config: EstimateConfig) -> Estimate:
    """planner.estimate of a plan whose replicas take ``config.replica_batch_shares``: each replica's pipeline
    estimated on its own devices, then step 4 of [Note: heterogeneous data parallelism], as the plan was predicted.

    Raises:
        EstimateError: the replicas do not tile the cluster as the Note lays them out, or one does not fit.
    """
    pp, m = config.pp, config.num_microbatches
    tps = _group_degrees(cluster, config)
    classes = replica_classes(cluster, [t * pp for t in tps]) if tps is not None else None
    if config.virtual_stages > 1 or config.stage_tp is not None or classes is None:
        degrees = f"tp({config.tp})" if config.replica_tp is None else f"their own tp ({list(config.replica_tp)})"
        raise EstimateError(f"replica_batch_shares needs replicas of {degrees} * pp({pp}) devices of one type each, "
                            "each node group's replicas of one degree, one chunk per rank and one degree for every stage")
    split = stage_split(model, config)
    layers = tuple(b - a + 1 for a, b in split.bounds)
    layout = Layout(tps=tuple(tps), pp=pp, stage_layers=layers, schedule=config.schedule,
                    stage_recompute=tuple(config.recompute_of(s) for s in range(pp)), tp_sharding=({},) * pp)
    replica_class = [k for k, c in enumerate(classes) for _ in range(c.count)]
    options = SearchOptions(global_batch_size=config.global_batch_size, dtype=config.dtype, optimizer=config.optimizer)
    shares = list(config.replica_batch_shares or [config.micro_batch_size] * config.dp)
    runs: dict = {}
    chosen = {}
    for d, (k, b) in enumerate(zip(replica_class, shares)):
        run = _replica_run(model, classes[k], layout, options, b, m, runs)
        if run is None:
            raise EstimateError(f"replica {d} ({classes[k].device_type}) does not fit micro-batches of {b}")
        chosen[(k, b)] = run
    predicted = _predicted(model, cluster, classes, layout, options, replica_class, shares, chosen)
    slowest = max(chosen.values(), key=lambda r: r.predicted.step_time_s - r.time.optimizer_s)
    ranks = _stage_ranks(classes, layout)
    flops = slowest.model_flops_per_step / (slowest.config.global_batch_size or 1) * config.global_batch_size
    peak = sum(cluster.profile(t).peak_flops(config.dtype) for t in cluster.device_types())
    step = predicted.step_time_s
    return replace(slowest, config=config, cluster_spec=cluster.spec, world_size=cluster.world_size, predicted=predicted,
                   time=replace(slowest.time, dp_comm_s=predicted.dp_comm_time_s, optimizer_s=max(r.time.optimizer_s for r in chosen.values())),
                   stages=[replace(st, ranks=ranks[st.index]) for st in slowest.stages], model_flops_per_step=flops,
                   tflops_per_device=flops / step / cluster.world_size / 1e12, mfu=flops / step / peak, layout=split.layout)


def _group_degrees(cluster: Cluster, config: EstimateConfig) -> list[int] | None:
    """Each node group's tensor-parallel degree from ``config.replica_tp`` (replicas in cluster order, each group
    tiled by replicas of one degree; see [Note: heterogeneous data parallelism], step 1), or None where they do
    not tile so."""
    degrees = list(config.replica_tp or [config.tp] * config.dp)
    out, d = [], 0
    for g in cluster.groups:
        if d >= len(degrees) or g.num_devices % (degrees[d] * config.pp):
            return None
        count = g.num_devices // (degrees[d] * config.pp)
        if degrees[d : d + count] != [degrees[d]] * count:
            return None
        out.append(degrees[d])
        d += count
    return out if d == len(degrees) else None


def _classes_of(cluster: Cluster, layout: Layout) -> list[ReplicaClass]:
    classes = replica_classes(cluster, layout.sizes())
    assert classes is not None, "a chosen layout's replica size tiles the cluster"
    return classes


__all__ = ["ReplicaClass", "Layout", "balance_shares", "estimate_shares", "hetero_dp_plan", "replica_classes", "replica_sizes", "sync_floor_s"]
