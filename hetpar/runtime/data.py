"""Training data from a flat token file or a dataset directory (``--data``), behind the
model file's ``batches``.

[Note: token data]
A token file is what nanoGPT's ``prepare.py`` writes as ``train.bin``: token ids one
after another, uint16 (``--data-dtype uint16``, the default) or uint32, no header. The
program maps it with ``np.memmap`` and reads only the tokens of the rows it trains on.
``hetpar data`` makes one from text with a local tokenizer (runtime/prepare.py, [Note:
making a token file]) through ``TokenFileWriter``, which renames a complete file into place.

A **dataset directory** is read as one token stream too: a directory that Hugging Face
``datasets``' ``save_to_disk`` wrote (Arrow IPC stream files ``data-*.arrow``, in the order
of its ``state.json``), or one of ``*.parquet`` files (in name order), with a column
(``--data-column``, default ``input_ids``) holding one tokenised document per row as a list
of integers. The rows' lists, concatenated in row order, are the stream, as ``run_clm``'s
``group_texts`` concatenates them: no EOS is added (a tokenizer that ends documents with
one has put it in the column). From there the stream is cut, ordered, sharded and checked
exactly as a token file's, so everything below holds for both. The cost: at open the
column's ids are copied into one numpy array of the column's integer type (int32 or
int64 as tokenizers write them: 4-8 bytes a token, so in memory on every rank, where a
token file's uint16 pages are shared); Parquet files are decoded first, so while opening
they take about twice that. Reading Arrow and Parquet needs pyarrow (the ``hf`` extra),
imported only for a directory.

- **Sequences.** With T the model's sequence length (the second dimension of the model
  file's ``example_inputs(1)``), sequence j is the T + 1 tokens ``[jT, jT + T + 1)``:
  its inputs are the first T, its targets the last T (``inputs = tokens[:-1]``,
  ``targets = tokens[1:]``, as nanoGPT's ``get_batch``). Consecutive sequences share
  one token, so a file of N tokens holds ``(N - 1) // T`` of them and every token but a
  tail shorter than T + 1 is a target once per epoch.
- **Order.** Row r of the global batch of step k (1-based) is sample
  ``i = (k - 1) B + r`` of an endless stream, B the global batch size. Sample i is
  sequence ``perm_e[i mod n]`` of epoch ``e = i // n``, where ``perm_e`` is
  ``torch.randperm(n)`` under a generator seeded with a hash of (seed, e): the order is
  a function of ``--seed`` and the file alone, epochs wrap with a fresh permutation,
  and no sequence repeats within an epoch. It is not nanoGPT's order (random offsets,
  drawn with replacement); a seeded permutation is what makes the next two points
  cheap.
- **Rows.** Any rows of any step are computed directly, so a data-parallel replica
  reads only its own rows (``rows=``, the contract of ``ModelFile.batches``; [Note:
  data order and sharding] in runtime/shard.py), and a run resumed after step k starts
  at sample kB without reading or replaying what came before.
- **Checks before training** (``DataError``, one line): the file exists; its size is a
  whole number of tokens. A directory holds Arrow or Parquet files, pyarrow is installed,
  the column exists (the message names the columns there) and is a list of integers with
  no null ids, and no id is negative. Then, for both: at least one global batch of
  sequences; the model
  takes one integer input of shape ``[batch, T]``; no token id reaches the model's
  vocabulary (the rows of its input embedding): the maximum over the whole file when
  it is at most ``_FULL_CHECK_TOKENS`` tokens, else over ``_CHECK_BLOCKS`` blocks spread
  through it. Each batch's ids are checked again as they are read (a max over its own
  rows), so an id that a sampled check missed stops the run at that step, never as an
  out-of-range index deep in an embedding.

**Held-out data** (``--eval-data``, a token file or directory of the same kind, read with
the same ``--data-dtype`` and ``--data-column``) is cut into sequences alike, but read in
file order, not permuted: held-out global batch b holds sequences ``[bB, bB + B)``, each
replica its own rows of it, so every evaluation of a run (and of another run, under any
plan) averages the same sequences ([Note: held-out loss] in runtime/training.py).

``token_model_file`` wraps the program's model file so that its ``batches`` reads the
token file: every consumer of ``batches`` (``shard.replica_batches``,
``rebalance.ReplicaShares``, ``context.split_batches`` after them) works unchanged, and
so do pipelines, tensor, context and expert parallelism.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn as nn

from hetpar.runtime.errors import DataError  # noqa: F401  (re-exported: raised here, named by the CLI)
from hetpar.runtime.model_file import ModelFile

# The token widths a file may hold (--data-dtype): nanoGPT writes uint16 for vocabularies
# below 65536 (GPT-2's 50257), uint32 fits any other.
TOKEN_DTYPES = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}

# A file of up to this many tokens has its maximum id checked in full (one pass over
# the page cache, ~1 GiB of uint16); a larger one in _CHECK_BLOCKS blocks of
# _CHECK_BLOCK_TOKENS, spread evenly ([Note: token data]).
_FULL_CHECK_TOKENS = 1 << 29
_CHECK_BLOCKS = 256
_CHECK_BLOCK_TOKENS = 1 << 16


@dataclass(frozen=True, kw_only=True)
class TokenFile:
    """A flat token file cut into sequences of ``seq_len + 1`` tokens; see [Note: token data]."""

    path: Path
    tokens: np.ndarray  # the token stream: the file memory-mapped, or a dataset's column copied into memory
    seq_len: int  # T: the model's sequence length; a sequence holds T + 1 tokens
    vocab_size: int  # ids must be below it
    _orders: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, path: str | Path, *, dtype: str = "uint16", column: str = "input_ids", seq_len: int,
             vocab_size: int, global_batch_size: int) -> TokenFile:
        """Map ``path``, or read a dataset directory's column, and check it before training
        ([Note: token data]).

        Args:
            path: the token file, or a dataset directory (Arrow files of ``save_to_disk``, or Parquet).
            dtype: ``uint16`` or ``uint32`` (``TOKEN_DTYPES``); a directory's column gives its own.
            column: a directory's column of token-id lists.
            seq_len: the model's sequence length T.
            vocab_size: the model's vocabulary; every id must be below it.
            global_batch_size: sequences per step; the file must hold at least that many.

        Raises:
            DataError: the file is missing, not a whole number of tokens, too short for
                one global batch, or holds an id of ``vocab_size`` or more; a directory
                has no such column of integer lists, or no Arrow or Parquet files.
        """
        path = Path(path)
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"--data-dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
        if path.is_dir():
            tokens = _dataset_tokens(path, column)
            dtype = tokens.dtype.name
        else:
            tokens = _file_tokens(path, dtype)
        found = cls(path=path, tokens=tokens, seq_len=seq_len, vocab_size=vocab_size)
        if found.num_sequences < global_batch_size:
            raise DataError(f"--data {path} holds {len(tokens)} {dtype} tokens, {found.num_sequences} sequences of "
                            f"{seq_len} + 1, fewer than one global batch of {global_batch_size}")
        top = found._max_id()
        if top >= vocab_size:
            hint = "was the column" if path.is_dir() else "is --data-dtype right, and was the file"
            raise DataError(f"--data {path} holds token id {top}, but the model's vocabulary has {vocab_size} ids "
                            f"(0-{vocab_size - 1}); {hint} made with this model's tokenizer?")
        return found

    @property
    def num_sequences(self) -> int:
        """n: the sequences of T + 1 tokens, one token shared between neighbours."""
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def _max_id(self) -> int:
        """The largest id of the file, or of ``_CHECK_BLOCKS`` blocks spread through a large one."""
        n = len(self.tokens)
        if n <= _FULL_CHECK_TOKENS:
            return int(self.tokens.max())
        starts = np.linspace(0, n - _CHECK_BLOCK_TOKENS, _CHECK_BLOCKS).astype(np.int64)
        return max(int(self.tokens[s:s + _CHECK_BLOCK_TOKENS].max()) for s in starts)

    def order(self, seed: int, epoch: int) -> torch.Tensor:
        """``perm_e``: the sequences of epoch ``epoch`` in the order they are trained."""
        key = (seed, epoch)
        if key not in self._orders:
            if len(self._orders) >= 2:  # a step spans at most two epochs (B <= n)
                self._orders.pop(min(self._orders, key=lambda k: k[1]))
            gen = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
            self._orders[key] = torch.randperm(self.num_sequences, generator=gen)
        return self._orders[key]

    def sequences(self, seed: int, samples: range) -> torch.Tensor:
        """The sequences of samples ``samples`` of the stream, ``[len(samples), T + 1]`` int64."""
        n = self.num_sequences
        return self._windows([int(self.order(seed, i // n)[i % n]) for i in samples])

    def _windows(self, chosen: list[int], flag: str = "--data") -> torch.Tensor:
        """Sequences ``chosen`` (their T + 1 tokens each), ``[len(chosen), T + 1]`` int64,
        their ids checked against the vocabulary ([Note: token data])."""
        width = self.seq_len + 1
        out = np.empty((len(chosen), width), dtype=np.int64)
        for row, j in enumerate(chosen):
            out[row] = self.tokens[j * self.seq_len:j * self.seq_len + width]
        if out.size and int(out.max()) >= self.vocab_size:
            raise DataError(f"{flag} {self.path} holds token id {int(out.max())} in sequence(s) "
                            f"{sorted(set(chosen))[:4]}, but the model's vocabulary has {self.vocab_size} ids")
        return torch.from_numpy(out)

    def batches(self, batch_size: int, seed: int, *, rows: range | None = None, start_step: int = 0
                ) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
        """``(inputs, targets)`` of the ``rows`` of global batches ``start_step + 1, ...``;
        the contract of ``ModelFile.batches`` ([Note: token data])."""
        rows = range(batch_size) if rows is None else rows
        if rows.step != 1 or rows.start < 0 or rows.stop > batch_size:
            raise ValueError(f"rows {rows} are not consecutive rows of a batch of {batch_size}")
        for step in itertools.count(start_step):
            first = step * batch_size
            seqs = self.sequences(seed, range(first + rows.start, first + rows.stop))
            yield (seqs[:, :-1],), seqs[:, 1:]


    def in_order(self, batch_size: int, *, rows: range, num_batches: int
                 ) -> Iterator[tuple[tuple[torch.Tensor], torch.Tensor]]:
        """``(inputs, targets)`` of the ``rows`` of held-out global batches ``0 .. num_batches - 1``:
        sequences in file order, unpermuted ([Note: token data]).

        Raises:
            ValueError: fewer than ``num_batches`` whole batches, or rows outside a batch.
        """
        if rows.step != 1 or rows.start < 0 or rows.stop > batch_size:
            raise ValueError(f"rows {rows} are not consecutive rows of a batch of {batch_size}")
        if num_batches * batch_size > self.num_sequences:
            raise ValueError(f"{num_batches} batches of {batch_size} need {num_batches * batch_size} sequences; "
                             f"{self.path} holds {self.num_sequences}")
        for b in range(num_batches):
            seqs = self._windows(list(range(b * batch_size + rows.start, b * batch_size + rows.stop)), "--eval-data")
            yield (seqs[:, :-1],), seqs[:, 1:]


def held_out_tokens(model_file: ModelFile, model: nn.Module, path: str | Path, *, dtype: str = "uint16",
                    column: str = "input_ids", global_batch_size: int) -> TokenFile:
    """The held-out token file or dataset directory ``path`` (``--eval-data``), checked as
    ``--data`` is ([Note: token data]); messages name ``--eval-data``.

    Raises:
        DataError: the file or the model does not fit.
    """
    try:
        return TokenFile.open(path, dtype=dtype, column=column, seq_len=sequence_length(model_file),
                              vocab_size=vocabulary_size(model), global_batch_size=global_batch_size)
    except DataError as exc:
        raise DataError(str(exc).replace("--data ", "--eval-data ", 1)) from None


def _file_tokens(path: Path, dtype: str) -> np.ndarray:
    """The token file ``path``, memory-mapped as ``dtype``."""
    width = TOKEN_DTYPES[dtype].itemsize
    if not path.is_file():
        raise DataError(f"--data {path}: no such file (a flat file of {dtype} token ids, as nanoGPT's train.bin, or a "
                        f"dataset directory)")
    size_bytes = path.stat().st_size
    if size_bytes % width:
        raise DataError(f"--data {path} is {size_bytes} bytes, not a whole number of {dtype} tokens ({width} bytes "
                        f"each); is --data-dtype right?")
    return np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r") if size_bytes else np.zeros(0, TOKEN_DTYPES[dtype])


def _dataset_tokens(directory: Path, column: str) -> np.ndarray:
    """The lists of ``column`` of a dataset directory, concatenated in row order into one
    array of the column's integer type ([Note: token data]: one copy in memory)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError("reading a dataset directory needs pyarrow: pip install pyarrow") from None
    pieces = []
    for file in _dataset_files(directory):
        table = _read_column(file, column)
        kind = table.type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)) \
                or not pa.types.is_integer(kind.value_type):
            raise DataError(f"--data {directory}: column {column!r} is {kind}, not a list of integer token ids per "
                            f"row (--data-column names the tokenised column)")
        for chunk in table.chunks:
            ids = chunk.flatten()  # the rows' ids back to back; a null row holds none
            if ids.null_count:
                raise DataError(f"--data {directory}: column {column!r} holds a null token id in {file.name}")
            pieces.append(ids.to_numpy(zero_copy_only=True))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int64)
    if tokens.size and np.issubdtype(tokens.dtype, np.signedinteger) and int(tokens.min()) < 0:
        raise DataError(f"--data {directory} holds token id {int(tokens.min())} in column {column!r}; ids are >= 0")
    return tokens


