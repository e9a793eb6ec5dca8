"""Capture a model as one fx graph: torch.fx first, torch.export where fx cannot.

[Note: two ways to capture]
``torch.fx.symbolic_trace`` runs ``forward`` on proxies. Its graph calls the model's own
modules (``call_module blocks.0.attn.q``), so a stage cut from it holds the original
``nn.Linear`` objects at their original qualified names, which is what tensor
parallelism (DTensor ``parallelize_module``) and checkpoints need. It fails on Python
control flow over tensor values and on code that inspects its own frames, which is
most of Hugging Face transformers 5.x.

``torch.export.export`` (non-strict) runs ``forward`` on fake tensors with real
Python, so control flow over shapes is fine. Its training IR, unlifted with
``ep.module()``, is an fx graph of ATen ops whose parameters are ``get_attr`` nodes at
their original qualified names; the module of each op is recorded in
``node.meta["nn_module_stack"]``. Export needs example inputs and is done on whatever
device the model and inputs live on (``meta`` when planning). Its graph has no module
calls, so tensor parallelism cannot be applied to it by module path.

When both fail, [Note: where tracing failed] turns the two exceptions into one line.

[Note: where tracing failed]
Both tracers run the model's Python, so the traceback of a failure passes through the
``forward`` of the module that failed. The innermost frame whose ``self`` is a module
of the model names it (``transformer.h.0.attn``), and the innermost frame outside torch
gives the source line; making that module a leaf (``--leaf-module PATH``) keeps torch.fx
out of it.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from hetpar.runtime.errors import TraceError  # noqa: F401  (re-exported: raised here, named by the CLI)
from hetpar.runtime.experts import is_experts

# Frames in these directories are the tracers' own, never the model's.
_TRACER_DIRS = (str(Path(torch.__file__).resolve().parent) + os.sep, str(Path(__file__).resolve().parent) + os.sep)
# Export inserts these: an input-guard module and metadata assertions. They run no
# kernel, and the assertions pin the device of the export (meta when planning).
_ASSERTION_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


class _Tracer(fx.Tracer):
    def __init__(self, leaf_modules: tuple[str, ...]):
        super().__init__()
        self.leaf_modules = set(leaf_modules)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        # a module of experts is one call in the graph, so that the program can split it ([Note: the experts contract])
        return qualname in self.leaf_modules or is_experts(m) or super().is_leaf_module(m, qualname)

    # [Note: buffers as graph values]
    # torch.fx proxies a module's parameters when forward reads them, but hands forward its
    # buffers as the tensors themselves, so a buffer indexed by a shape
    # (``self.bias[:, :, :T, :T]``, nanoGPT's causal mask) fails with "slice indices must be
    # integers" and the model fell back to torch.export, without tensor parallelism. A
    # buffer read in forward is a get_attr node here, as a parameter is.
    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if isinstance(attr_val, torch.Tensor) and not isinstance(attr_val, nn.Parameter):
            if not hasattr(self, "_buffer_names"):
                self._buffer_names = {id(b): name for name, b in self.root.named_buffers()}
            name = self._buffer_names.get(id(attr_val))
            if name is not None:
                return self.create_proxy("get_attr", name, (), {})
        return super().getattr(attr, attr_val, parameter_proxy_cache)


class TracerFailed(TraceError):
    """One tracer failed; ``failure`` says where."""

    def __init__(self, failure: Failure):
        super().__init__(failure.describe())
        self.failure = failure


@dataclass(frozen=True)
class Failure:
    """One tracer's failure, located; see [Note: where tracing failed]."""

    tracer: str
    error: BaseException
    module: str | None  # qualified name of the innermost failing module; "" is the root
    source: str | None  # "file.py:123"

    def describe(self) -> str:
        where = []
        if self.module:
            where.append(f"in {self.module}")
        elif self.module == "":
            where.append("in the model's own forward")
        if self.source:
            where.append(f"at {self.source}")
        return " ".join([f"{self.tracer} failed", *where]) + f": {_first_line(self.error)}"


