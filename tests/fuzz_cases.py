"""Random planner inputs and the invariant every one of them must meet (issue 22).

tests/test_fuzz_planner.py runs a fixed-seed sample of these cases in CI;
benchmarks/fuzz.py runs many more, each in a worker process guarded against hangs.

A ``Case`` is what a user types after ``hetpar plan``: a model file with its args, a
cluster (shorthand or TOML file), a global batch, pins, the objective and the
heterogeneous data-parallel mode. ``run_case`` plans it through the library call that
``hetpar plan`` makes (planner.api.plan_model) and checks the outcome:

- a plan that round-trips through JSON, whose degrees multiply to the world size, that
  fits memory under its own estimate (planner.explain, what ``hetpar explain`` runs),
  with finite predictions, that honours the pins and the throughput target, and that
  ``hetpar compile`` turns into a program; or
- one of the domain errors the CLI prints as one line (hetpar.commands.common), with a
  one-line message.

Anything else raises: an ``InvariantError`` for a broken invariant, or the exception
itself for a crash.
"""

from __future__ import annotations

import functools
import json
import math
import py_compile
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# Model sizes (file, args, traced layer count). Few, so that each traces once per run;
# spanning one-block toys to the 1.3B GPT of the cost-objective command.
MODELS: tuple[tuple[str, tuple[tuple[str, int], ...], int], ...] = (
    ("gpt.py", (("n_layers", 1), ("hidden", 32), ("heads", 2), ("vocab", 64), ("seq_len", 16)), 3),
    ("gpt.py", (("n_layers", 2), ("hidden", 64), ("heads", 4), ("vocab", 128), ("seq_len", 32)), 4),
    ("gpt.py", (("n_layers", 4), ("hidden", 128), ("heads", 4)), 6),
    ("gpt.py", (("n_layers", 6), ("hidden", 256), ("heads", 8), ("vocab", 1000), ("seq_len", 128)), 8),
    ("gpt.py", (("n_layers", 12), ("hidden", 1024), ("heads", 4)), 14),
    ("gpt.py", (("n_layers", 24), ("hidden", 2048), ("heads", 16), ("seq_len", 2048), ("vocab", 51200)), 26),
    ("mlp.py", (("depth", 1),), 2),
    ("mlp.py", (("depth", 3), ("width", 32)), 5),
    ("mlp.py", (("depth", 6), ("width", 1024)), 8),
)
# Built-in device profiles (`hetpar devices`); the GPUs and NPUs weigh more than the CPU.
DEVICES = ("A100-40GB", "A100-80GB", "Ascend910", "Ascend910B", "GH200-96GB", "H100-80GB", "H200-141GB",
           "MI250X", "MI300X", "T4-16GB", "V100-16GB", "V100-32GB", "cpu")
NIC_GBPS = (1, 10, 12.5, 25, 100, 200, 400)
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 256)
THROUGHPUTS = (1.0, 50.0, 1000.0, 1e6)


