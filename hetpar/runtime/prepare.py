"""Token files from text with a local tokenizer (``hetpar data``), as nanoGPT's ``prepare.py``.

[Note: making a token file]
- **Documents.** A ``.txt`` file is one document, or with ``split_lines`` each of its lines
  is one; a ``.jsonl`` file holds one JSON object per line, the document its
  ``text_field``. Inputs are read in the order given, each line by line, so memory holds
  one batch of documents (one whole ``.txt`` document at most). Blank JSONL lines and
  empty documents are skipped: they would add an EOS and nothing else.
- **Encoding.** Each document is encoded without special tokens (tiktoken's
  ``encode_ordinary`` in nanoGPT's ``prepare.py``) and followed by the tokenizer's EOS
  id (nanoGPT's ``eot``), so a sequence cut across two documents ([Note: token data] in
  runtime/data.py) sees where the first ends. The tokenizer is a Hugging Face tokenizer
  directory (or a checkpoint directory holding one) loaded with ``local_files_only``:
  nothing is downloaded.
- **Width.** Without a chosen dtype, uint16 when ``len(tokenizer)`` (added tokens
  included) fits in 65536 ids, else uint32 (``data.token_dtype_for``).
- **Held-out split.** With a fraction F, document i (0-based, counted over all inputs)
  goes to the eval file iff ``floor((i + 1) F) > floor(i F)``: of the first n documents
  exactly ``floor(n F)`` are held out, spread evenly through the corpus rather than
  taken from its last file, with no seed and no second pass.
- **Atomic.** Both files are written under temporary names and renamed into place only
  once every document is read and encoded (``data.TokenFileWriter``): bad input leaves
  nothing behind, and an earlier file as it was.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from hetpar.runtime.data import TOKEN_DTYPES, DataError, TokenFileWriter, token_dtype_for

# What a document file may be: one document per .txt file (or per line), one per .jsonl line.
DOCUMENT_SUFFIXES = (".txt", ".jsonl")
# The files that make a directory a Hugging Face tokenizer: its fast tokenizer, its config,
# a SentencePiece model, a BPE vocabulary (transformers' tokenization_utils file names).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Documents encoded in one call: a fast tokenizer encodes a batch in parallel.
_ENCODE_BATCH = 256


@dataclass(frozen=True, kw_only=True)
class TokenFileSummary:
    """What one written token file holds."""

    file: str
    documents: int
    tokens: int


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """What ``prepare_token_files`` wrote: the training file and the held-out one, if any."""

    dtype: str  # a name of data.TOKEN_DTYPES
    vocab_size: int  # len(tokenizer): every id is below it
    eos_id: int  # the id after each document
    train: TokenFileSummary
    eval: TokenFileSummary | None


def check_inputs(inputs: list[Path]) -> list[Path]:
    """The document files, each checked to exist and be .txt or .jsonl.

    Raises:
        DataError: no input, or one missing, a directory, or of another suffix.
    """
    if not inputs:
        raise DataError("no INPUT: pass .txt or .jsonl files")
    for path in inputs:
        if path.suffix not in DOCUMENT_SUFFIXES:
            raise DataError(f"{path}: not a .txt or .jsonl file (one document per .txt file or line, one JSON object "
                            f"per .jsonl line)")
        if not path.is_file():
            raise DataError(f"{path}: no such file")
    return inputs


def load_tokenizer(path: Path) -> Any:
    """The Hugging Face tokenizer saved in directory ``path``, loaded without the network.

    Raises:
        DataError: ``path`` is not a directory holding tokenizer files, the tokenizer does
            not load, or it has no EOS token.
    """
    if not path.is_dir() or not any((path / name).is_file() for name in TOKENIZER_FILES):
        what = "is not a directory" if not path.is_dir() else "has no tokenizer"
        raise DataError(f"--tokenizer {path} {what}: looked for {', '.join(TOKENIZER_FILES)} (a Hugging Face "
                        f"tokenizer or checkpoint directory)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--tokenizer needs transformers: pip install transformers") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers and the Rust tokenizers raise many kinds; each is this directory's fault
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(f"--tokenizer {path} does not load: {type(exc).__name__} {first}".rstrip()) from None
    if tokenizer.eos_token_id is None:
        raise DataError(f"--tokenizer {path} has no EOS token (eos_token in tokenizer_config.json), which hetpar "
                        f"data puts after each document")
    return tokenizer


def documents(inputs: list[Path], *, text_field: str = "text", split_lines: bool = False,
              on_bytes: Callable[[int], None] | None = None) -> Iterator[str]:
    """The documents of ``inputs`` in order ([Note: making a token file]).

    Args:
        inputs: .txt and .jsonl files (``check_inputs``).
        text_field: the key of a JSONL line's document.
        split_lines: one document per line of a .txt file rather than per file.
        on_bytes: called with the bytes of input read since its last call, for progress.

    Raises:
        DataError: a JSONL line that is not an object with a string ``text_field``.
    """
    report = on_bytes or (lambda n: None)
    for path in inputs:
        if path.suffix == ".txt" and not split_lines:
            text = path.read_text(encoding="utf-8")
            report(path.stat().st_size)
            if text:
                yield text
            continue
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                report(len(line.encode("utf-8")))
                if path.suffix == ".txt":
                    text = line.rstrip("\r\n")
                elif line.strip():
                    text = _jsonl_text(path, number, line, text_field)
                else:
                    continue
                if text:
                    yield text


def _jsonl_text(path: Path, number: int, line: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or text_field not in record:
        keys = ", ".join(list(record)[:5]) if isinstance(record, dict) else "none: not an object"
        raise DataError(f"{path}:{number} has no {text_field!r} field (its keys: {keys}); pick one with --text-field")
    if not isinstance(record[text_field], str):
        raise DataError(f"{path}:{number}: {text_field!r} is a {type(record[text_field]).__name__}, not a string")
    return record[text_field]


def held_out(index: int, fraction: float) -> bool:
    """Whether document ``index`` goes to the eval file: evenly spread, ``floor(n F)`` of
    the first n ([Note: making a token file])."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def prepare_token_files(inputs: list[Path], tokenizer_path: Path, output: Path, *, eval_output: Path | None = None,
                        eval_fraction: float = 0.0, text_field: str = "text", split_lines: bool = False,
                        dtype: str | None = None, on_bytes: Callable[[int], None] | None = None) -> PreparedData:
    """Encode the documents of ``inputs`` into the token file ``output`` (and a held-out
    share into ``eval_output``); see [Note: making a token file].

    Args:
        inputs: .txt and .jsonl files.
        tokenizer_path: a Hugging Face tokenizer or checkpoint directory.
        output: the training token file.
        eval_output: the held-out token file; given iff ``eval_fraction`` is.
        eval_fraction: the share of documents held out, in (0, 1).
        text_field: the key of a JSONL line's document.
        split_lines: one document per line of a .txt file.
        dtype: a name of ``TOKEN_DTYPES``, or None for the narrowest that fits the vocabulary.
        on_bytes: progress: called with the input bytes read since its last call.

    Returns:
        What was written.

    Raises:
        DataError: bad input (the note's and ``check_inputs``/``load_tokenizer``'s), or no
            document (or no held-out one) to write; nothing is written then.
    """
    _check_split(eval_output, eval_fraction)
    check_inputs(inputs)
    tokenizer = load_tokenizer(tokenizer_path)
    vocab_size, eos_id = len(tokenizer), int(tokenizer.eos_token_id)
    if dtype is not None and dtype not in TOKEN_DTYPES:
        raise DataError(f"--dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}")
    if dtype is not None and vocab_size > np.iinfo(TOKEN_DTYPES[dtype]).max + 1:
        raise DataError(f"--dtype {dtype} holds ids below {np.iinfo(TOKEN_DTYPES[dtype]).max + 1}, but the tokenizer "
                        f"has {vocab_size}; use --dtype {token_dtype_for(vocab_size)}")
    width = dtype or token_dtype_for(vocab_size)
    docs = documents(inputs, text_field=text_field, split_lines=split_lines, on_bytes=on_bytes)
    with contextlib.ExitStack() as stack:
        train = stack.enter_context(TokenFileWriter(output, width))
        held = stack.enter_context(TokenFileWriter(eval_output, width)) if eval_output else None
        counts = _encode_into(tokenizer, docs, train, held, eval_fraction)
        _check_written(inputs, output, eval_output, eval_fraction, counts)
        for writer in (train, held):
            if writer is not None:
                writer.commit()
    eval_summary = TokenFileSummary(file=str(eval_output), documents=counts[1], tokens=held.tokens) if held else None
    return PreparedData(dtype=width, vocab_size=vocab_size, eos_id=eos_id,
                        train=TokenFileSummary(file=str(output), documents=counts[0], tokens=train.tokens),
                        eval=eval_summary)


