"""Fit a device profile to the measurements ``hetpar profile`` takes on one host.

Pure arithmetic on numbers (no torch, nothing of ours but the profile type), so the
fits are tested on synthetic measurements. The measurement record is the dict that
the profiler package's benchmarks produce (docs/profiling.md lists its keys):

    {"fingerprint": str, "date": "YYYY-MM-DD", "workers": int,
     "device": "cpu" | "cuda",                                                (optional; "cpu")
     "matmul": {"fp32": [[flops, seconds], ...], "bf16": [...], ...},
     "matmul_rows": {"forward": [[rows, flops, seconds], ...], "backward": [...]},  (optional)
     "matmul_rows_narrow": {"width": k, "forward": [...], "backward": [...]},     (optional)
     "copy": [bytes_moved, seconds],
     "op_overhead": {"fwd_s_per_op": s, "fwd_bwd_s_per_op": s},
     "optimizer": {"optimizer": "adamw", "tensor_s": s, "param_s": s},        (optional)
     "collectives": {"all_reduce": [[nbytes, seconds], ...], ...},           (optional:
                                                        two or more workers)
     "step_overhead_s": s,
     "late_receive": {"mean_s": s, "median_s": s, "bytes": n, "repeats": n},  (optional)
     "reference": {"batch_size": n, "fwd_s": s, "fwd_bwd_s": s,
                   "dtype": "bf16", "model_args": {...}},                      (optional;
                   dtype and model_args since 2026-12-04: before, fp32 and {})
     "reference_step": {"steps": [[microbatches, compute_s, sync_wait_s,
                                   optimizer_s], ...],
                        "passes": [[microbatches, fwd_s, bwd_s], ...],         (optional)
                        "batch_size": n, "workers": w, "dtype": ...},          (optional)
     "tp_op_overhead": {"fwd_bwd_s_per_op": s, "ops_per_block": n,
                        "all_reduces_per_block": n, "tp": n},                 (optional;
                        "tp", the probe's group size, since 2026-12-03: before, all workers)
     "reference_tp_step": {"steps": [[microbatches, compute_s, optimizer_s], ...],
                           "batch_size": n,
                           "tp": w},                                           (optional)
     "model_layers": {"model": file name, "model_args": {...}, "dtype": ...,
                      "layers": [{"name": str, "times": [[micro_batch, fwd_s,
                                                          bwd_s], ...]}, ...]}}  (optional)

[Note: calibrated fits]
Every fitted quantity is a straight line through (size, seconds) points by least
squares of the relative error, ``seconds = fixed + size / rate``:
- matmul: size = FLOPs; ``rate`` becomes ``peak_flops_per_s[dtype]`` with
  ``matmul_efficiency`` 1 (the rate is already what a matmul reaches), and the
  intercept is the per-call cost that makes small matmuls slow;
- collectives: size = bytes; ``fixed`` is alpha (latency_s), ``rate`` is beta
  (bw_bytes_per_s), as nccl-tests reports them. A record of one worker has none: the
  base profile's links and collectives stay, with their sources;
- ``weight_stream_bytes_per_s`` (CPU records only): the copy bandwidth, at which every
  pass of a layer reads its weights ([Note: weight traffic] in cost_models/compute.py;
  on a GPU a matmul's weight reads hide under its FLOPs);
- ``op_overhead_s``: the cost model charges each op of a layer three times per
  micro-batch (forward, input gradient, weight gradient; cost_models/compute.py), so
  it is a third of the measured forward-plus-backward seconds per tiny op;
- ``step_overhead_s`` is measured directly: a training step of a model too small to
  cost anything (data, zero_grad, the loss all-reduce, the optimizer's calls), less
  the optimizer's per-tensor cost of its four tensors, which the estimator charges
  per tensor;
- ``matmul_rows_efficiency``: matmuls of a mid-sized Linear (K = N = 512) at row
  counts 1 to 512, forward and backward apart, each rate over the fitted fp32 peak:
  the curve by which a layer's small matmuls fall short ([Note: matmul rows] in
  planner.capture). Not a fit: the measured points, interpolated in log rows;
- ``matmul_narrow_efficiency``: the same at K = N = ``matmul_narrow_width`` (128), as
  nn.Linear lays the matmuls out (a transposed weight, a bias) at both widths: a
  matmul between the widths interpolates in log width;
- ``late_receive_s``: not a fit: the mean wait the probe measured ([Note: late
  receives] in runtime/schedule.py);
- ``kernel_efficiency`` and ``backward_kernel_efficiency``: what the kernels of a
  small training workload reach of the fitted rates, forward and backward apart (on a
  CPU the backward's autograd and elementwise kernels fall further short). The
  workload is profiler/reference_model.py, a fixed model unlike any example, timed in
  every worker at once, in the dtype a program of that device computes in (the
  record's ``dtype``: bf16 autocast on a GPU); the efficiency is the layer cost model's FLOP and byte seconds
  at efficiency 1 (the row curve applied) over the measured seconds less the per-op
  overheads it charges. Each is then scaled by a factor from the same model's whole
  training step as the generated program runs it (profiler/reference.py
  ``reference_step_time``: hetpar's executor, the gradient all-reduce, AdamW, the
  loss report, in every worker at once) at several micro-batch counts, its sections
  timed apart and the executor's forwards and backwards apart ("passes"): a line
  through (micro-batches, seconds of the forwards) gives what each micro-batch's
  forward costs, and the forward's factor makes the estimator's forward charge for it
  equal; the same for the backward. So the efficiencies carry what the program adds
  around the kernels, pass by pass: a step's forwards can fall further short of the
  loop's than its backwards (a forward in a loop of forwards may find the weights in
  the cache, where the step's first follows the optimizer's writes), which one factor
  on both would hand to the backward
  (docs/benchmarks/validate_cpu-2core_2026-12-03.md). A record without the passes gets
  one factor on both, from the forwards and backwards together;
- ``grad_sync_scale``: the intercept of the line through (micro-batches, seconds of
  the forwards and backwards plus the wait for the gradient all-reduce), i.e. what the
  all-reduce adds to the step, over its charge at the fitted alpha and beta: on a CPU
  its threads share the cores with the last backward it runs under, so inside a step
  it costs more than in a loop of its own. One worker has no all-reduce: none.
  Without that timing both are 1 (the rates above are what kernels reach here; the
  global 0.75 of cost_models/compute.py stands for GPU runs, not for this host);
- ``optimizer_tensor_overhead_s`` and ``optimizer_bytes_per_s``: an AdamW step's
  seconds per parameter tensor and its memory traffic (OPTIMIZER_BYTES_PER_PARAM per
  parameter) per second, from two steps (profiler/micro.py ``optimizer_times``);
- ``tp_module_overhead_s`` ([Note: tensor-parallel dispatch] in cost_models/compute.py):
  a tiny colwise/rowwise block's forward plus backward, less what the estimator
  already charges for it (its ops' overhead and its all-reduces at the fitted alpha,
  scaled to the group), per sharded module: DTensor's own work, with no kernels around
  it. Timed in groups of 2 workers, all groups at once (profiler/reference.py
  ``tp_probe_degree``), as are the tensor-parallel steps below;
- ``tp_collective_overhead_s`` and ``tp_optimizer_tensor_overhead_s``: the reference
  model's whole training step with tensor parallelism in those groups, as the
  generated program runs it (the planner's own sharding of it, hetpar's executor,
  DTensor, AdamW), at several micro-batch counts (profiler/reference.py
  ``reference_tp_step_time``), its sections timed apart. The slope of the line
  through (micro-batches, seconds of the forwards and backwards) less the estimator's
  charge for one micro-batch (the layers at that degree with the efficiencies above
  and ``tp_module_overhead_s``, each collective of ``LayerProfile.tp_collectives`` at
  the fitted alpha and beta scaled to the group) is charged per collective: what a
  collective costs between kernels, where the ranks arrive apart, beyond what it costs
  in a tight loop.
  The optimizer step's median seconds less its charge for plain tensors is what
  DTensor parameters add to it, per sharded parameter tensor.
- ``layer_corrections`` (``hetpar profile --model``): not a fit but the ratio of each
  layer's measured seconds (timed as the program runs it) to the fitted layer model's
  at the same micro-batch, forward and backward; see [Note: measured layers] in
  cost_models/compute.py.
A negative intercept (noise on a shared machine) is clamped to zero.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace
from typing import Any, Sequence

from hetpar.cost_models.collectives import measured_collective_s
from hetpar.cost_models.compute import layer_timing, optimizer_rates
from hetpar.cost_models.devices import DeviceProfile, MeasuredCollective, ProfileError
from hetpar.cost_models.layers import LayerProfile
from hetpar.cost_models.memory import OPTIMIZER_BYTES_PER_PARAM
from hetpar.vocabulary import DType, Optimizer

# The cost model charges each op three launches per micro-batch; see [Note: calibrated fits].
LAUNCHES_PER_OP = 3
# Parameter tensors of profiler/collectives.py's step-overhead model (two Linear layers).
_STEP_PROBE_TENSORS = 4
# Sharded modules of profiler/reference.py's tensor-parallel block (one colwise, one rowwise).
_TP_PROBE_SHARDED_MODULES = 2
# Bounds on a fitted kernel efficiency: a fit outside them is noise, not a machine.
_MIN_EFFICIENCY, _MAX_EFFICIENCY = 0.05, 2.0
# ... and on the gradient synchronisation's factor.
_MIN_SYNC_SCALE, _MAX_SYNC_SCALE = 0.25, 10.0
# ... and on a measured layer's time over its modelled time, either way.
_MAX_LAYER_RATIO = 20.0


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``seconds = fixed_s + size / rate`` through (size, seconds) points.

    Args:
        points: at least two points with at least two distinct sizes.

    Returns:
        (fixed_s clamped to >= 0, rate in size units per second).

    Raises:
        ProfileError: too few points, or times that do not grow with size even by the
            median of pairwise slopes.
    """
    if len({x for x, _ in points}) < 2:
        raise ProfileError(f"a fit needs measurements at two or more sizes, got {len(points)}")
    # Weighted by 1/seconds^2, i.e. least relative error: otherwise the largest size
    # alone sets the intercept and a small-message latency comes out ten times too big.
    w = [1.0 / y**2 if y > 0 else 0.0 for _, y in points]
    sw = sum(w)
    mean_x = sum(wi * x for wi, (x, _) in zip(w, points)) / sw
    mean_y = sum(wi * y for wi, (_, y) in zip(w, points)) / sw
    sxx = sum(wi * (x - mean_x) ** 2 for wi, (x, _) in zip(w, points))
    slope = sum(wi * (x - mean_x) * (y - mean_y) for wi, (x, y) in zip(w, points)) / sxx
    if slope > 0:
        return max(0.0, mean_y - slope * mean_x), 1.0 / slope
    # One slow repeat at a small size (a neighbour's burst) can tip the weighted fit;
    # the median of pairwise slopes (Theil-Sen) ignores one such point in three.
    slope = statistics.median((y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(sorted(points), 2) if x2 > x1)
    if slope <= 0:
        raise ProfileError("measured times do not grow with size; the machine is too noisy, run hetpar profile again")
    return max(0.0, statistics.median(y - slope * x for x, y in points)), 1.0 / slope


def fit_profile(measurements: dict[str, Any], base: DeviceProfile, reference_layers: Sequence[LayerProfile] = (),
                model_layers: Sequence[LayerProfile] = ()) -> DeviceProfile:
    """A device profile for the measured host: fitted numbers over ``base``'s unmeasured ones.

    Args:
        measurements: the record described in the module docstring.
        base: the profile whose unmeasured fields (memory, NICs, inter-node; links and
            collectives when one worker timed none) are kept, e.g. the built-in "cpu"
            profile, or the GPU's datasheet profile.
        reference_layers: the traced layers of profiler/reference_model.py (at the
            record's size); with the
            record's ``reference`` timing they set the kernel efficiencies (else 1).
        model_layers: the traced layers of the model whose layers the record's
            ``model_layers`` timed (``hetpar profile --model``); with them the profile
            gets ``layer_corrections``.

    Returns:
        The profile, named as ``base``, with the fingerprint and a source
        "fitted from hetpar profile on <date>, <fingerprint>" on every fitted field.

    Raises:
        ProfileError: missing measurements or a failed fit.
    """
    try:
        stamp = f"fitted from hetpar profile on {measurements['date']}, {measurements['fingerprint']}"
        matmul, copy = measurements["matmul"], measurements["copy"]
        per_op = measurements["op_overhead"]["fwd_bwd_s_per_op"]
        step_s = measurements["step_overhead_s"]
    except (KeyError, TypeError) as exc:
        raise ProfileError(f"profile measurements lack {exc}") from None
    collectives = measurements.get("collectives") or {}  # none from one worker: the base's stay
    replaced = ("peak_flops_per_s.", "collectives.") if collectives else ("peak_flops_per_s.",)
    sources = {k: v for k, v in base.sources.items() if not k.startswith(replaced)}
    peaks = {dtype: fit_line([tuple(p) for p in points])[1] for dtype, points in matmul.items()}
    fits = {name: fit_line([tuple(p) for p in points]) for name, points in collectives.items()}
    measured = {name: MeasuredCollective(latency_s=a, bw_bytes_per_s=bw, ranks=int(measurements["workers"]))
                for name, (a, bw) in fits.items()}
    fields: dict[str, Any] = {
        "peak_flops_per_s": peaks,
        "matmul_efficiency": 1.0,
        "mem_bw_bytes_per_s": copy[0] / copy[1],
        "op_overhead_s": per_op / LAUNCHES_PER_OP,
        "step_overhead_s": float(step_s),
        "collectives": measured or base.collectives,
        "fingerprint": str(measurements["fingerprint"]),
    }
    if measurements.get("device", "cpu") == "cpu":  # [Note: weight traffic] in cost_models/compute.py
        fields["weight_stream_bytes_per_s"] = copy[0] / copy[1]
    rows = measurements.get("matmul_rows")
    if rows and DType.FP32 in peaks:
        fields["matmul_rows_efficiency"] = rows_curves(rows, peaks[DType.FP32])
        narrow = measurements.get("matmul_rows_narrow")
        if narrow:
            fields["matmul_narrow_efficiency"] = rows_curves(narrow, peaks[DType.FP32])
            try:
                fields["matmul_narrow_width"] = int(narrow["width"])
            except (KeyError, TypeError, ValueError):
                raise ProfileError("profile measurements: matmul_rows_narrow lacks its width") from None
    if "p2p" in fits:
        fields["intra_node_latency_s"], fields["intra_node_bw_bytes_per_s"] = fits["p2p"]
        # what the cards measured is what they get, through host memory or not ([Note: staged copies])
        fields["intra_node_staged_bw_bytes_per_s"] = None
        sources.pop("intra_node_staged_bw_bytes_per_s", None)
    late = measurements.get("late_receive")
    if late:
        try:
            fields["late_receive_s"] = float(late["mean_s"])
        except (KeyError, TypeError, ValueError):
            raise ProfileError("profile measurements: late_receive lacks its mean_s") from None
    fields["kernel_efficiency"] = 1.0
    optimizer = measurements.get("optimizer")
    if optimizer:
        fields["optimizer_tensor_overhead_s"] = float(optimizer["tensor_s"])
        if optimizer["param_s"] > 0:
            fields["optimizer_bytes_per_s"] = OPTIMIZER_BYTES_PER_PARAM[optimizer["optimizer"]] / optimizer["param_s"]
        fields["step_overhead_s"] = max(0.0, float(step_s) - _STEP_PROBE_TENSORS * float(optimizer["tensor_s"]))
    tp = measurements.get("tp_op_overhead")
    if tp and "all_reduce" in measured:
        block = tp["fwd_bwd_s_per_op"] * tp["ops_per_block"]
        # An old record probed over all workers and does not say its degree.
        group = int(tp.get("tp", measurements["workers"]))
        latency_s = measured_collective_s("all_reduce", measured["all_reduce"], 0.0, group)
        charged = tp["ops_per_block"] * per_op + tp["all_reduces_per_block"] * latency_s
        fields["tp_module_overhead_s"] = max(0.0, block - charged) / _TP_PROBE_SHARDED_MODULES
    notes = {
        "matmul_efficiency": "1.0: the fitted peak is the rate matmuls reach here",
        "mem_bw_bytes_per_s": "copy bandwidth, bytes read plus written",
        "weight_stream_bytes_per_s": "copy bandwidth: a layer's weights leave the cache between micro-batches",
        "op_overhead_s": "a third of forward+backward seconds per tiny op",
        "step_overhead_s": "a training step of a negligible model",
        "intra_node_latency_s": "send/recv alpha",
        "intra_node_bw_bytes_per_s": "send/recv beta",
        "kernel_efficiency": "1.0: the fitted rates are the rates kernels reach here",
        "optimizer_tensor_overhead_s": "AdamW step seconds per tiny parameter tensor",
        "optimizer_bytes_per_s": "AdamW step over large tensors, bytes moved per second",
        "tp_module_overhead_s": "DTensor colwise/rowwise block less its ops and all-reduces, per sharded module",
        "matmul_rows_efficiency": "fp32 Linear of 512 inputs and outputs on M rows (forward x @ w.T + b; backward: both gradients) over the fitted fp32 peak",
        "matmul_narrow_efficiency": "the same at the narrow width, over the fitted fp32 peak",
        "matmul_narrow_width": "K = N of the narrow matmuls timed",
        "late_receive_s": "mean wait of a receive posted after its send while the sender computes (profiler/collectives.py late_receive_times)",
    }
    for key, note in notes.items():
        if key in fields:
            sources[key] = f"{stamp}: {note}"
    sources.update({f"peak_flops_per_s.{d}": f"{stamp}: matmul FLOPs/s (slope of time vs FLOPs)" for d in peaks})
    sources.update({f"collectives.{c}": f"{stamp}: alpha-beta fit over {len(collectives[c])} sizes" for c in measured})
    fitted = replace(base, **fields, sources=sources, layer_corrections={})
    if measurements.get("reference") and reference_layers:
        fitted = _with_runtime_fits(fitted, measurements, reference_layers, stamp)
    timed = measurements.get("model_layers")
    if timed and model_layers:
        fitted = replace(fitted, layer_corrections=layer_corrections(fitted, timed, model_layers), sources={
            **fitted.sources,
            "layer_corrections": f"{stamp}: the layers of {timed.get('model', 'the model')} timed at micro-batches "
                                 f"{', '.join(str(t[0]) for t in timed['layers'][0]['times'])}, over the layer model",
        })
    return fitted


def layer_corrections(profile: DeviceProfile, timed: dict[str, Any], layers: Sequence[LayerProfile]) -> dict[str, dict[str, Any]]:
    """The measured over the modelled seconds of each layer cost (``LayerProfile.cost_key``),
    forward and backward, by micro-batch ([Note: measured layers] in cost_models/compute.py);
    layers that cost the same (a transformer's blocks) share the median of their ratios.
    The layers were timed as the program runs them (stage modules, cold caches, every
    worker at once), so the ratio is taken against ``profile``'s final model: a corrected
    layer costs what was measured.

    Raises:
        ProfileError: a timed layer the planner did not trace (the model file changed).
    """
    by_name = {layer.name: layer for layer in layers}
    ratios: dict[str, dict[str, Any]] = {}
    dtype = timed.get("dtype", DType.FP32)  # the autocast dtype the layers ran in
    try:
        for row in timed["layers"]:
            layer = by_name.get(row["name"])
            if layer is None:
                raise ProfileError(f"profile measurements: layer {row['name']!r} is not one of the model's "
                                   f"({', '.join(by_name)}); profile the model again")
            entry = ratios.setdefault(layer.cost_key, {"layer": layer.name, "forward": {}, "backward": {}})
            for batch, fwd_s, bwd_s in row["times"]:
                modelled = layer_timing(layer, profile, tp=1, micro_batch_size=int(batch), dtype=dtype)
                for curve, measured_s, model_s in (("forward", fwd_s, modelled.fwd_s), ("backward", bwd_s, modelled.bwd_s)):
                    if model_s > 0 and measured_s > 0:
                        ratio = min(_MAX_LAYER_RATIO, max(1 / _MAX_LAYER_RATIO, measured_s / model_s))
                        entry[curve].setdefault(int(batch), []).append(ratio)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"profile measurements: model_layers is malformed ({exc})") from None
    return {key: {"layer": e["layer"], **{c: {b: statistics.median(v) for b, v in sorted(e[c].items())} for c in ("forward", "backward")}}
            for key, e in ratios.items() if e["forward"] and e["backward"]}