def _dataset_files(directory: Path) -> list[Path]:
    """A dataset directory's data files in row order: ``save_to_disk``'s Arrow files as its
    ``state.json`` lists them (else by name), or its Parquet files by name."""
    state = directory / "state.json"
    if state.is_file():
        try:
            listed = [directory / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"--data {state} is not a state.json of datasets' save_to_disk (no _data_files list)") \
                from None
        if listed:
            return listed
    files = sorted(directory.glob("*.arrow")) or sorted(directory.glob("*.parquet"))
    if not files:
        splits = sorted(p.name for p in directory.iterdir() if p.is_dir() and (p / "state.json").is_file())
        hint = f"; it holds the splits {', '.join(splits)}: pass one, as --data {directory / splits[0]}" if splits else ""
        raise DataError(f"--data {directory} holds no Arrow (data-*.arrow) or Parquet (*.parquet) files{hint}")
    return files


def _read_column(file: Path, column: str):
    """Column ``column`` of one Arrow IPC (stream or file format) or Parquet file, a
    ``pyarrow.ChunkedArray``; Arrow files are memory-mapped, so their chunks are not copied."""
    import pyarrow as pa

    if not file.is_file():
        raise DataError(f"--data {file.parent}: no such data file {file.name} (listed in its state.json)")
    try:
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            names = pq.read_schema(file).names
            table = pq.read_table(file, columns=[column]) if column in names else None
        else:
            source = pa.memory_map(str(file))
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
            names = table.column_names
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"--data {file}: not a readable Arrow or Parquet file ({' '.join(str(exc).split())})") from None
    if column not in names:
        raise DataError(f"--data {file.parent} has no column {column!r} (--data-column); its columns: "
                        f"{', '.join(names)}")
    return table.column(column)


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(struct.pack("<qq", seed, epoch), digest_size=8, person=b"hetpar-tokens").digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes up to 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class TokenModelFile(ModelFile):
    """The program's model file with its ``batches`` read from a token file."""

    data: TokenFile

    def batches(self, batch_size: int, seed: int, *, rows: range | None = None, start_step: int = 0
                ) -> Iterator[tuple[tuple, torch.Tensor]]:
        """The token file's rows of global batches ``start_step + 1, ...`` ([Note: token data])."""
        return self.data.batches(batch_size, seed, rows=rows, start_step=start_step)