def _check_split(eval_output: Path | None, eval_fraction: float) -> None:
    if eval_output is None and eval_fraction:
        raise DataError(f"--eval-fraction {eval_fraction} needs --eval-output FILE for the held-out tokens")
    if eval_output is not None and not 0 < eval_fraction < 1:
        raise DataError(f"--eval-output {eval_output} needs --eval-fraction F with 0 < F < 1 (got {eval_fraction})")


def _encode_into(tokenizer: Any, docs: Iterator[str], train: TokenFileWriter, held: TokenFileWriter | None,
                 eval_fraction: float) -> tuple[int, int]:
    """Encode ``docs`` batch by batch, each followed by EOS, into ``train`` or ``held``;
    returns the documents each received."""
    eos, counts, index = [int(tokenizer.eos_token_id)], [0, 0], 0
    while batch := [doc for _, doc in zip(range(_ENCODE_BATCH), docs)]:
        # verbose=False: no "longer than the model's maximum length" warning; a document is cut into sequences later
        encoded = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in encoded:
            to_eval = held is not None and held_out(index, eval_fraction)
            (held if to_eval else train).write(np.asarray(ids + eos, dtype=np.int64))
            counts[to_eval] += 1
            index += 1
    return counts[0], counts[1]


def _check_written(inputs: list[Path], output: Path, eval_output: Path | None, eval_fraction: float,
                   counts: tuple[int, int]) -> None:
    names = ", ".join(str(p) for p in inputs[:3]) + (f" and {len(inputs) - 3} more" if len(inputs) > 3 else "")
    if not counts[0] and not counts[1]:
        raise DataError(f"{names}: no document to write to {output} (every input empty)")
    if eval_output is not None and not counts[1]:
        raise DataError(f"--eval-fraction {eval_fraction} of {counts[0]} document(s) holds out none; raise it, or "
                        f"give more documents")


__all__ = ["DOCUMENT_SUFFIXES", "PreparedData", "TOKENIZER_FILES", "TokenFileSummary", "check_inputs", "documents",
           "held_out", "load_tokenizer", "prepare_token_files"]
