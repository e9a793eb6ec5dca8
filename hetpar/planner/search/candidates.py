"""The search's outer candidates: every (dp, pp, micro-batch size, schedule, virtual stages,
stages per device type) the pins allow, with the stage modes each offers; see [Note: search space]."""

from __future__ import annotations

import itertools

from hetpar.cost_models.compute import dtype_bytes
from hetpar.cost_models.layers import tp_misfit
from hetpar.cost_models.memory import state_bytes_per_param
from hetpar.cost_models.grad_sync import PLAIN as PLAIN_SYNC
from hetpar.planner.costing import Candidate, StageMode, ranks_by_type, type_width
from hetpar.planner.errors import PlanningError
from hetpar.planner.model_graph import ModelGraph
from hetpar.planner.options import SearchOptions, check_pins, expert_degrees, pinned_pp
from hetpar.planner.search.split_model import degree_split
from hetpar.planner.solver import divisors
from hetpar.vocabulary import Recompute, Schedule, Switch


# [Note: search space]
# Outside the CP-SAT model: dp, pp, the micro-batch size, the schedule and, on a
# cluster with several device types, how many stages each type hosts. When every
# type's device count is a multiple of dp, stages sit on one type each ([Note: stage
# device types]) and choose their tensor-parallel degree inside the model among the
# powers of two that divide their type's node width, up to --max-tp (1 unless a layer
# splits), summing per type to its devices per replica ([Note: per-stage tensor
# parallelism]); a node width's other divisors are offered as one degree for every
# stage. Otherwise (and for --uniform-split's baseline) the layout is Megatron's over
# the mixed devices with one degree tp dividing every node's device count and
# dp = world / (tp pp). Schedules: 1F1B, ZB-H1 ("zb", when pp > 1) and interleaved
# 1F1B with v = 2..max_virtual_stages chunks per rank (pp > 1, tp 1 on every stage,
# m a multiple of pp, pp v <= layers). GPipe has 1F1B's step time and never less
# memory ([Note: linear step time]), so it is searched only when pinned. Inside, every
# stage (every chunk, when interleaved) picks a mode: its degree (where it is > 1 and the
# model's tokens split, with sequence parallelism, and without it too under recompute
# none: [Note: sequence parallelism costs] in cost_models/layers.py) times recompute none, selective
# or full ([Note: selective recompute costs] in planner/capture/measure.py) times a
# ZeRO stage, 0, 2 or 3 when dp > 1 (3 with offload also at dp 1) under
# 1F1B and GPipe (the runtime shards with FSDP, which neither ZB-H1's split backward
# nor interleaved chunks support), 0 otherwise. ZeRO-1 is searched only when pinned:
# at one micro-batch it costs what ZeRO-2 costs and holds more; with more, ZeRO-2
# reduce-scatters after every micro-batch's backward and ZeRO-1 once, so ZeRO-1 can be
# faster where ZeRO-2's gradient shards are not needed to fit, a plan this search
# leaves to `--zero 1` (a fourth ZeRO stage per mode would cost the search a third more).
def enumerate_candidates(model: ModelGraph, cluster, options: SearchOptions) -> list[Candidate]:
    """Every (dp, pp, micro-batch size, schedule, virtual stages, stages per type) the pins allow,
    with the degrees each stage may take; see [Note: search space].

    Raises:
        PlanningError: the pins or the batch size rule out every candidate; says why.
    """
    gbs = options.global_batch_size
    check_pins(model, cluster, options)
    tp_ok = any(l.tp_capable for l in model.layers)
    out = []
    for rows in divisors(cluster.world_size):  # replica rows of each stage: dp data replicas x cp
        for cp in context_choices(model, options, rows):
            dp = rows // cp
            if gbs % dp or (options.dp is not None and options.dp != dp) or dp < options.min_dp:
                continue
            if cp > 1 and options.cp is None and not _context_may_help(model, cluster, options, rows):
                continue  # [Note: context-parallel candidates]
            out += _candidates_at(model, cluster, options, rows, cp, tp_ok)
    if not out:
        raise PlanningError(_no_candidate_reason(model, cluster, options, tp_ok))
    return out


