"""Random cost tables for testing the split search against brute force."""

import itertools

import numpy as np

from hetpar.planner.costing import Candidate, CostTables, StageMode, StageSlot, evaluate_split

PLAIN = (StageMode(),)
RECOMPUTE = (StageMode(recompute="none"), StageMode(recompute="full"))
ZERO = tuple(StageMode(recompute=r, zero_stage=z) for z in (0, 2, 3) for r in ("none", "full"))


def compositions(num_layers, num_chunks):
    """Every split of num_layers into num_chunks non-empty contiguous runs."""
    for cuts in itertools.combinations(range(1, num_layers), num_chunks - 1):
        edges = (0, *cuts, num_layers)
        yield [(edges[i], edges[i + 1] - 1) for i in range(num_chunks)]


def random_tables(rng, num_layers, pp, num_microbatches, *, modes=PLAIN, schedule="1f1b", virtual_stages=1, memory=1.3, dp=2,
                  degrees=(1,), devices=None, unsplit=()):
    """Tables shaped like real ones: full recompute costs a forward and keeps less, ZeRO keeps
    less state and moves the gradient sync, ZeRO-3 adds per-micro-batch gathers and buffers;
    a stage of degree tp runs each layer in t (1/tp + s_l (1 - 1/tp)) (s_l: the layer's
    unsplittable share, drawn per layer), holds 1/tp of it, and hands over to a stage of
    another degree with ceil(b / a) whole-tensor sends.

    Args:
        memory: capacity per rank over the average no-recompute, no-ZeRO need (100: ample).
        degrees: the tensor-parallel degrees each stage may take (each ``modes`` entry at each).
        devices: the sum of the ranks' degrees (their devices per replica); unconstrained when None.
        unsplit: (layer, degree) pairs the layer cannot take.
    """
    C, L = pp * virtual_stages, num_layers
    speed = np.array([1 + (c % pp) % 2 for c in range(C)], dtype=float)  # odd ranks twice as slow
    fwd = rng.uniform(1e-3, 3e-3, size=(L, 1)) * speed
    b_input, weight = fwd * rng.uniform(0.8, 1.2, size=(L, 1)), fwd * rng.uniform(0.7, 1.0, size=(L, 1))
    params = rng.uniform(1, 3, size=L) * 2**28
    saved = rng.uniform(0.5, 2, size=L) * 2**29
    inputs = saved * 0.1
    in_flight = np.array([float(min(num_microbatches, pp - c % pp)) for c in range(C)])
    sync_pb, rsag_pb, gather_pb = rng.uniform(1e-12, 4e-12), rng.uniform(1e-12, 4e-12), rng.uniform(1e-12, 6e-12)
    serial = rng.uniform(0.05, 0.6, size=(L, 1)) if len(degrees) > 1 else np.zeros((L, 1))
    modes = tuple(StageMode(recompute=m.recompute, zero_stage=m.zero_stage, tp=tp) for tp in degrees for m in modes)

    def per_mode(f):
        return np.stack([f(m) for m in modes])

    def slower(m):  # time of a stage of degree m.tp over degree 1
        return 1 / m.tp + serial * (1 - 1 / m.tp)

    bad = np.array([[(l, m.tp) in set(unsplit) for l in range(L)] for m in modes])[:, :, None] * np.ones(C)
    inf = np.where(bad, np.inf, 0.0)
    full = lambda m: m.recompute == "full"  # noqa: E731
    tables = dict(
        time_s=per_mode(lambda m: ((2 * fwd if full(m) else fwd) + b_input + weight) * slower(m) + 0 * speed) + inf,
        fwd_s=per_mode(lambda m: fwd * slower(m) + 0 * speed),
        weight_s=per_mode(lambda m: weight * slower(m) + 0 * speed),
        gather_fwd_s=per_mode(lambda m: np.outer(params / m.tp * gather_pb * (m.zero_stage == 3), np.ones(C))),
        gather_bwd_s=per_mode(lambda m: np.outer(params / m.tp * 2 * gather_pb * (m.zero_stage == 3), np.ones(C))),
        epilogue_s=per_mode(lambda m: np.outer(params / m.tp * ({0: sync_pb, 2: rsag_pb, 3: 0.0}[m.zero_stage] + 1e-12 / (dp if m.zero_stage else 1)), np.ones(C))),
        memory_bytes=per_mode(lambda m: np.outer(params / m.tp * (16 if m.zero_stage == 0 else 4 + 12 / dp if m.zero_stage == 2 else 16 / dp), np.ones(C))
                              + np.outer((inputs if full(m) else saved) / m.tp, in_flight)) + inf,
        tp_time_s=per_mode(lambda m: np.zeros((L, C))),
    )
    latency = lambda value: np.array([[value * (m.zero_stage == 3) if c < C else 0 for c in range(C)] for m in modes])  # noqa: E731
    need = (16 * params + saved * in_flight.mean()).sum() / pp
    capacity = need * memory
    base_cut = np.concatenate([rng.uniform(0, 1e-3, size=(L, C - 1)), np.zeros((L, 1))], axis=1)
    cut = np.array([[base_cut * (1 / a if a == b else -(-b // a)) for b in degrees] for a in degrees])
    workspace = np.array([2**30 if i % 3 == 0 else 2**29 for i in range(L)], dtype=float)
    zero3 = 3 * params.max() * np.array([1.0 if i == 0 else 0.5 for i in range(L)])
    gradient = saved * np.array([0.2 if i % 2 else 0.1 for i in range(L)])  # the widest activation gradient, every mode
    return CostTables(
        candidate=Candidate(dp=dp, pp=pp, micro_batch_size=1, num_microbatches=num_microbatches, schedule=schedule,
                            virtual_stages=virtual_stages, modes=modes, tp_sum=() if devices is None else (("cpu", devices),)),
        slots=[{tp: StageSlot(ranks=[list(range(tp))], device_type="cpu", memory_bytes=int(capacity)) for tp in degrees} for r in range(pp)],
        **tables,
        gather_fwd_latency_s=latency(rng.uniform(0, 2e-4)),
        gather_bwd_latency_s=latency(rng.uniform(0, 4e-4)),
        cut_s=cut,
        epilogue_latency_s=np.array([[rng.uniform(0, 1e-4) if c < pp else 0.0 for c in range(C)] for _ in modes]),
        workspace_bytes=np.array([workspace / tp for tp in degrees]),
        zero3_buffer_bytes=np.array([zero3 / tp for tp in degrees]),
        gradient_bytes=np.array([gradient / tp for tp in degrees]),
        capacity_bytes=np.full(pp, capacity),
        device_types=["cpu"] * pp,
    )


def brute_force(tables, accept=lambda modes: True):
    """The best fitting (objective, bounds, modes) over every split and every mode of every chunk whose
    mode list ``accept`` takes, or None."""
    best = None
    C, K = tables.num_chunks, len(tables.candidate.modes)
    for bounds in compositions(tables.num_layers, C):
        for modes in itertools.product(range(K), repeat=C):
            if not accept(modes):
                continue
            cost = evaluate_split(tables, bounds, list(modes))
            if cost.fits(tables) and (best is None or cost.objective_s < best[0]):
                best = (cost.objective_s, bounds, list(modes))
    return best