@dataclass(frozen=True)
class Group:
    """One node group of a cluster."""

    nodes: int
    devices_per_node: int
    device: str
    nic_gbps: float | None = None
    nics_per_node: int | None = None
    intra_node_gbps: float | None = None  # TOML only
    usd_per_device_hour: float | None = None  # TOML only

    def shorthand(self) -> str:
        nic = f"@{self.nic_gbps:g}gx{self.nics_per_node}" if self.nic_gbps is not None else ""
        return f"{self.nodes}x{self.devices_per_node}x{self.device}{nic}"

    def toml(self) -> str:
        lines = ["[[group]]", f"nodes = {self.nodes}", f"devices_per_node = {self.devices_per_node}", f'device = "{self.device}"']
        for key in ("nic_gbps", "nics_per_node", "intra_node_gbps", "usd_per_device_hour"):
            if getattr(self, key) is not None:
                lines.append(f"{key} = {getattr(self, key)!r}")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Case:
    """The inputs of one ``hetpar plan`` command."""

    model: str  # a file name in examples/
    model_args: tuple[tuple[str, int], ...]
    num_layers: int
    groups: tuple[Group, ...]
    toml: bool  # the cluster is given as a TOML file rather than the shorthand
    global_batch: int
    pins: tuple[tuple[str, Any], ...] = ()  # SearchOptions fields the user pinned
    dtype: str | None = None
    objective: str = "time"
    prices: tuple[tuple[str, float], ...] = ()
    min_throughput: float = 0.0
    hetero_dp: str = "auto"

    @property
    def model_path(self) -> Path:
        return EXAMPLES / self.model

    @property
    def world_size(self) -> int:
        return sum(g.nodes * g.devices_per_node for g in self.groups)

    @property
    def shorthand(self) -> str:
        return "+".join(g.shorthand() for g in self.groups)

    def cluster_arg(self, workdir: Path) -> str:
        """What --cluster gets: the shorthand, or a TOML file written into ``workdir``."""
        if not self.toml:
            return self.shorthand
        path = workdir / "cluster.toml"
        path.write_text("\n".join(g.toml() for g in self.groups))
        return str(path)

    def command(self) -> str:
        """The equivalent command line, to report a failing case."""
        parts = ["hetpar", "plan", f"examples/{self.model}"]
        for key, value in self.model_args:
            parts += ["-a", f"{key}={value}"]
        parts += ["-c", "cluster.toml" if self.toml else self.shorthand, "-b", str(self.global_batch)]
        for key, value in self.pins:
            if key == "compiled":
                parts.append("--compile" if value else "--no-compile")
                continue
            flag = "--" + key.replace("_", "-")
            if key in ("stage_layers", "stage_devices"):
                value = ",".join(map(str, value))
            parts += [flag, str(value)]
        if self.dtype:
            parts += ["--dtype", self.dtype]
        if self.objective != "time":
            parts += ["--objective", self.objective]
        for name, usd in self.prices:
            parts += ["--price", f"{name}={usd:g}"]
        if self.min_throughput:
            parts += ["--min-throughput", f"{self.min_throughput:g}"]
        if self.hetero_dp != "auto":
            parts += ["--hetero-dp", self.hetero_dp]
        text = shlex.join(parts)
        if self.toml:
            text += "   # cluster.toml:\n" + "\n".join(g.toml() for g in self.groups)
        return text


# Strategies

@st.composite
def groups(draw, max_groups: int = 3, max_nodes: int = 3) -> tuple[Group, ...]:
    """One to ``max_groups`` node groups: types, node counts, devices per node, NICs."""
    count = min(max_groups, draw(st.sampled_from((1, 1, 2, 2, 3))))
    out = []
    for _ in range(count):
        device = draw(st.sampled_from(DEVICES))
        nic = draw(st.one_of(st.none(), st.tuples(st.sampled_from(NIC_GBPS), st.sampled_from((1, 2, 4, 8)))))
        nodes = min(max_nodes, draw(st.sampled_from((1, 1, 1, 2, 3))))  # small clusters most often: more plans, more pins that bite
        out.append(Group(nodes=nodes, devices_per_node=draw(st.sampled_from((1, 2, 2, 3, 4, 8))),
                         device=device, nic_gbps=nic[0] if nic else None, nics_per_node=nic[1] if nic else None))
    return tuple(out)


def _toml_extras(draw, group: Group, priced: bool) -> Group:
    intra = draw(st.one_of(st.none(), st.sampled_from((16.0, 64.0, 2400.0))))
    usd = draw(st.sampled_from((0.5, 1.8, 3.0))) if priced else None
    return Group(nodes=group.nodes, devices_per_node=group.devices_per_node, device=group.device, nic_gbps=group.nic_gbps,
                 nics_per_node=group.nics_per_node, intra_node_gbps=intra, usd_per_device_hour=usd)


def _composition(draw, total: int) -> tuple[int, ...]:
    """Positive parts summing to ``total`` (or, now and then, to a wrong total)."""
    total = max(1, total + draw(st.sampled_from((0, 0, 0, 0, -1, 1))))
    parts = draw(st.integers(1, min(total, 6)))
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), min_size=parts - 1, max_size=parts - 1, unique=True))) if total > 1 else []
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