def _with_runtime_fits(fitted: DeviceProfile, measurements: dict[str, Any], reference_layers: Sequence[LayerProfile],
                       stamp: str) -> DeviceProfile:
    """The kernel efficiencies and the tensor-parallel costs from the reference workload."""
    measured = fitted.collectives
    fitted = _with_kernel_efficiencies(fitted, measurements, reference_layers, stamp)
    tp_step = measurements.get("reference_tp_step")
    if tp_step and "all_reduce" in measured and any(l.tp_collectives for l in reference_layers):
        collective_s, tensor_s = _tensor_parallel_costs(fitted, tp_step, reference_layers)
        fitted = replace(fitted, tp_collective_overhead_s=collective_s, tp_optimizer_tensor_overhead_s=tensor_s, sources={
            **fitted.sources,
            "tp_collective_overhead_s": f"{stamp}: reference model's tensor-parallel step per micro-batch less its charge, "
                                        "per collective",
            "tp_optimizer_tensor_overhead_s": f"{stamp}: reference model's tensor-parallel step, its optimizer step less "
                                              "the charge for plain tensors, per sharded parameter tensor",
        })
    return fitted


def _with_kernel_efficiencies(fitted: DeviceProfile, measurements: dict[str, Any], reference_layers: Sequence[LayerProfile],
                              stamp: str) -> DeviceProfile:
    """``fitted`` with the kernel efficiencies of the reference workload; see [Note: calibrated fits]."""
    sources = dict(fitted.sources)
    reference = measurements["reference"]
    fwd_eff, bwd_eff = _reference_efficiencies(fitted, reference, reference_layers)
    sources["kernel_efficiency"] = f"{stamp}: forward of profiler/reference_model.py against the layer cost model"
    sources["backward_kernel_efficiency"] = f"{stamp}: backward of profiler/reference_model.py against the layer cost model"
    step = measurements.get("reference_step")
    sync_scale = None
    if step:
        (fwd_scale, bwd_scale), sync_scale = _runtime_fit(
            replace(fitted, kernel_efficiency=fwd_eff, backward_kernel_efficiency=bwd_eff, sources=sources), step, reference_layers)
        fwd_eff, bwd_eff = _clamp(fwd_eff * fwd_scale), _clamp(bwd_eff * bwd_scale)
        apart = ", each pass timed apart" if "passes" in step else ""
        for key, scale in (("kernel_efficiency", fwd_scale), ("backward_kernel_efficiency", bwd_scale)):
            sources[key] += f", times {scale:.3f}: each micro-batch of its training step through the program's runtime{apart}"
        if sync_scale is not None:
            sources["grad_sync_scale"] = (f"{stamp}: profiler/reference_model.py's data-parallel training step, what its "
                                          "gradient all-reduce adds (intercept) against the all-reduce's charge")
    return replace(fitted, kernel_efficiency=fwd_eff, backward_kernel_efficiency=bwd_eff, grad_sync_scale=sync_scale, sources=sources)