def sequence_length(model_file: ModelFile) -> int:
    """T: the model's sequence length, from ``example_inputs(1)``.

    Raises:
        DataError: the model does not take one integer input of shape ``[batch, T]``.
    """
    example = model_file.example_inputs(1)
    shapes = [list(t.shape) for t in example]
    if len(example) != 1 or example[0].dim() != 2 or example[0].is_floating_point():
        raise DataError(f"--data feeds a model one input of token ids shaped [batch, T]; "
                        f"{model_file.path.name}'s example_inputs(1) gives {len(example)} input(s) of shapes {shapes}"
                        f"{'' if len(example) != 1 else f' and dtype {example[0].dtype}'}")
    return int(example[0].shape[1])


def vocabulary_size(model: nn.Module) -> int:
    """The rows of the model's input embedding (a Hugging Face model's
    ``get_input_embeddings()``, else its first ``nn.Embedding``); works on the meta device.

    Raises:
        DataError: the model has no embedding to read token ids.
    """
    embedding = None
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            embedding = get()
        except (NotImplementedError, AttributeError):
            embedding = None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None:
        raise DataError(f"--data holds token ids, but {type(model).__name__} has no nn.Embedding to look them up")
    return embedding.num_embeddings


def token_model_file(model_file: ModelFile, model: nn.Module, path: str | Path, *, dtype: str = "uint16",
                     column: str = "input_ids", global_batch_size: int) -> TokenModelFile:
    """``model_file`` with its ``batches`` read from the token file or dataset directory
    ``path`` ([Note: token data]).

    Args:
        model_file: the program's model file.
        model: its model (on the meta device will do): gives the vocabulary.
        path: the token file or dataset directory (``--data``).
        dtype: ``--data-dtype`` (a token file's width).
        column: ``--data-column`` (a dataset directory's column of token-id lists).
        global_batch_size: sequences per step.

    Raises:
        DataError: the file or the model does not fit (the checks of the note).
    """
    tokens = TokenFile.open(path, dtype=dtype, column=column, seq_len=sequence_length(model_file),
                            vocab_size=vocabulary_size(model), global_batch_size=global_batch_size)
    return TokenModelFile(path=model_file.path, model_args=model_file.model_args, module=model_file.module, data=tokens)


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest name of ``TOKEN_DTYPES`` that holds ids ``0 .. vocab_size - 1``: uint16
    for GPT-2's 50257 ids as nanoGPT writes them, uint32 above 65536."""
    return next((name for name, width in TOKEN_DTYPES.items() if vocab_size <= np.iinfo(width).max + 1), "uint32")