@st.composite
def cases(draw, max_groups: int = 3, max_nodes: int = 3, max_world: int | None = None, models=MODELS,
          objectives: tuple[str, ...] = ("time", "time", "time", "cost")) -> Case:
    """A ``hetpar plan`` command a user could type; see the module docstring."""
    model, args, num_layers = draw(st.sampled_from(models))
    cluster = draw(groups(max_groups, max_nodes))
    if max_world is not None:
        while sum(g.nodes * g.devices_per_node for g in cluster) > max_world and len(cluster) > 1:
            cluster = cluster[:-1]
        g = cluster[0]
        if g.nodes * g.devices_per_node > max_world:
            cluster = (Group(nodes=1, devices_per_node=min(g.devices_per_node, max_world), device=g.device,
                             nic_gbps=g.nic_gbps, nics_per_node=g.nics_per_node),)
    types = list(dict.fromkeys(g.device for g in cluster))
    objective = draw(st.sampled_from(objectives))
    toml = draw(st.integers(0, 3)) == 0
    prices: tuple[tuple[str, float], ...] = ()
    if objective == "cost":
        in_file = toml and draw(st.booleans())
        if toml:
            cluster = tuple(_toml_extras(draw, g, in_file) for g in cluster)
        if not in_file:
            named = types if draw(st.integers(0, 5)) else types[:-1]  # now and then a type without a price
            prices = tuple((t, draw(st.sampled_from((0.0, 0.6, 1.8, 4.0)))) for t in named)
    elif toml:
        cluster = tuple(_toml_extras(draw, g, False) for g in cluster)
    pins: dict[str, Any] = {}
    maybe = lambda: draw(st.integers(0, 7)) == 0  # noqa: E731 - each pin now and then
    if maybe():
        pins["dp"] = draw(st.sampled_from((1, 2, 3, 4, 8)))
    if maybe():
        pins["tp"] = draw(st.sampled_from((1, 2, 3, 4, 8)))
    if maybe():
        pins["pp"] = draw(st.integers(1, 5))
    if maybe():
        pins["micro_batch_size"] = draw(st.sampled_from((1, 2, 3, 4, 8)))
    if maybe():
        pins["schedule"] = draw(st.sampled_from(("1f1b", "gpipe", "interleaved", "zb")))
    if maybe():
        pins["virtual_stages"] = draw(st.integers(1, 3))
    if maybe():
        pins["recompute"] = draw(st.sampled_from(("none", "selective", "full")))
    if maybe():
        pins["zero"] = draw(st.integers(0, 3))
    if maybe():
        pins["stage_layers"] = _composition(draw, num_layers)
    if maybe():
        stages = pins.get("pp") or draw(st.integers(1, 4))
        pins["stage_devices"] = tuple(draw(st.sampled_from(types)) for _ in range(stages))
    if maybe():
        pins["max_tp"] = draw(st.sampled_from((1, 2, 4)))
    if maybe():
        pins["compiled"] = draw(st.booleans())
    return Case(
        model=model, model_args=args, num_layers=num_layers, groups=cluster, toml=toml,
        global_batch=draw(st.sampled_from(BATCHES)), pins=tuple(pins.items()),
        dtype=draw(st.sampled_from((None, None, None, None, "fp32", "bf16", "fp16"))),
        objective=objective, prices=prices,
        min_throughput=draw(st.sampled_from(THROUGHPUTS)) if draw(st.integers(0, 2)) == 0 else 0.0,
        hetero_dp=draw(st.sampled_from(("auto", "auto", "auto", "auto", "on", "off"))),
    )


# Running a case

class InvariantError(AssertionError):
    """A plan or an error that breaks the invariant of the module docstring."""


@dataclass(frozen=True)
class Outcome:
    kind: str  # "plan" | "error"
    message: str  # the plan's summary, or the one-line error
    details: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=None)
def _traced(path: str, args: tuple, leaf_modules: tuple):
    from hetpar.planner.capture import trace_model as trace
    from hetpar.runtime.model_file import load_model_file

    return trace(load_model_file(path, dict(args)), leaf_modules)


def cached_trace(model_file, leaf_modules: tuple[str, ...] = ()):
    """planner.trace.trace_model, once per model size: the search and the estimator only read the graph."""
    return _traced(str(model_file.path), tuple(sorted(model_file.model_args.items())), tuple(leaf_modules))


def _traced_in_memory(model_path, model_args, leaf_modules=()):
    """What planner.trace_cache.traced_model returns, from this process's own cache."""
    from hetpar.planner.trace_cache import Traced

    graph = _traced(str(Path(model_path)), tuple(sorted(model_args.items())), tuple(leaf_modules))
    return Traced(graph=graph, cached=True, seconds=0.0)


def use_cached_traces(monkeypatch=None) -> None:
    """Make plan_model and explain_plan trace each model size once in this process (with
    pytest's monkeypatch, or for good), whatever the trace cache on disk holds."""
    from hetpar.planner import api, explain

    for module in (api, explain):
        if monkeypatch is not None:
            monkeypatch.setattr(module, "traced_model", _traced_in_memory)
        else:
            module.traced_model = _traced_in_memory


def check_one_line(exc: BaseException) -> str:
    message = str(exc)
    if not message.strip() or "\n" in message.strip():
        raise InvariantError(f"{type(exc).__name__} is not one line: {message!r}")
    return message