def _clamp(efficiency: float) -> float:
    return min(_MAX_EFFICIENCY, max(_MIN_EFFICIENCY, efficiency))


def _runtime_fit(profile: DeviceProfile, step: dict[str, Any], layers: Sequence[LayerProfile]) -> tuple[tuple[float, float], float | None]:
    """((the factors on the forward and backward kernel efficiencies), ``grad_sync_scale``)
    from the reference model's data-parallel training step; see [Note: calibrated fits].
    The slope of the forwards against micro-batches is set against the layers' forward
    charge, and the backwards' against their backward charge, of which only the FLOP and
    byte seconds scale (a record without the passes timed apart sets their sum against
    the sum: one factor on both); the intercept of the forwards, backwards and the
    all-reduce's wait together against one all-reduce of the gradients at the fitted
    alpha and beta (None for one worker, which has no all-reduce)."""
    try:
        batch, workers, dtype = int(step["batch_size"]), int(step["workers"]), step.get("dtype", DType.FP32)
        slopes = [1.0 / fit_line([(float(m), float(compute)) for m, compute, _, _ in step["steps"]])[1]]
        if "passes" in step:
            slopes = [1.0 / fit_line([(float(row[0]), float(row[1 + k])) for row in step["passes"]])[1] for k in (0, 1)]
        sync_s, _ = fit_line([(float(m), float(compute) + float(wait)) for m, compute, wait, _ in step["steps"]])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ProfileError(f"profile measurements: reference_step is malformed ({exc})") from None
    times = [layer_timing(l, profile, tp=1, micro_batch_size=batch, dtype=dtype) for l in layers]
    launch = sum(l.num_ops for l in layers) * (profile.op_overhead_s or 0.0)
    # (charged seconds, of them per-op launches) per micro-batch: forward and backward, or both together
    charges = [(sum(t.fwd_s for t in times), launch), (sum(t.bwd_s for t in times), (LAUNCHES_PER_OP - 1) * launch)]
    if len(slopes) == 1:
        charges = [(charges[0][0] + charges[1][0], LAUNCHES_PER_OP * launch)]
    factors = []
    for (charged, launches), measured in zip(charges, slopes, strict=True):
        if charged - launches <= 0 or measured - launches <= 0:
            raise ProfileError("the reference training step ran faster than its overheads; the machine is too noisy, "
                               "run hetpar profile again")
        factors.append((charged - launches) / (measured - launches))
    if workers == 1:  # no gradient all-reduce to scale
        return (factors[0], factors[-1]), None
    params = sum(l.params for l in layers)
    reduce = profile.collectives.get("all_reduce")
    charged_s = reduce.latency_s + 4.0 * params / reduce.bw_bytes_per_s if reduce else 0.0
    sync_scale = sync_s / charged_s if charged_s > 0 else 1.0
    return (factors[0], factors[-1]), min(_MAX_SYNC_SCALE, max(_MIN_SYNC_SCALE, sync_scale))


