"""The model-file contract: load a user's model file and fill in its optional parts.

A model file is a plain Python file with

- ``build_model(**model_args) -> nn.Module`` (required),
- ``example_inputs(batch_size, **model_args) -> tuple`` (required): the positional
  inputs of ``forward``,
- ``loss_fn(outputs, targets) -> scalar`` (optional, mean over the batch),
- ``batches(batch_size, seed, **model_args)`` (optional): an iterator of
  ``(inputs, targets)`` global batches.

Without ``loss_fn`` the loss is cross-entropy when the output has one more dimension
than integer targets, mean squared error otherwise. Without ``batches`` the data is
deterministic synthetic data shaped like ``example_inputs`` (see [Note: synthetic data]).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from hetpar.runtime.errors import ModelFileError  # noqa: F401  (re-exported: raised here, named by the CLI)
from hetpar.runtime.model_args import parse_model_args  # noqa: F401  (re-exported)


def file_fingerprint(path: str | Path) -> str:
    """sha256 of the model file's bytes, as ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ModelFile:
    """A loaded model file with its model args bound."""

    path: Path
    model_args: dict[str, Any] = field(default_factory=dict)
    module: Any = None

    def build_model(self) -> torch.nn.Module:
        """Build the model; runs under whatever device context the caller set."""
        model = self._call("build_model", self.module.build_model)
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(f"{self.path}: build_model() returned {type(model).__name__}, not torch.nn.Module")
        turn_off_kv_cache(model)
        return model

    def example_inputs(self, batch_size: int) -> tuple:
        """The positional inputs of ``forward`` for ``batch_size`` samples."""
        inputs = self._call("example_inputs", self.module.example_inputs, batch_size)
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if not isinstance(inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise ModelFileError(f"{self.path}: example_inputs() must return a tuple of tensors")
        return inputs

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The model file's ``loss_fn``, or the default loss, of what the model returned
        (a tensor, or the tuple, dict or ModelOutput the model returns, on every rank
        layout; see [Note: the last stage returns what the model returns] in runtime/graph.py)."""
        user_loss = getattr(self.module, "loss_fn", None)
        if user_loss is not None:
            return user_loss(outputs, targets)
        return default_loss(outputs, targets)

    def batches(self, batch_size: int, seed: int, *, rows: range | None = None, start_step: int = 0
                ) -> Iterator[tuple[tuple, torch.Tensor]]:
        """Global batches ``(inputs, targets)`` of steps ``start_step + 1, ...``: the model
        file's, or synthetic ones; with ``rows``, only those rows of each.

        The model file's ``batches`` knows nothing of steps or rows, so it is drawn in
        order from the first batch, the first ``start_step`` are dropped and each batch
        is sliced. Synthetic data makes only the rows asked for, at any step
        ([Note: synthetic data]); either way the rows equal those rows of the global batch.
        """
        user_batches = getattr(self.module, "batches", None)
        if user_batches is None:
            yield from synthetic_batches(self, batch_size, seed, rows=rows, start_step=start_step)
            return
        drawn = self._call("batches", user_batches, batch_size, seed)
        for inputs, targets in itertools.islice(drawn, start_step, None):
            inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
            if rows is not None:
                inputs, targets = tuple(t[rows.start:rows.stop] for t in inputs), targets[rows.start:rows.stop]
            yield inputs, targets

    def _call(self, name: str, fn: Callable, *args: Any) -> Any:
        accepted = inspect.signature(fn).parameters
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        unknown = [k for k in self.model_args if k not in accepted and not takes_kwargs]
        if unknown and name == "build_model":
            raise ModelFileError(
                f"{self.path}: build_model() takes no argument {', '.join(map(repr, unknown))}; "
                f"drop the --model-arg or add the parameter"
            )
        kwargs = {k: v for k, v in self.model_args.items() if k in accepted or takes_kwargs}
        return fn(*args, **kwargs)


# [Note: no KV cache in training]
# A Hugging Face causal LM built from its default config has ``config.use_cache`` True:
# its forward builds a KV cache (a ``DynamicCache``) and returns it with the logits.
# Training never reads it, torch.export cannot return it ("Found <class DynamicCache>
# in output"), and a pipeline stage could not send it. So every model a model file
# builds, for the planner's trace, the generated program and the tests' reference
# alike, gets ``use_cache = False`` in each config it holds, and the program says so
# once on stderr; the model then computes what it computed before, without the cache.
_SAID_NO_CACHE: set[str] = set()  # the model classes already announced in this process


def turn_off_kv_cache(model: torch.nn.Module) -> None:
    """Set ``use_cache = False`` in every config ``model`` and its modules hold; see
    [Note: no KV cache in training]. Says so on stderr, once per process and class."""
    changed = False
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None) is True:
            config.use_cache = False
            changed = True
    name = type(model).__name__
    if changed and name not in _SAID_NO_CACHE:
        _SAID_NO_CACHE.add(name)
        print(f"hetpar: {name}: config.use_cache set to False (training keeps no KV cache)", file=sys.stderr, flush=True)


def load_model_file(path: str | Path, model_args: dict[str, Any] | None = None) -> ModelFile:
    """Import a model file by path and check the contract.

    Raises:
        ModelFileError: missing file, import failure, or missing required functions.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"model file {str(path)!r} not found; pass the path of a Python file that defines build_model()")
    name = "hetpar_model_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"model file {str(path)!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure becomes one line
        del sys.modules[name]
        where = _innermost_line(exc, path)
        raise ModelFileError(f"model file {str(path)!r} failed to import{where}: {type(exc).__name__}: {exc}") from exc
    for required in ("build_model", "example_inputs"):
        if not callable(getattr(module, required, None)):
            raise ModelFileError(f"model file {str(path)!r} defines no {required}(); see docs/model-file.md")
    return ModelFile(path=path, model_args=dict(model_args or {}), module=module)


def _innermost_line(exc: BaseException, path: Path) -> str:
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == path.resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None and isinstance(exc, SyntaxError) and exc.lineno:
        line = exc.lineno
    return f" at line {line}" if line else ""


def first_tensor(outputs: Any) -> torch.Tensor:
    """The first tensor of what a model returns: the tensor itself, else the first
    tensor leaf of its tuple, list, dict or ``ModelOutput`` (the logits of a Hugging
    Face causal LM's ``CausalLMOutput``).

    Raises:
        ModelFileError: the output holds no tensor.
    """
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    if not leaves:
        raise ModelFileError(f"the model returned {type(outputs).__name__} with no tensor in it; return the logits or a "
                             f"tuple, dict or ModelOutput of tensors")
    return leaves[0]


def default_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy when the output (its first tensor: ``first_tensor``) has one more
    dimension than integer ``targets``; mean squared error otherwise. Both are means
    over the batch."""
    outputs = first_tensor(outputs)
    if outputs.dim() == targets.dim() + 1 and not targets.is_floating_point():
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(), targets.reshape(-1))
    return F.mse_loss(outputs.float(), targets.float())


# [Note: synthetic data]
# Without a ``batches`` function the data is deterministic synthetic data, made by
# blocks of rows: rows 16b .. 16b + 15 of the global batch of step k (0-based) are
# drawn together from a torch.Generator seeded with a hash of (seed, k, b), and a
# rank keeps the rows it needs of the blocks they fall in. So any rows of any step are
# made directly, the same on every rank, at one seeding per 16 rows: a data-parallel
# replica makes only its own rows, and a resumed run starts at its step without
# drawing the batches before it. Float inputs are
# standard normal; integer inputs are uniform in [0, max(example) + 1), over
# ``example_inputs(batch_size)`` made under ``seed``, so token ids stay inside the
# example's range. Targets follow the output of the model on the example (computed on
# the meta device, as fake tensors): integer class labels over the last output dimension when the first
# input is integer (token models), standard normal values shaped like the output
# otherwise. Dimension 0 of every input and of the output is the batch.
def synthetic_batches(model_file: ModelFile, batch_size: int, seed: int, *, rows: range | None = None,
                      start_step: int = 0) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Deterministic synthetic global batches (their ``rows``) from step ``start_step + 1``
    on; see [Note: synthetic data]."""
    rows = range(batch_size) if rows is None else rows
    if len(rows) == 0 or rows.step != 1:
        raise ValueError(f"synthetic_batches needs consecutive rows, got {rows}")
    with torch.random.fork_rng(devices=[]):  # neither disturb nor depend on the program's RNG
        torch.manual_seed(seed)
        example = model_file.example_inputs(batch_size)
        with torch.device("meta"):
            model = model_file.build_model()
        with FakeTensorMode(allow_non_fake_inputs=True):  # fake tensors: transformers skips its checks that read values
            out = model(*(t.to("meta") for t in example))
    out = first_tensor(out)
    highs = [max(int(t.max().item()) + 1 if t.numel() else 2, 2) for t in example]
    token_model = not example[0].is_floating_point()
    gen = torch.Generator()
    first_block, last_block = rows[0] // _ROWS_PER_DRAW, rows[-1] // _ROWS_PER_DRAW
    keep = slice(rows[0] - first_block * _ROWS_PER_DRAW, rows[-1] + 1 - first_block * _ROWS_PER_DRAW)
    for step in itertools.count(start_step):
        inputs: list[list[torch.Tensor]] = [[] for _ in example]
        targets = []
        for block in range(first_block, last_block + 1):
            gen.manual_seed(_block_seed(seed, step, block))
            for made, t, high in zip(inputs, example, highs):
                made.append(_like(t, high, gen))
            if token_model:
                targets.append(torch.randint(0, out.shape[-1], (_ROWS_PER_DRAW, *out.shape[1:-1]), generator=gen))
            else:
                targets.append(torch.randn((_ROWS_PER_DRAW, *out.shape[1:]), generator=gen))
        yield tuple(torch.cat(made)[keep] for made in inputs), torch.cat(targets)[keep]


# Rows drawn per generator seeding ([Note: synthetic data]); a constant, so a row's
# values never depend on the batch size or on how the rows are shared out.
_ROWS_PER_DRAW = 16


def _block_seed(seed: int, step: int, block: int) -> int:
    digest = hashlib.blake2b(struct.pack("<qqq", seed, step, block), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2**63 - 1 here


def _like(t: torch.Tensor, high: int, gen: torch.Generator) -> torch.Tensor:
    """``_ROWS_PER_DRAW`` rows shaped like the rows of ``t``."""
    shape = (_ROWS_PER_DRAW, *t.shape[1:])
    if t.is_floating_point():
        return torch.randn(shape, generator=gen, dtype=t.dtype)
    return torch.randint(0, high, shape, generator=gen, dtype=t.dtype)

