"""What of a plan file may reach a program's text, checked before a line is written.

[Note: plan text]
A plan file travels between people and clusters, and ``hetpar compile`` turns it into
``train.py`` and shell, Slurm and Kubernetes files that run on every rank; a plan file
must never be code. So every string of the plan that reaches those files is checked
to be what hetpar itself writes there, and every value is written into Python with
``repr``:

- layer names and module paths (``model.layer_names``, ``model.leaf_modules``, each
  stage's ``tp_sharding`` keys): module paths as the tracer names them, dotted
  identifiers and indices (``blocks.0``, ``model.embed_tokens``), several joined by
  ``+`` (``tok_emb+pos_emb``);
- device types (``cluster.device_types``, each stage's ``device_type``): names as the
  device profiles and the cluster shorthand spell them (``A100-80GB``, ``cpu``);
- the model file's name: letters, digits, ``_``, ``-`` and ``.``, ending in ``.py``;
- the cluster spec: a shorthand or a cluster file's path, without quotes, backslashes
  or control characters;
- model arguments: identifiers as keys; booleans, integers, finite floats or strings
  without quotes, backslashes or control characters as values;
- schedule, dtype, recompute, compression, aggregation and sync scope: their
  vocabulary's spellings; numbers: integers (booleans for ``compiled``) of the right
  sign, the predicted step time a finite number.

A plan that breaks a rule is refused in one line that names the field and the fix,
before anything is written; the line never repeats the offending text.
"""

from __future__ import annotations

import math
import re
from typing import Any

from hetpar.planner.plan import ParallelPlan
from hetpar.vocabulary import AggregationKind, CompressionKind, DType, Recompute, Schedule, Sharding, SyncScope


class CompileError(Exception):
    """A plan cannot be compiled; the message is one line that says what to do."""


_PART = r"(?:[A-Za-z_][A-Za-z0-9_]*|[0-9]+)"
MODULE_PATH = re.compile(rf"{_PART}(?:\.{_PART})*")  # blocks.0.attn, model.embed_tokens
LAYER_NAME = re.compile(rf"{MODULE_PATH.pattern}(?:\+{MODULE_PATH.pattern})*")  # tok_emb+pos_emb
DEVICE_TYPE = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*")  # as runtime.devices and the cluster shorthand name them
MODEL_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*\.py")  # gpt.py, nano-gpt.v2.py
CLUSTER_SPEC = re.compile(r"[A-Za-z0-9_.+@:/ \-]+")  # 2x8xA100-80GB+1x8xV100-32GB@200gx8, or clusters/lab.toml
SYNC_OPTION = re.compile(r"[a-z0-9.:\-]+")  # powersgd:2, topk:0.01, trimmed-mean:1
_UNSAFE_CHARS = frozenset("'\"\\`")

DTYPE_ALIASES = {"float32": DType.FP32, "bfloat16": DType.BF16, "float16": DType.FP16}  # older plans' spellings
REPLAN = "re-run hetpar plan rather than editing the plan file"


def plan_dtype(plan: ParallelPlan) -> DType:
    """The plan's dtype in the vocabulary's spelling.

    Raises:
        CompileError: not a dtype hetpar trains in.
    """
    value = plan.dtype
    if isinstance(value, str) and value in DTYPE_ALIASES:
        return DTYPE_ALIASES[value]
    if isinstance(value, str) and value in {d.value for d in DType}:
        return DType(value)
    shown = repr(value) if isinstance(value, str) and _plain(value) and len(value) <= 16 else "this value"
    raise CompileError(f"plan dtype {shown} is not one of {', '.join(d.value for d in DType)}; "
                       f"re-run hetpar plan with --dtype")


def check_plan_text(plan: ParallelPlan) -> None:
    """Refuse a plan any of whose strings or numbers could be other than hetpar writes
    them; see [Note: plan text].

    Raises:
        CompileError: one line naming the field and the fix.
    """
    _check_model(plan)
    _check_cluster(plan)
    for field in ("data_parallel", "micro_batch_size", "num_microbatches", "global_batch_size", "sync_every",
                  "virtual_stages"):
        _integer(field, getattr(plan, field), minimum=1)
    _integer("rebalance_every", plan.rebalance_every, minimum=0)
    for d, share in enumerate(plan.replica_batch_shares or []):
        _integer(f"replica_batch_shares[{d}]", share, minimum=1)
    if type(plan.compiled) is not bool:
        raise CompileError(f"plan field compiled must be true or false; {REPLAN}")
    step_time = plan.predicted.step_time_s
    if type(step_time) not in (int, float) or not math.isfinite(step_time):
        raise CompileError(f"plan field predicted.step_time_s must be a finite number; {REPLAN}")
    _one_of("schedule", _value(plan.schedule), Schedule)
    plan_dtype(plan)
    _check_sync_options(plan)
    for s, stage in enumerate(plan.stages):
        _check_stage(s, stage)