def fx_trace(model: nn.Module, leaf_modules: tuple[str, ...] = ()) -> fx.GraphModule:
    """Symbolically trace ``model`` with torch.fx, keeping ``leaf_modules`` opaque.

    Raises:
        TracerFailed: torch.fx cannot trace the model.
        TraceError: a leaf module is not a module of the model.
    """
    unknown = [p for p in leaf_modules if not _has_submodule(model, p)]
    if unknown:
        raise TraceError(f"--leaf-module {unknown[0]!r} is not a module of {type(model).__name__}")
    try:
        graph = _Tracer(leaf_modules).trace(model)
    except Exception as exc:  # noqa: BLE001 - located and reported as one line
        raise TracerFailed(failure_site("torch.fx", exc, model)) from exc
    return fx.GraphModule(model, graph, class_name=type(model).__name__)


def export_graph(model: nn.Module, example_inputs: tuple) -> fx.GraphModule:
    """Export ``model`` (non-strict) on the device of its parameters and unlift it.

    Raises:
        TracerFailed: torch.export cannot export the model.
    """
    device = next((p.device for p in model.parameters()), None)
    inputs = tuple(t.to(device) if device is not None and isinstance(t, torch.Tensor) else t for t in example_inputs)
    try:
        with quiet_torch_logs():
            ep = torch.export.export(model, inputs, strict=False)
            gm = ep.module()
    except Exception as exc:  # noqa: BLE001 - located and reported as one line
        raise TracerFailed(failure_site("torch.export", exc, model)) from exc
    _strip_export_checks(gm)
    return gm


def capture(model: nn.Module, leaf_modules: tuple[str, ...] = (), example_inputs: tuple | None = None) -> tuple[fx.GraphModule, str]:
    """The model's graph and how it was captured (``"fx"`` or ``"export"``); see [Note: two ways to capture].

    Raises:
        TraceError: neither tracer works; one line naming the module and source line.
    """
    try:
        return fx_trace(model, leaf_modules), "fx"
    except TracerFailed as fx_error:
        fx_failure = fx_error.failure
        if example_inputs is None:
            raise TraceError(_message(model, fx_failure, None)) from fx_error
    try:
        return export_graph(model, example_inputs), "export"
    except TracerFailed as export_error:
        raise TraceError(_message(model, fx_failure, export_error.failure)) from export_error