def rows_curves(rows: dict[str, list], peak_flops_per_s: float) -> dict[str, dict[int, float]]:
    """Efficiency by row count, forward and backward: each measured rate over the fitted
    peak, clamped to (0, 1] (a large-row rate above the peak slope is noise); see
    [Note: calibrated fits]."""
    def efficiency(flops: float, seconds: float) -> float:
        return min(1.0, max(_MIN_EFFICIENCY, flops / seconds / peak_flops_per_s)) if seconds > 0 else 1.0

    try:
        return {curve: {int(m): efficiency(flops, s) for m, flops, s in rows[curve]} for curve in ("forward", "backward")}
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"profile measurements: matmul_rows is malformed ({exc})") from None


def _reference_efficiencies(profile: DeviceProfile, reference: dict[str, Any], layers: Sequence[LayerProfile]) -> tuple[float, float]:
    """(forward, backward) fractions of the fitted rates that the reference model's
    kernels reach: the layer cost model's FLOP and byte seconds at efficiency 1 over the
    measured seconds less the per-op overheads it charges; see [Note: calibrated fits]."""
    batch, dtype = int(reference["batch_size"]), reference.get("dtype", DType.FP32)
    times = [layer_timing(l, profile, tp=1, micro_batch_size=batch, dtype=dtype, kernel_efficiency=1.0) for l in layers]
    launch = sum(l.num_ops for l in layers) * (profile.op_overhead_s or 0.0)
    fwd_work = sum(t.fwd_s for t in times) - launch
    bwd_work = sum(t.bwd_s for t in times) - 2 * launch
    fwd_left = float(reference["fwd_s"]) - launch
    bwd_left = float(reference["fwd_bwd_s"]) - float(reference["fwd_s"]) - 2 * launch
    if fwd_left <= 0 or bwd_left <= 0 or fwd_work <= 0 or bwd_work <= 0:
        raise ProfileError("the reference model ran faster than its per-op overheads; the machine is too noisy, run hetpar profile again")
    return _clamp(fwd_work / fwd_left), _clamp(bwd_work / bwd_left)


