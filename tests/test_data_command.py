"""``hetpar data``: text and JSONL into a token file with a local tokenizer ([Note: making a
token file] in hetpar/runtime/prepare.py).

A tiny word-level tokenizer is trained in memory and saved with ``save_pretrained``, so
nothing is downloaded. The command's files must hold the tokenizer's own ids of each
document followed by its EOS id, in uint16 for a small vocabulary; a held-out share goes
to the eval file; each bad input is one line and leaves no file.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, hetpar

from hetpar.commands.data import TokenWidthChoice
from hetpar.runtime.data import TOKEN_DTYPES, DataError, TokenFile, TokenFileWriter, token_dtype_for
from hetpar.runtime.prepare import held_out, load_tokenizer

SENTENCES = ["the cat sat on the mat", "a dog ran far away", "hello world"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer with an EOS token, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="[UNK]").save_pretrained(path)
    return path


def expected_ids(tokenizer_dir: Path, docs: list[str]) -> list[int]:
    """What the tokenizer itself gives: each document's ids, then EOS."""
    tokenizer = load_tokenizer(tokenizer_dir)
    return [i for doc in docs for i in tokenizer.encode(doc, add_special_tokens=False) + [tokenizer.eos_token_id]]


def test_txt_and_jsonl_become_the_tokenizers_ids_each_followed_by_eos(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("the cat sat\non the mat\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "hello world", "id": 1}) + "\n\n"
                                      + json.dumps({"text": "a dog zebra"}) + "\n")
    result = hetpar("data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--tokenizer", str(tokenizer_dir),
                    "-o", str(tmp_path / "train.bin"), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    docs = ["the cat sat\non the mat\n", "hello world", "a dog zebra"]  # a .txt file is one document, as it is
    want = expected_ids(tokenizer_dir, docs)
    assert np.fromfile(tmp_path / "train.bin", np.uint16).tolist() == want
    assert summary["dtype"] == "uint16" and summary["eval"] is None
    assert summary["train"] == {"file": str(tmp_path / "train.bin"), "documents": 3, "tokens": len(want)}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the temporary file was renamed
    # the program reads it as written: sequence j is tokens [2j, 2j + 3) at T = 2
    tokens = TokenFile.open(tmp_path / "train.bin", dtype=summary["dtype"], seq_len=2, vocab_size=summary["vocab_size"],
                            global_batch_size=1)
    windows = tokens.sequences(0, range(tokens.num_sequences)).tolist()
    assert sorted(windows) == sorted(want[2 * j:2 * j + 3] for j in range((len(want) - 1) // 2))


def test_split_lines_and_an_eval_split_spread_through_the_documents(tmp_path, tokenizer_dir):
    lines = ["the cat", "sat on", "the mat", "a dog", "ran far", "away"]
    (tmp_path / "a.txt").write_text("\n".join(lines) + "\n")
    result = hetpar("data", str(tmp_path / "a.txt"), "--tokenizer", str(tokenizer_dir), "--split-lines",
                    "-o", str(tmp_path / "train.bin"), "--eval-fraction", "0.34", "--eval-output", str(tmp_path / "val.bin"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / "train.bin"), str(tmp_path / "val.bin")]
    assert "4 documents" in result.stderr and "2 documents" in result.stderr and "uint16" in result.stderr
    held = [i for i in range(len(lines)) if held_out(i, 0.34)]
    assert held == [2, 5]  # floor(n * 0.34) of the first n, evenly spread
    assert np.fromfile(tmp_path / "val.bin", np.uint16).tolist() == expected_ids(tokenizer_dir, [lines[i] for i in held])
    assert np.fromfile(tmp_path / "train.bin", np.uint16).tolist() == expected_ids(
        tokenizer_dir, [l for i, l in enumerate(lines) if i not in held])


def test_held_out_documents_are_floor_n_f_of_the_first_n():
    for fraction in (0.01, 0.1, 0.25, 0.5, 0.9):
        flags = [held_out(i, fraction) for i in range(1000)]
        assert all(sum(flags[:n]) == int(n * fraction + 1e-9) for n in range(1, 1001)), fraction


def test_the_width_is_the_narrowest_that_holds_the_vocabulary():
    assert token_dtype_for(50257) == token_dtype_for(65536) == "uint16"
    assert token_dtype_for(65537) == token_dtype_for(151936) == "uint32"
    assert typing.get_args(TokenWidthChoice) == ("auto", *TOKEN_DTYPES)


def test_the_writer_refuses_an_id_that_does_not_fit_and_leaves_no_file(tmp_path):
    with pytest.raises(DataError, match="token id 70000 does not fit uint16"):
        with TokenFileWriter(tmp_path / "t.bin", "uint16") as writer:
            writer.write([1, 2, 3])
            writer.write([70000])
    assert list(tmp_path.iterdir()) == []
    with TokenFileWriter(tmp_path / "t.bin", "uint32") as writer:
        writer.write([70000, 5])
        writer.commit()
    assert np.fromfile(tmp_path / "t.bin", np.uint32).tolist() == [70000, 5]


@pytest.mark.parametrize("case, fragments", [
    ("missing input", ["nope.txt: no such file"]),
    ("not text", ["data.csv: not a .txt or .jsonl file"]),
    ("no field", ["b.jsonl:2 has no 'text' field", "--text-field"]),
    ("no tokenizer", ["has no tokenizer", "tokenizer.json", "tokenizer_config.json"]),
    ("empty", ["no document to write"]),
])
def test_each_bad_input_is_one_line_and_writes_nothing(tmp_path, tokenizer_dir, case, fragments):
    (tmp_path / "a.txt").write_text("the cat sat")
    (tmp_path / "b.jsonl").write_text('{"text": "hello"}\n{"body": "world"}\n')
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "not-a-tokenizer").mkdir()
    inputs, tokenizer = {"missing input": ["a.txt", "nope.txt"], "not text": ["data.csv"], "no field": ["a.txt", "b.jsonl"],
                         "no tokenizer": ["a.txt"], "empty": ["empty.txt"]}[case], tokenizer_dir
    if case == "no tokenizer":
        tokenizer = tmp_path / "not-a-tokenizer"
    before = sorted(p.name for p in tmp_path.iterdir())
    result = hetpar("data", *(str(tmp_path / name) for name in inputs), "--tokenizer", str(tokenizer),
                    "-o", str(tmp_path / "train.bin"))
    assert_one_line_error(result, *fragments)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("content", ['{"model": 3}', "not json"])
def test_a_tokenizer_that_does_not_load_is_one_line(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(DataError, match=f"--tokenizer {tmp_path} does not load: ") as raised:
        load_tokenizer(tmp_path)
    assert "\n" not in str(raised.value)