def run_case(case: Case, workdir: Path, *, work_limit_s: float = 1.0, time_limit_s: float | None = None,
             compile_plans: bool = True) -> Outcome:
    """Plan ``case`` as ``hetpar plan`` does and check the outcome; see the module docstring.

    Args:
        work_limit_s, time_limit_s: ``--work-limit`` (CP-SAT's deterministic seconds per candidate: the
            outcome does not depend on the machine) and ``--time-limit`` (a wall-clock net, None: none).

    Raises:
        InvariantError: the plan or the error breaks the invariant.
        Exception: whatever the planner raised that is not a domain error (a crash).
    """
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.cost_models.devices import get_device
    from hetpar.commands.common import DOMAIN_ERRORS, default_compiled, default_dtype
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions
    from hetpar.planner.strategies import Objective

    workdir.mkdir(parents=True, exist_ok=True)
    try:
        cluster = parse_cluster(case.cluster_arg(workdir))
        pins = dict(case.pins)
        if "stage_devices" in pins:
            pins["stage_devices"] = tuple(get_device(name).name for name in pins["stage_devices"])
        pins.setdefault("compiled", default_compiled(cluster.device_types()))
        options = SearchOptions(global_batch_size=case.global_batch, dtype=case.dtype or default_dtype(cluster.device_types()),
                                work_limit_s=work_limit_s, time_limit_s=time_limit_s, **pins)
        objective = Objective(kind=case.objective, usd_per_device_hour={get_device(n).name: usd for n, usd in case.prices},
                              min_throughput_samples_per_s=case.min_throughput)
        plan = plan_model(case.model_path, cluster, options, model_args=dict(case.model_args), objective=objective,
                          hetero_dp=case.hetero_dp)
    except DOMAIN_ERRORS as exc:
        return Outcome("error", check_one_line(exc), {"type": type(exc).__name__})
    details = check_plan(plan, case, cluster, options, workdir, compile_plans=compile_plans)
    return Outcome("plan", plan_line(plan), details)


def plan_line(plan) -> str:
    tps = sorted({s.tensor_parallel for s in plan.stages})
    return (f"dp={plan.data_parallel} tp={'|'.join(map(str, tps))} pp={plan.pipeline_parallel} "
            f"mbs={plan.micro_batch_size}x{plan.num_microbatches} {plan.schedule.value} on {plan.cluster.spec}: "
            f"{plan.predicted.throughput_samples_per_s:.4g} samples/s")


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(what)