class TokenFileWriter:
    """Writes a token file ([Note: token data]) under a temporary name beside it; ``commit``
    renames it into place, and leaving the ``with`` block without a commit removes it, so a
    failure leaves no file and an earlier one as it was.

    Raises:
        DataError: the file's directory does not exist (on construction), or an id does
            not fit the width (``write``).
    """

    def __init__(self, path: str | Path, dtype: str) -> None:
        self.path = Path(path)
        self.dtype = dtype
        self.tokens = 0
        if not self.path.parent.is_dir():
            raise DataError(f"{self.path}: no such directory {self.path.parent}")
        self._temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self._file = open(self._temp, "wb")
        self._committed = False

    def write(self, ids: np.ndarray | list[int]) -> None:
        """Append token ids; each must fit the file's width."""
        found = np.asarray(ids, dtype=np.int64)
        top = np.iinfo(TOKEN_DTYPES[self.dtype]).max
        if found.size and (int(found.min()) < 0 or int(found.max()) > top):
            bad = int(found.max()) if int(found.max()) > top else int(found.min())
            raise DataError(f"{self.path}: token id {bad} does not fit {self.dtype} (0-{top}); write uint32")
        found.astype(TOKEN_DTYPES[self.dtype]).tofile(self._file)
        self.tokens += found.size

    def commit(self) -> None:
        """Flush the file to disk and rename it into place."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._temp, self.path)
        self._committed = True

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._committed:
            self._file.close()
            self._temp.unlink(missing_ok=True)


__all__ = ["DataError", "TOKEN_DTYPES", "TokenFile", "TokenFileWriter", "TokenModelFile", "held_out_tokens",
           "sequence_length", "token_dtype_for", "token_model_file", "vocabulary_size"]