@contextlib.contextmanager
def quiet_torch_logs():
    """Silence torch's loggers and stderr: a failed export prints its partial graph, and
    the failure is reported as one line instead."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.split(".")[0] == "torch"]
    saved = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, was in zip(loggers, saved):
            lg.disabled = was


# [Note: data-dependent ops on meta]
# A meta tensor has a shape and no values. An op whose output's size depends on the
# values (torch.nonzero, torch.masked_select, torch.where(condition), boolean-mask
# indexing, torch.unique) or that hands a value to Python (.item(), .tolist()) cannot
# run on it, and counting it as no work would hide the work that follows it: a mixture
# of experts written as a loop over its experts, each run on the rows that chose it,
# would cost only its router. So hetpar stops with one line that names the op, the
# module that calls it and the fix, the experts contract ([Note: the experts contract]
# in runtime/experts.py), whose module hetpar counts from the routing. The op is named
# by the graph node that failed where a captured graph runs on meta (runtime.graph
# ``meta_run_error``), by the error, or by the failing source line where a tracer
# failed on it (a loop over ``.tolist()``, a branch on ``.item()``).
DATA_DEPENDENT_OPS = {  # op or method name -> how the message names it
    "nonzero": "torch.nonzero", "nonzero_static": "torch.nonzero", "argwhere": "torch.argwhere",
    "masked_select": "torch.masked_select", "unique": "torch.unique", "_unique2": "torch.unique",
    "unique_consecutive": "torch.unique_consecutive", "unique_dim": "torch.unique", "item": ".item()",
    "_local_scalar_dense": ".item()", "tolist": ".tolist()",
}
# A module of experts whose own forward selects each expert's rows (transformers' "eager" experts).
_EXPERTS_LOOP = ("is a module of experts whose forward selects each expert's rows by their values, which no tracer "
                 "can follow on the meta device: give it a forward without data-dependent shapes (rows sorted by "
                 "expert, torch.nn.functional.grouped_mm: examples/moe_gpt.py), or build a Hugging Face model with "
                 "experts_implementation 'grouped_mm' (its default) or 'batched_mm'")
BOOLEAN_MASK = "x[mask]"  # indexing with a boolean mask (it runs torch.nonzero)
_SIZE_ONLY = ("nonzero", "argwhere", "masked_select", "unique")  # ops whose output size, not value, is the data's
EXPERTS_FIX = ("write the experts as one module called experts(hidden, top_k_index, top_k_weights) "
               "(docs/model-file.md, 'Mixtures of experts')")


def data_dependent_message(module: str | None, op: str) -> str:
    """The line for ``module`` calling the data-dependent ``op``; see [Note: data-dependent ops on meta]."""
    where = module or "the model's own forward"
    if op == BOOLEAN_MASK:
        return (f"{where} indexes a tensor with a boolean mask, whose result's size depends on the data, so hetpar "
                f"cannot measure it on the meta device: {EXPERTS_FIX}")
    what = "output size" if any(name in op for name in _SIZE_ONLY) or "where" in op else "value"
    return (f"{where} calls {op}, whose {what} depends on the data, so hetpar cannot measure it on the meta "
            f"device: {EXPERTS_FIX}")


def data_dependent_op(exc: BaseException, node: fx.Node | None = None) -> str | None:
    """The data-dependent op that ``exc`` failed on, named by the graph ``node`` that
    raised it, else by the failing source line, else (ops that make data-dependent
    shapes) by the error; None for other failures, a branch on a value among them. See
    [Note: data-dependent ops on meta]."""
    text = f"{type(exc).__name__}: {exc}"
    sized = next((DATA_DEPENDENT_OPS[name] for name in _SIZE_ONLY if re.search(rf"\b{name}\b", text)), None)
    if node is not None:
        target = node.target
        name = target._overloadpacket.__name__ if isinstance(target, torch._ops.OpOverload) else (
            target if isinstance(target, str) else getattr(target, "__name__", ""))
        if name == "where" and len(node.args) + len(node.kwargs) == 1:
            return "torch.where(condition)"
        if name in DATA_DEPENDENT_OPS:
            return DATA_DEPENDENT_OPS[name]
        if name in ("getitem", "index", "__getitem__") and sized == DATA_DEPENDENT_OPS["nonzero"]:
            return BOOLEAN_MASK
    return _data_dependent_call(exc) or sized


def _data_dependent_call(exc: BaseException) -> str | None:
    """The data-dependent call on the model's source line where a tracer failed
    (``.tolist()``, ``.item()``, ``torch.nonzero``...), None if it calls none."""
    line = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        filename = frame.f_code.co_filename
        if not str(Path(filename).resolve()).startswith(_TRACER_DIRS) and not filename.startswith("<"):
            line = linecache.getline(filename, lineno)
    return next((label for name, label in DATA_DEPENDENT_OPS.items() if re.search(rf"\b{name}\(", line)), None)


def failure_site(tracer: str, exc: BaseException, model: nn.Module) -> Failure:
    """Find the module and source line where tracing failed; see [Note: where tracing failed]."""
    names = {id(m): name for name, m in model.named_modules()}
    module, source = None, None
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            module = names[id(owner)]
        filename = frame.f_code.co_filename
        if not str(Path(filename).resolve()).startswith(_TRACER_DIRS) and not filename.startswith("<"):
            source = f"{Path(filename).name}:{lineno}"
    return Failure(tracer=tracer, error=exc, module=module, source=source)


def _message(model: nn.Module, fx_failure: Failure, export_failure: Failure | None) -> str:
    """One line that names the cause first: an output torch.export cannot return, else
    torch.export's failure (it ran the model's real Python) before torch.fx's; then the fix."""
    culprit = (export_failure.module if export_failure else None) or fx_failure.module
    failures = f"{export_failure.describe()}; {fx_failure.describe()}" if export_failure else fx_failure.describe()
    unreturnable = _unreturnable_output(export_failure.error) if export_failure else None
    if unreturnable:
        cause = (f"forward's output holds a value of type {unreturnable}, which torch.export cannot return: return "
                 f"tensors (in tuples, lists, dicts or ModelOutputs){_CACHE_HINT if 'Cache' in unreturnable else ''}")
        return f"cannot trace {type(model).__name__}: {cause}; {failures}"
    called = _data_dependent_call((export_failure or fx_failure).error)
    if data_dependent((export_failure or fx_failure).error) and culprit and is_experts(model.get_submodule(culprit)):
        return f"cannot trace {type(model).__name__}: {culprit} {_EXPERTS_LOOP}; {failures}"
    if called and data_dependent((export_failure or fx_failure).error):
        return f"cannot trace {type(model).__name__}: {data_dependent_message(culprit, called)}; {failures}"
    if data_dependent((export_failure or fx_failure).error):
        where = f"{culprit} " if culprit else ""
        hint = (f"{where}branches on tensor values, which no tracer can follow on the meta device: branch on shapes "
                f"or config instead (--leaf-module only helps a module that runs on meta tensors)")
    elif culprit:
        hint = f"mark the failing module opaque with --leaf-module {culprit}"
    else:
        hint = "mark the failing submodule opaque with --leaf-module PATH"
    return f"cannot trace {type(model).__name__}: {failures}; {hint}"