def check_plan(plan, case: Case, cluster, options, workdir: Path, *, compile_plans: bool = True) -> dict:
    """The plan half of the invariant; returns a few facts for the report."""
    from hetpar.commands.common import console
    from hetpar.commands.plan import print_summary
    from hetpar.planner.explain import explain_plan, timeline_svg
    from hetpar.planner.plan import ParallelPlan

    # Round trip through JSON, in memory and through a file.
    text = plan.to_json()
    _require(ParallelPlan.from_dict(json.loads(text)).to_json() == text, "the plan does not round-trip through JSON")
    path = workdir / "plan.json"
    plan.save(path)
    loaded = ParallelPlan.load(path)
    _require(loaded.to_json() == text, "the saved plan does not load back the same")
    # Degrees: every device runs one stage replica.
    world = plan.cluster.world_size
    ranks = plan.stages[: plan.pipeline_parallel]
    # each stage's rows (dp x cp replicas, each of its own tensor-parallel degree) hold every device once
    every = sorted(r for s in ranks for replica in s.ranks for r in replica)
    _require(every == list(range(world)) and world == len(plan.cluster.device_types),
             f"the stages' ranks {every} (replicas of {[[len(r) for r in s.ranks] for s in ranks]} over "
             f"pp({plan.pipeline_parallel})) are not each of the {world} devices once")
    if case.objective == "time":
        _require(world == cluster.world_size and plan.cluster.device_types == cluster.device_types(),
                 f"the plan's cluster ({plan.cluster.spec}) is not the cluster asked for ({cluster.spec})")
    else:
        have = cluster.count_by_type()
        _require(all(plan.cluster.device_types.count(t) <= have.get(t, 0) for t in set(plan.cluster.device_types)),
                 f"the sub-cluster {plan.cluster.spec} uses devices {cluster.spec} lacks")
    # Finite predictions.
    p = plan.predicted
    times = [p.step_time_s, p.compute_time_s, p.bubble_time_s, p.dp_comm_time_s, p.pp_comm_time_s, p.tp_comm_time_s]
    _require(all(math.isfinite(t) and t >= 0 for t in times) and p.step_time_s > 0, f"predicted times not finite and >= 0: {times}")
    _require(math.isfinite(p.throughput_samples_per_s) and p.throughput_samples_per_s > 0,
             f"predicted throughput {p.throughput_samples_per_s}")
    _require(math.isclose(p.throughput_samples_per_s, plan.global_batch_size / p.step_time_s, rel_tol=1e-6),
             f"throughput {p.throughput_samples_per_s} != global batch / step {plan.global_batch_size / p.step_time_s}")
    _require(len(p.peak_memory_bytes) == plan.pipeline_parallel and all(math.isfinite(m) and m >= 0 for m in p.peak_memory_bytes),
             f"predicted peak memory {p.peak_memory_bytes}")
    # Work that happens is counted, and no prediction beats the devices' peak: the model's FLOPs per step over the
    # predicted step are at most the cluster's peak rate at the plan's precision (MFU <= 1).
    _require(p.model_flops_per_step > 0 and p.peak_flops_per_s > 0,
             f"predicted model FLOPs per step {p.model_flops_per_step}, peak {p.peak_flops_per_s}: zero for work that happens")
    _require(p.model_flops_per_step / p.step_time_s <= p.peak_flops_per_s * (1 + 1e-9),
             f"predicted {p.model_flops_per_step / p.step_time_s:.4g} FLOP/s, above the cluster's peak {p.peak_flops_per_s:.4g}")
    _require(p.throughput_samples_per_s >= case.min_throughput,
             f"throughput {p.throughput_samples_per_s:.4g} below --min-throughput {case.min_throughput:g}")
    _check_pins(plan, case, options)
    # Memory, under the plan's own prediction and under hetpar explain's estimate.
    if plan.replica_batch_shares is None:
        for s in ranks:
            types = {plan.cluster.device_types[r] for rep in s.ranks for r in rep}
            capacity = min(cluster.profile(t).memory_bytes for t in types)
            _require(p.peak_memory_bytes[s.index] <= capacity,
                     f"stage {s.index} predicted {p.peak_memory_bytes[s.index]} bytes on {sorted(types)}, which hold {capacity}")
    with console.capture():
        print_summary(plan, path)
    explained = explain_plan(loaded).estimate
    _require(explained.fits, f"hetpar explain says the plan does not fit: {explained.misfit() if not explained.fits else ''}")
    e = explained.predicted
    _require(math.isfinite(e.step_time_s) and e.step_time_s > 0 and all(math.isfinite(m) for m in e.peak_memory_bytes),
             f"explain's estimate is not finite: step {e.step_time_s}, memory {e.peak_memory_bytes}")
    timeline_svg(explained.timeline, [f"stage {s.index}" for s in plan.stages], "fuzz")
    if compile_plans:
        from hetpar.rewriters.torchrun import compile_plan

        written = compile_plan(loaded, workdir / "build")
        train = workdir / "build" / "train.py"
        _require(train in written and train.is_file(), f"compile wrote {written}, no train.py")
        py_compile.compile(str(train), doraise=True)
    return {"world": world, "hetero_dp": plan.replica_batch_shares is not None, "step_time_s": p.step_time_s,
            "explain_step_time_s": e.step_time_s}


def _check_pins(plan, case: Case, options) -> None:
    pins = dict(case.pins)
    stages = plan.stages
    ranks = stages[: plan.pipeline_parallel]
    hetero = plan.replica_batch_shares is not None
    checks = {
        "dp": plan.data_parallel,
        "tp": None if len({s.tensor_parallel for s in stages}) > 1 else stages[0].tensor_parallel,
        "pp": plan.pipeline_parallel,
        "micro_batch_size": None if hetero else plan.micro_batch_size,
        "schedule": plan.schedule.value,
        "virtual_stages": plan.virtual_stages,
        "stage_layers": tuple(len(s.layers) for s in stages),
        "stage_devices": tuple(s.device_type for s in ranks),
        "compiled": plan.compiled,
    }
    for name, got in checks.items():
        if name in pins:
            want = options.stage_devices if name == "stage_devices" else pins[name]
            _require(got == want, f"--{name.replace('_', '-')} {want} pinned, the plan has {got}")
    if "recompute" in pins:
        _require(all(s.recompute == pins["recompute"] for s in stages), f"--recompute {pins['recompute']} pinned, the plan has "
                 f"{[s.recompute for s in stages]}")
    if "zero" in pins and plan.data_parallel > 1:
        _require(all(s.zero_stage == pins["zero"] for s in stages), f"--zero {pins['zero']} pinned, the plan has {[s.zero_stage for s in stages]}")
    if "max_tp" in pins:
        _require(all(s.tensor_parallel <= pins["max_tp"] for s in stages), f"--max-tp {pins['max_tp']}, the plan has "
                 f"{[s.tensor_parallel for s in stages]}")