def _tensor_parallel_costs(profile: DeviceProfile, step: dict[str, Any], layers: Sequence[LayerProfile]) -> tuple[float, float]:
    """(seconds per tensor-parallel collective, seconds per sharded parameter tensor and
    optimizer step) that the reference model's tensor-parallel training step takes
    beyond its charge; see [Note: calibrated fits]."""
    try:
        tp, batch = int(step["tp"]), int(step["batch_size"])
        _, microbatches_per_s = fit_line([(float(m), float(compute)) for m, compute, _ in step["steps"]])
        optimizer_s = statistics.median(float(optimizer) for _, _, optimizer in step["steps"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"profile measurements: reference_tp_step is malformed ({exc})") from None
    layer_s = sum(t.fwd_s + t.bwd_s for t in (layer_timing(l, profile, tp=tp, micro_batch_size=batch, dtype=DType.FP32) for l in layers))
    collective_s, collectives = 0.0, 0
    for layer in layers:
        for _, kind, nbytes in layer.tp_collectives:
            name = kind if kind in profile.collectives else "all_reduce"
            collective_s += measured_collective_s(name, profile.collectives[name], nbytes * batch, tp)
            collectives += 1
    per_collective = max(0.0, 1.0 / microbatches_per_s - layer_s - collective_s) / collectives
    plain_s = optimizer_rates(profile).seconds(sum(l.params_at(tp) for l in layers) * OPTIMIZER_BYTES_PER_PARAM[Optimizer.ADAMW],
                                               sum(l.param_tensors for l in layers))
    sharded = sum(l.tp_sharded_tensors for l in layers)
    return per_collective, (max(0.0, optimizer_s - plain_s) / sharded if sharded else 0.0)