def _check_model(plan: ParallelPlan) -> None:
    model = plan.model
    name = str(model.file).replace("\\", "/").rpartition("/")[2]
    if not MODEL_FILE_NAME.fullmatch(name):
        raise CompileError("plan field model.file must name a .py file whose name has only letters, digits, _, - "
                           "and ., e.g. model.py; rename the model file and re-run hetpar plan")
    for i, layer in enumerate(model.layer_names):
        if not isinstance(layer, str) or not LAYER_NAME.fullmatch(layer):
            raise CompileError(f"plan field model.layer_names[{i}] is not a layer name as hetpar's tracer writes it "
                               f"(module paths such as blocks.0 or tok_emb+pos_emb); {REPLAN}")
    for i, path in enumerate(model.leaf_modules):
        if not isinstance(path, str) or not MODULE_PATH.fullmatch(path):
            raise CompileError(f"plan field model.leaf_modules[{i}] is not a module path (e.g. blocks.0.attn); "
                               f"re-run hetpar plan with --leaf-module naming a module of the model")
    for key, value in model.args.items():
        if not isinstance(key, str) or not key.isidentifier() or not key.isascii():
            raise CompileError("plan field model.args has a key that is not a Python identifier; re-run hetpar plan "
                               "with --model-arg name=value, name an argument of build_model()")
        if not _plain_value(value):
            raise CompileError(f"plan field model.args[{key!r}] must be a boolean, an integer, a finite float or a "
                               f"string without quotes, backslashes or control characters; re-run hetpar plan with "
                               f"--model-arg {key}=VALUE")


def _check_cluster(plan: ParallelPlan) -> None:
    cluster = plan.cluster
    if not isinstance(cluster.spec, str) or not CLUSTER_SPEC.fullmatch(cluster.spec):
        raise CompileError("plan field cluster.spec must be a cluster shorthand (e.g. 2x8xA100-80GB) or a cluster "
                           "file's path of letters, digits, spaces and _.+@:/-; re-run hetpar plan with such a --cluster")
    _integer("cluster.world_size", cluster.world_size, minimum=1)
    for r, kind in enumerate(cluster.device_types):
        _device_type(f"cluster.device_types[{r}]", kind)


def _check_sync_options(plan: ParallelPlan) -> None:
    for field, kinds in (("grad_compression", CompressionKind), ("aggregation", AggregationKind)):
        value = getattr(plan, field)
        if not isinstance(value, str) or not SYNC_OPTION.fullmatch(value):
            raise CompileError(f"plan field {field} must be one of {', '.join(k.value for k in kinds)} "
                               f"(some with :N); {REPLAN}")
    _one_of("sync_scope", plan.sync_scope, SyncScope)


def _check_stage(s: int, stage: Any) -> None:
    where = f"stages[{s}]"
    for field in ("index", "tensor_parallel", "zero_stage"):
        _integer(f"{where}.{field}", getattr(stage, field), minimum=0)
    _integer(f"{where}.expert_parallel", stage.expert_parallel, minimum=1)
    _integer(f"{where}.context_parallel", stage.context_parallel, minimum=1)
    for field in ("sequence_parallel", "offload"):
        if type(getattr(stage, field)) is not bool:
            raise CompileError(f"plan field {where}.{field} must be true or false; {REPLAN}")
    for layer in stage.layers:
        _integer(f"{where}.layers", layer, minimum=0)
    for replica in stage.ranks:
        for rank in replica:
            _integer(f"{where}.ranks", rank, minimum=0)
    _device_type(f"{where}.device_type", stage.device_type)
    _one_of(f"{where}.recompute", _value(stage.recompute), Recompute)
    for path, kind in stage.tp_sharding.items():
        if not isinstance(path, str) or not MODULE_PATH.fullmatch(path):
            raise CompileError(f"plan field {where}.tp_sharding has a key that is not a module path (e.g. "
                               f"blocks.0.attn.q); {REPLAN}")
        _one_of(f"{where}.tp_sharding", _value(kind), Sharding)
    for path, parts in stage.tp_parts.items():
        if not isinstance(path, str) or not MODULE_PATH.fullmatch(path) or path not in stage.tp_sharding:
            raise CompileError(f"plan field {where}.tp_parts has a key that is not a module path of its tp_sharding "
                               f"(e.g. blocks.0.attn.c_attn); {REPLAN}")
        if not isinstance(parts, list):
            raise CompileError(f"plan field {where}.tp_parts must map module paths to lists of part sizes; {REPLAN}")
        for size in parts:
            _integer(f"{where}.tp_parts", size, minimum=1)


def _device_type(field: str, value: Any) -> None:
    if not isinstance(value, str) or not DEVICE_TYPE.fullmatch(value):
        raise CompileError(f"plan field {field} is not a device type as the device profiles name them (e.g. "
                           f"A100-80GB, cpu); re-run hetpar plan with a --cluster of such types")


def _integer(field: str, value: Any, *, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise CompileError(f"plan field {field} must be an integer >= {minimum}; {REPLAN}")


def _one_of(field: str, value: Any, names: type) -> None:
    if not isinstance(value, str) or value not in {n.value for n in names}:
        raise CompileError(f"plan field {field} must be one of {', '.join(n.value for n in names)}; {REPLAN}")


def _value(member: Any) -> Any:
    """An enum member's value (a plan loaded from JSON holds enums), anything else as it is."""
    return getattr(member, "value", member)


def _plain(text: str) -> bool:
    return text.isprintable() and not _UNSAFE_CHARS & set(text)


def _plain_value(value: Any) -> bool:
    if type(value) in (bool, int):
        return True
    if type(value) is float:
        return math.isfinite(value)
    return type(value) is str and _plain(value)


__all__ = ["CompileError", "DTYPE_ALIASES", "LAYER_NAME", "MODULE_PATH", "check_plan_text", "plan_dtype"]