def _candidates_at(model: ModelGraph, cluster, options: SearchOptions, rows: int, cp: int, tp_ok: bool) -> list[Candidate]:
    """The candidates with ``rows`` replica rows per stage, ``cp`` of them on each sequence."""
    num_layers, gbs, dp = len(model.layers), options.global_batch_size, rows // cp
    out = []
    for degrees, tp_sum, per_type in _layouts(model, cluster, options, rows, tp_ok):
        pp = sum(n for _, n in per_type) if per_type else cluster.world_size // (rows * degrees[0])
        if pp > num_layers or (pinned_pp(options) or pp) != pp:
            continue
        for mbs in divisors(gbs // dp):
            if options.micro_batch_size and mbs != options.micro_batch_size:
                continue
            if cp > 1 and mbs % cp == 0 and options.cp is None:
                continue  # [Note: context-parallel candidates]
            m = gbs // (dp * mbs)
            for schedule, v in schedules_for(options, tp=degrees[-1], pp=pp, num_microbatches=m, num_layers=num_layers):
                if cp > 1 and v > 1:
                    continue  # context parallelism runs without virtual stages
                for ep in expert_choices(model, options, dp=rows, virtual_stages=v) if cp == 1 else (1,):
                    modes = stage_modes(options, dp=rows, schedule=schedule, degrees=degrees, ep=ep,
                                        sp_degrees=tuple(d for d in degrees if d > 1 and model.sequence_splits(d)))
                    if modes:
                        out.append(Candidate(dp=rows, pp=pp, micro_batch_size=mbs, num_microbatches=m, schedule=schedule,
                                             virtual_stages=v, modes=modes, tp_sum=tp_sum, stages_per_type=per_type,
                                             sync=options.sync, ep=ep, expert_load=options.expert_imbalance, cp=cp))
    return out


# [Note: context-parallel candidates]
# A candidate of R replica rows at context parallelism cp with micro-batches of b
# samples gives each rank the work of b / cp samples, m = gbs cp / (R b) times a step:
# the same FLOPs, matmul rows, activations, boundaries and gradient sync as R rows at
# cp 1 with micro-batches of b / cp, plus the key and value exchanges and the gathered
# keys and values it keeps ([Note: context parallelism costs]). Where cp divides b that
# candidate exists and costs no more in time or memory, so the search offers cp > 1 only
# with micro-batches cp does not divide (mostly b = 1), unless --cp pins it. Nor does it
# offer cp where R rows can take one sample each and one sample's activations fit the
# devices of a replica without recompute (``_context_may_help``): there cp's gain would
# be the smaller pipeline bubble of more, smaller micro-batches, a plan left to --cp.
# Both keep the outer loop near its size without cp (offering cp everywhere took the
# 175B benchmark's search from 524 to 3320 candidates and past its work limits).
def _context_may_help(model: ModelGraph, cluster, options: SearchOptions, rows: int) -> bool:
    """Whether context parallelism is offered at ``rows`` replica rows ([Note: context-parallel
    candidates]): the batch has fewer samples than rows, or one sample's saved activations (no
    recompute, sequence parallelism at the largest degree a replica's devices allow) exceed the memory of the devices a
    replica spans, less their share of the training state sharded over all rows."""
    if options.global_batch_size < rows:
        return True
    devices = cluster.world_size // rows
    top = min(options.tp or options.max_tp, devices)
    degree = max([d for d in range(2, top + 1) if model.sequence_splits(d)] or [1])
    per_sample = sum(l.saved_activation_bytes for l in model.layers) * dtype_bytes(options.dtype) / 4 / degree
    state = sum(state_bytes_per_param(options.dtype, options.optimizer)) * model.total_params / rows
    memory = min(cluster.profile(t).memory_bytes for t in cluster.count_by_type())
    return per_sample > devices * memory - state


def context_choices(model: ModelGraph, options: SearchOptions, rows: int) -> tuple[int, ...]:
    """The context-parallel degrees a stage with ``rows`` replica rows may take: powers of two up to
    --max-cp that divide the rows and cut the sequence into 2 cp chunks; 1 without attention or under
    another sync method; the pin where there is one ([Note: context parallelism costs])."""
    if options.cp is not None:
        return (options.cp,) if rows % options.cp == 0 else ()
    if not model.context_capable or options.sync is not PLAIN_SYNC or options.ep not in (None, 1):
        return (1,)
    return tuple(cp for cp in (2**i for i in range(8)) if cp <= options.max_cp and rows % cp == 0
                 and model.sequence_length % (2 * cp) == 0)


def _layouts(model: ModelGraph, cluster, options: SearchOptions, dp: int, tp_ok: bool):
    """(degrees, tp_sum, stages_per_type) of every layout with ``dp`` replicas; see [Note: search space]."""
    by_type = ranks_by_type(cluster)
    if options.uniform_split or any(len(r) % dp for r in by_type.values()):
        world = cluster.world_size
        widths = {g.devices_per_node for g in cluster.groups}
        for tp in divisors(world // dp):
            if _degree_ok(model, options, tp, tp_ok) and not any(w % tp for w in widths) and not tp_misfit(model.layers, tp):
                yield (tp,), (), ()
        return
    share = {t: len(r) // dp for t, r in by_type.items()}
    width = {t: type_width(cluster, r) for t, r in by_type.items()}
    chain = tuple(d for d in (2**i for i in range(12)) if _degree_ok(model, options, d, tp_ok) and any(w % d == 0 for w in width.values()))
    others = [(d,) for d in sorted({d for w in width.values() for d in divisors(w)} - set(chain))
              if _degree_ok(model, options, d, tp_ok) and all(w % d == 0 for w in width.values()) and not tp_misfit(model.layers, d)]
    if options.tp is not None:
        chain = tuple(d for d in chain if d == options.tp and not tp_misfit(model.layers, d))
    for degrees in ([chain] if chain else []) + others:
        mine = {t: tuple(d for d in degrees if width[t] % d == 0 and d <= share[t]) for t in by_type}
        if not all(mine.values()):
            continue
        for per_type in _stage_counts(share, mine, width, len(model.layers), pinned_pp(options)):
            used = tuple(sorted({d for t, p in per_type for d in degree_split(share[t], p, mine[t])}))
            if options.stage_devices is None or all(options.stage_devices.count(t) == p for t, p in per_type):
                yield used, tuple(sorted(share.items())), per_type


# [Note: stage counts]
# How many stages each type hosts is enumerated outside the model; every count whose
# degrees can sum to the type's share would make the outer loop grow with the share
# (a 192-device share has 24..130 possible counts for a 130-layer model, and three
# types multiply theirs). The search takes, for each offered degree d, the count of the
# uniform layout, ceil(share / d) stages, and, on one device type whose share fits in
# one node, that count plus one: the uniform layouts, a remainder stage where d does
# not divide the share, and within a node one stage's devices split between two stages
# (or a heavy stage given a larger degree than the rest). On larger shares the plus-one
# layouts were near-ties of the uniform ones (the 1T benchmark's 25 stages of degrees 8
# and 4 against 24 of 8, within 1%) that CP-SAT could not settle within its work limit,
# so each ran to the limit; on mixed clusters each is solved once per order of the
# types, multiplying those solves (docs/benchmarks/search_cpu-2core_2026-12-02.md). The degrees offered are the two neighbours in the chain around the
# type's average share / stages (``degree_split``; the stages' degrees as even as the
# sum allows, so that their counts are fixed and the CP-SAT model only chooses which
# stages take the larger), or where no two neighbours sum right, the degrees of the
# first split found largest first. Offering every degree that could sum right was
# tried: with 24 modes per stage CP-SAT's relaxation was weak (a bound of a third of
# the optimum on the 1T benchmark's candidates), and candidates ran to their work limit unproven.
# A pinned pipeline depth (--pp, --stage-layers, --stage-devices) fixes the total, so
# there every split of it over the types whose degrees can sum to their shares is
# taken: few, and the counts above need not reach the pinned depth (on
# 2x4xH100-80GB+2x8xA100-40GB, --pp 4 is 1 + 1 stages on the H100s and 1 + 1 on the
# A100s at dp 4, which none of the uniform counts is).
def _stage_counts(share: dict[str, int], degrees: dict[str, tuple[int, ...]], width: dict[str, int], num_layers: int,
                  pinned: int | None = None):
    """The (device type, stages) tuples of [Note: stage counts]; with a ``pinned`` depth, those that sum to it."""
    if pinned is not None:
        yield from _pinned_stage_counts(share, degrees, pinned)
        return
    seen = set()
    for d in sorted({d for mine in degrees.values() for d in mine}):
        base = {t: -(-share[t] // max((e for e in mine if e <= d), default=min(mine))) for t, mine in degrees.items()}
        for extra in [None, *(t for t in share if share[t] <= width[t] and len(share) == 1)]:
            counts = {t: n + (t == extra) for t, n in base.items()}
            key = tuple(sorted(counts.items()))
            if key in seen or sum(counts.values()) > num_layers:
                continue
            seen.add(key)
            if all(degree_split(share[t], n, degrees[t]) is not None for t, n in counts.items()):
                yield key


def _pinned_stage_counts(share: dict[str, int], degrees: dict[str, tuple[int, ...]], pp: int):
    """Every ((device type, stages), ...) with ``pp`` stages in all whose degrees can sum to each type's share."""
    types = sorted(share)
    for head in itertools.product(range(1, pp + 1), repeat=len(types) - 1):
        counts = (*head, pp - sum(head))
        if counts[-1] >= 1 and all(degree_split(share[t], n, degrees[t]) is not None for t, n in zip(types, counts)):
            yield tuple(zip(types, counts))


def _degree_ok(model: ModelGraph, options: SearchOptions, tp: int, tp_ok: bool) -> bool:
    """Whether ``tp`` may be offered: 1, or a layer splits and --max-tp and --tp allow it."""
    if options.tp is not None and tp != options.tp:
        return False
    return tp == 1 or (tp_ok and tp <= options.max_tp)


def schedules_for(options: SearchOptions, *, tp: int, pp: int, num_microbatches: int, num_layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs searched for one (tp, pp, m); see [Note: search space]."""
    names = [options.schedule] if options.schedule else [Schedule.ONE_F_ONE_B, Schedule.ZERO_BUBBLE, Schedule.INTERLEAVED]
    # --stage-layers without --virtual-stages gives one chunk per pipeline rank (pinned_pp counts them so).
    virtual = options.virtual_stages or (1 if options.stage_layers is not None else None)
    if virtual is not None:
        names = [n for n in names if (n == Schedule.INTERLEAVED) == (virtual > 1)]
    out = []
    for name in names:
        if name == Schedule.INTERLEAVED:
            pinned = options.schedule == Schedule.INTERLEAVED
            top = virtual or options.max_virtual_stages
            low = virtual or 2
            for v in range(low, top + 1):
                if (pp > 1 or pinned) and tp == 1 and num_microbatches % pp == 0 and pp * v <= num_layers:
                    out.append((name, v))
        elif name != Schedule.ZERO_BUBBLE or pp > 1 or options.schedule == Schedule.ZERO_BUBBLE:
            out.append((name, 1))
    return out


def expert_choices(model: ModelGraph, options: SearchOptions, *, dp: int, virtual_stages: int) -> tuple[int, ...]:
    """The expert-parallel degrees a candidate with ``dp`` replicas may take: those the
    model's experts split into that divide dp (the experts split over replicas), 1 only
    under virtual stages; the pin where there is one. See [Note: expert parallelism costs]."""
    if options.ep is not None:
        return (options.ep,) if dp % options.ep == 0 and (options.ep == 1 or virtual_stages == 1) else ()
    if virtual_stages > 1 or options.sync is not PLAIN_SYNC:
        return (1,)
    return tuple(d for d in expert_degrees(model) if dp % d == 0)


def stage_modes(options: SearchOptions, *, dp: int, schedule: str, degrees: tuple[int, ...] = (1,),
                ep: int = 1, sp_degrees: tuple[int, ...] = ()) -> tuple[StageMode, ...]:
    """The modes each stage may take; empty when the pins leave none; see [Note: search space].
    Under expert parallelism (``ep`` > 1) ZeRO stays 0. A degree in ``sp_degrees`` runs with
    sequence parallelism, without it, or both, as --sp says."""
    recomputes = [options.recompute] if options.recompute else [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL]
    fsdp = schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE) and ep == 1  # FSDP2 runs ZeRO under these only
    shardable = dp > 1 and fsdp
    if options.zero is not None:
        zeros = [options.zero] if options.zero == 0 or shardable else []
    else:
        zeros = [0, 2, 3] if shardable else [0]
    def sps(tp: int, recompute: str) -> tuple[bool, ...]:  # [Note: sequence parallelism costs]
        if tp not in sp_degrees or options.sequence_parallel == Switch.OFF:
            return () if options.sequence_parallel == Switch.ON and tp > 1 else (False,)
        if options.sequence_parallel == Switch.ON or recompute != Recompute.NONE:
            return (True,)
        return (False, True)

    offloads = {Switch.ON: (True,), Switch.OFF: (False,)}.get(options.offload, (False, True) if options.offload_offered else (False,))
    if dp == 1 and fsdp and True in offloads and options.zero in (None, 3):
        zeros = [*zeros, 3]  # over one row, ZeRO-3 only with its state in host memory (cost_models.memory.zero_runs)
    return tuple(StageMode(recompute=r, zero_stage=z, tp=tp, sp=sp, offload=o) for tp in degrees for z in zeros for r in recomputes
                 for sp in sps(tp, r) for o in offloads if z == 3 or not o  # [Note: offload search]
                 if not (options.offload == Switch.ON and z != 3) and (dp > 1 or o or z == 0))


def _no_candidate_reason(model: ModelGraph, cluster, options: SearchOptions, tp_ok: bool) -> str:
    world, gbs = cluster.world_size, options.global_batch_size
    if options.offload == Switch.ON:
        return (f"--offload on needs ZeRO-3, so schedule 1f1b or gpipe without expert parallelism; no such (dp, tp, pp) "
                f"fits world_size({world}) with global batch {gbs} and the other pins")
    if options.zero:
        return (f"--zero {options.zero} needs data parallelism (dp > 1) and schedule 1f1b or gpipe; no such (dp, tp, pp) "
                f"fits world_size({world}) with global batch {gbs} and the other pins")
    if options.schedule == Schedule.INTERLEAVED or (options.virtual_stages or 1) > 1:
        return (f"the interleaved schedule needs tp 1, micro-batches a multiple of pp and pp * virtual stages <= "
                f"{len(model.layers)} layers; nothing fits world_size({world}) with global batch {gbs} and the other pins")
    return (
        f"no (dp, tp, pp) fits world_size({world}) with global batch {gbs}: dp must divide the batch, tp every node's "
        f"devices, and pp is at most the model's {len(model.layers)} layers"
        + ("" if tp_ok else " (and tp is 1: the model has no tensor-parallel layers)")
        + "; change the pins, --global-batch or the cluster"
    )
