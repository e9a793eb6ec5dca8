"""``hetpar data``: text or JSONL into a token file for ``--data``, with a local tokenizer."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from hetpar.commands.common import console, domain_errors, print_json

if TYPE_CHECKING:  # runtime.prepare imports torch: loaded only when documents are encoded
    from hetpar.runtime.prepare import PreparedData

# Inputs larger than this show a progress bar on stderr; smaller ones finish before it would draw.
_PROGRESS_BYTES = 1 << 20
# --dtype's choices: a token width of runtime.data, or auto: the narrowest that holds the tokenizer's vocabulary.
_AUTO_WIDTH = "auto"
# runtime.data's TOKEN_DTYPES, spelled out so that the CLI's options load without torch (a test keeps them equal).
TOKEN_WIDTHS = ("uint16", "uint32")
TokenWidthChoice = Literal[(_AUTO_WIDTH, *TOKEN_WIDTHS)]


@domain_errors
def data(
    inputs: Annotated[list[Path], typer.Argument(help="Text files (.txt: one document each, or one per line with --split-lines) and JSONL files (.jsonl: one document per line).", show_default=False)],
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="A Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json), or a checkpoint directory holding one; nothing is downloaded.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The token file to write (nanoGPT's train.bin).", show_default=False)],
    eval_fraction: Annotated[float, typer.Option("--eval-fraction", help="Hold out this share of the documents, spread evenly, in --eval-output.")] = 0.0,
    eval_output: Annotated[Optional[Path], typer.Option("--eval-output", help="The held-out token file (nanoGPT's val.bin).", show_default=False)] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="The key of each JSONL line's document.")] = "text",
    split_lines: Annotated[bool, typer.Option("--split-lines", help="One document per line of a .txt file, not per file.")] = False,
    dtype: Annotated[TokenWidthChoice, typer.Option("--dtype", help="Token width; auto: uint16 when the vocabulary fits in 65536 ids, else uint32 (give the program the same --data-dtype).")] = _AUTO_WIDTH,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written as JSON.")] = False,
) -> None:
    """Encode documents with a local tokenizer, each followed by its EOS id, into a token file for --data."""
    from hetpar.runtime.prepare import prepare_token_files

    total_bytes = sum(p.stat().st_size for p in inputs if p.is_file())
    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=console,
                  transient=True, disable=total_bytes < _PROGRESS_BYTES) as bar:
        task = bar.add_task("", total=total_bytes)
        written = prepare_token_files(inputs, tokenizer, output, eval_output=eval_output, eval_fraction=eval_fraction,
                                      text_field=text_field, split_lines=split_lines,
                                      dtype=None if dtype == _AUTO_WIDTH else dtype,
                                      on_bytes=lambda n: bar.advance(task, n))
    if as_json:
        print_json(asdict(written))
        return
    console.print(summary(written), soft_wrap=True)
    typer.echo(written.train.file)
    if written.eval is not None:
        typer.echo(written.eval.file)


def summary(written: PreparedData) -> str:
    """One line: each file's documents and tokens, the width and the vocabulary."""
    files = [f"{f.file}: {f.documents:,} documents, {f.tokens:,} tokens" for f in (written.train, written.eval) if f]
    return (f"wrote {'; '.join(files)} ({written.dtype}: --data-dtype {written.dtype}; vocabulary {written.vocab_size:,}, "
            f"EOS {written.eos_id} after each document)")