# hetpar turns the KV cache off in the configs a model file's model holds ([Note: no KV
# cache in training] in runtime/model_file.py); a cache still returned comes from a
# model built another way or a flag of another name.
_CACHE_HINT = " (a KV cache: build the model with use_cache=False)"


def _unreturnable_output(exc: BaseException) -> str | None:
    """The type torch.export found in the output and cannot flatten, from its message
    ``Found <class 'X'> in output, which is not a known type``; None for other errors."""
    match = re.search(r"Found <class '([^']+)'> in output", str(exc))
    return match.group(1).rpartition(".")[2] if match else None


def data_dependent(exc: BaseException) -> bool:
    """True if ``exc`` says the code read a tensor's value (``.item()``, ``if`` on a tensor)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("DataDependent", "data-dependent", "cannot be called on meta tensors"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0].strip() if text else ""
    line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def _has_submodule(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _strip_export_checks(gm: fx.GraphModule) -> None:
    """Drop the input guard and metadata assertions that export adds; see ``_ASSERTION_OPS``."""
    for node in list(gm.graph.nodes):
        guard = node.op == "call_module" and str(node.target) == "_guards_fn"
        if (guard or (node.op == "call_function" and node.target in _ASSERTION_OPS)) and not node.users:
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def module_path(node: fx.Node) -> str:
    """Qualified name of the innermost module a node ran in; "" for the root."""
    paths = module_paths(node)
    return paths[-1] if paths else ""


def module_paths(node: fx.Node) -> list[str]:
    """Qualified names of the modules a node ran in, outermost first.

    fx records ``nn_module_stack`` as ``{key: (path, type)}`` and export as the same
    with different keys; older fx versions as ``{path: type}``. A ``call_module`` or
    ``get_attr`` node also names its target.
    """
    paths: list[str] = []
    for key, value in node.meta.get("nn_module_stack", {}).items():
        path = value[0] if isinstance(value, tuple) else key
        if path and path not in paths:
            paths.append(path)
    if node.op == "call_module":
        paths.append(str(node.target))
    elif node.op == "get_attr":
        paths.append(str(node.target).rpartition(".")[0])
    return paths


def attribute(module: nn.Module, path: str) -> Any:
    """What a ``get_attr`` node at ``path`` reads: the parameter, buffer or constant of ``module``."""
    owner, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


__all__ = ["BOOLEAN_MASK", "DATA_DEPENDENT_OPS", "EXPERTS_FIX", "Failure", "attribute", "TraceError", "TracerFailed", "capture",
           "data_dependent", "data_dependent_message", "data_dependent_op", "export_graph", "fx_trace", "failure_site", "module_path", "module_paths",
           "quiet_torch_logs"]
