"""Training on a flat token file or a dataset directory (``--data``, runtime.data, [Note: token data]).

The fast tests run in one process: sequences cut as nanoGPT's ``get_batch`` cuts them,
an order of the seed alone with epochs wrapping, a replica's rows equal to those rows of
the global batch, a resume that starts at its step, and each bad input refused in one
line; a dataset directory (save_to_disk's Arrow files, or Parquet) gives the batches of
the token file of its concatenated column, and each bad directory is one line. The slow
ones run compiled programs of a tiny Hugging Face Llama on a token file:
at dp 2 the loss sequence equals one process on the same rows ([Note: float tolerance]
in tests/test_distributed.py), and a run resumed from a checkpoint of step 3 ends where
an uninterrupted one does.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import TORCHRUN_TIMEOUT_S, run_torchrun, subprocess_env
from test_distributed import assert_within_rounding

from hetpar.models import HF_CAUSAL_LM
from hetpar.runtime.checkpoint import Checkpointer
from hetpar.runtime.data import DataError, TokenFile, token_model_file
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.precision import LossScaler
from hetpar.runtime.shard import replica_batches, replica_rows
from hetpar.runtime.training import read_metrics

HF_MODEL = HF_CAUSAL_LM  # the model file behind hetpar plan --hf
SEQ, VOCAB, GLOBAL_BATCH, STEPS, LR = 16, 128, 8, 6, 0.05

# A token model: one input of ids [batch, 5], a vocabulary of 20.
TOKENS = """
import torch
import torch.nn as nn


def build_model():
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))


def example_inputs(batch_size):
    return (torch.randint(0, 20, (batch_size, 5)),)
"""


def write_tokens(path: Path, count: int, *, vocab: int = 20, dtype=np.uint16, seed: int = 0) -> np.ndarray:
    tokens = np.random.default_rng(seed).integers(0, vocab, size=count, dtype=dtype)
    tokens.tofile(path)
    return tokens


@pytest.fixture
def token_model(tmp_path):
    path = tmp_path / "tokens.py"
    path.write_text(TOKENS)
    model_file = load_model_file(path)
    return model_file, model_file.build_model()


def take(batches, n: int) -> list:
    return list(itertools.islice(batches, n))


# ----------------------------------------------------------------------------- sequences and order


def test_sequences_are_windows_of_t_plus_one_tokens_inputs_and_targets_shifted(tmp_path, token_model):
    tokens = write_tokens(tmp_path / "train.bin", 5 * 7 + 1)
    data = token_model_file(*token_model, tmp_path / "train.bin", global_batch_size=7).data
    assert data.seq_len == 5 and data.num_sequences == 7  # (36 - 1) // 5: neighbours share one token
    epoch = [take(data.batches(1, 3, start_step=s), 1)[0] for s in range(7)]
    seen = set()
    for (inputs,), targets in epoch:
        start = int(np.flatnonzero([np.array_equal(tokens[j * 5:j * 5 + 5], inputs[0].numpy()) for j in range(7)])[0])
        assert targets[0].tolist() == tokens[start * 5 + 1:start * 5 + 6].tolist()  # nanoGPT's y = x shifted by one
        assert inputs.dtype == targets.dtype == torch.int64
        seen.add(start)
    assert seen == set(range(7))  # an epoch is a permutation of the sequences


def test_the_order_is_a_function_of_the_seed_and_epochs_wrap(tmp_path, token_model):
    write_tokens(tmp_path / "train.bin", 5 * 12 + 1)
    data = token_model_file(*token_model, tmp_path / "train.bin", global_batch_size=4).data
    again = token_model_file(*token_model, tmp_path / "train.bin", global_batch_size=4).data
    first = torch.cat([t for _, t in take(data.batches(4, 7), 9)])  # 36 samples: three epochs of 12
    torch.testing.assert_close(first, torch.cat([t for _, t in take(again.batches(4, 7), 9)]), rtol=0, atol=0)
    epochs = first.view(3, 12, 5)
    for e in range(3):  # each epoch holds every sequence once, in its own order
        assert sorted(map(tuple, epochs[e].tolist())) == sorted(map(tuple, epochs[0].tolist()))
    assert not torch.equal(epochs[0], epochs[1])
    other = torch.cat([t for _, t in take(data.batches(4, 8), 3)])
    assert not torch.equal(first[:12], other)


def test_replicas_read_their_rows_of_the_global_batch_and_a_resume_starts_at_its_step(tmp_path, token_model):
    """Replica rows (the ``rows=`` contract, uneven shares too) equal those rows of the
    global batch; ``start_step=k`` gives batches k+1, ... of the uninterrupted stream."""
    write_tokens(tmp_path / "train.bin", 5 * 20 + 1)
    model_file = token_model_file(*token_model, tmp_path / "train.bin", global_batch_size=8)
    whole = take(model_file.batches(8, 1), 6)
    for sizes in ([2, 2], [3, 1], [1, 1, 1, 1]):
        for d in range(len(sizes)):
            rows = replica_rows(sizes, 2, d)
            for (inputs,), targets in take(replica_batches(model_file, 8, 1, rows=rows), 1):
                torch.testing.assert_close(inputs, whole[0][0][0][rows.start:rows.stop], rtol=0, atol=0)
                torch.testing.assert_close(targets, whole[0][1][rows.start:rows.stop], rtol=0, atol=0)
    resumed = take(model_file.batches(8, 1, rows=range(4, 8), start_step=3), 3)
    for ((inputs,), targets), ((want_inputs,), want_targets) in zip(resumed, whole[3:]):
        torch.testing.assert_close(inputs, want_inputs[4:8], rtol=0, atol=0)
        torch.testing.assert_close(targets, want_targets[4:8], rtol=0, atol=0)


def test_uint32_files_read_as_uint32(tmp_path, token_model):
    tokens = write_tokens(tmp_path / "train.bin", 5 * 4 + 1, dtype=np.uint32)
    data = token_model_file(*token_model, tmp_path / "train.bin", dtype="uint32", global_batch_size=4).data
    got = torch.cat([torch.cat([i, t[:, -1:]], dim=1) for (i,), t in take(data.batches(4, 0), 1)])
    assert sorted(map(tuple, got.tolist())) == sorted(tuple(tokens[j * 5:j * 5 + 6].tolist()) for j in range(4))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("case,message", [
    ("missing", r"--data .*nope.bin: no such file"),
    ("odd bytes", r"is 41 bytes, not a whole number of uint16 tokens \(2 bytes each\); is --data-dtype right\?"),
    ("short", r"holds 20 uint16 tokens, 3 sequences of 5 \+ 1, fewer than one global batch of 4"),
    ("vocab", r"holds token id 20, but the model's vocabulary has 20 ids \(0-19\)"),
    ("uint16 read as uint32", r"holds token id \d+, but the model's vocabulary has 20 ids"),
])
def test_a_file_that_does_not_fit_is_one_clear_error(tmp_path, token_model, case, message):
    path = tmp_path / "train.bin"
    if case == "odd bytes":
        path.write_bytes(b"\0" * 41)
    elif case == "short":
        write_tokens(path, 20)
    elif case == "vocab":
        tokens = write_tokens(path, 5 * 4 + 1)
        tokens[17] = 20
        tokens.tofile(path)
    elif case == "uint16 read as uint32":
        write_tokens(path, 2 * (5 * 4 + 1), vocab=20)
    elif case == "missing":
        path = tmp_path / "nope.bin"
    with pytest.raises(DataError, match=message):
        token_model_file(*token_model, path, dtype="uint32" if "uint32" in case else "uint16", global_batch_size=4)


def test_a_model_without_one_token_input_is_refused(tmp_path, mlp_path):
    model_file = load_model_file(mlp_path, {"depth": 1, "width": 8, "in_features": 6, "out_features": 3})
    write_tokens(tmp_path / "train.bin", 100)
    with pytest.raises(DataError, match=r"--data feeds a model one input of token ids shaped \[batch, T\]; mlp.py's "
                                        r"example_inputs\(1\) gives 1 input\(s\) of shapes \[\[1, 6\]\] and dtype "
                                        r"torch.float32"):
        token_model_file(model_file, model_file.build_model(), tmp_path / "train.bin", global_batch_size=4)


def test_an_id_past_a_sampled_check_stops_at_its_batch(tmp_path):
    tokens = np.zeros(5 * 4 + 1, dtype=np.uint16)
    tokens[7] = 99
    tokens.tofile(tmp_path / "train.bin")
    data = TokenFile(path=tmp_path / "train.bin", tokens=np.memmap(tmp_path / "train.bin", dtype=np.uint16, mode="r"),
                     seq_len=5, vocab_size=20)  # built without open()'s check, as a sampled check may miss one
    with pytest.raises(DataError, match=r"holds token id 99 in sequence"):
        take(data.batches(4, 0), 1)


# ----------------------------------------------------------------------------- programs


def save_tiny_llama(directory: Path, *, tie: bool = False, seed: int = 0) -> nn.Module:
    """A tiny Llama (hidden 64, 2 layers, vocabulary 128) with random weights, written by
    ``save_pretrained``; returns the model."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                            tie_word_embeddings=tie)
    model = tf.LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return model


def llama_plan(checkpoint: Path, *, dp: int = 1, tp: int = 1, pp: int = 1, micro_batch_size: int = 2):
    """The planner's plan of the tiny Llama of ``checkpoint`` on dp x tp x pp CPU ranks."""
    from hetpar.cost_models.cluster import parse_cluster
    from hetpar.planner.api import plan_model
    from hetpar.planner.options import SearchOptions

    options = SearchOptions(global_batch_size=GLOBAL_BATCH, dtype="fp32", schedule="1f1b", dp=dp, tp=tp, pp=pp,
                            micro_batch_size=micro_batch_size)
    return plan_model(HF_MODEL, parse_cluster(f"1x{dp * tp * pp}xcpu"), options,
                      model_args={"config": str(checkpoint), "seq": SEQ})


def reference_losses(plan, init_state: dict, data_path: Path, steps: int = STEPS, *, dtype=torch.float32,
                     checkpoint_at: tuple[int, Path] | None = None,
                     held_out: tuple[Path, int, int, dict] | None = None) -> tuple[list[float], dict]:
    """One process: the whole model and the whole global batch of the token file, SGD;
    with ``checkpoint_at`` (step, directory), a checkpoint after that step as a
    program's (its seed, optimizer and batch recorded); with ``held_out`` (file, every,
    batches, out), the mean loss over the file's first ``batches`` global batches in
    file order after every ``every`` steps, into ``out[step]``."""
    model_file = load_model_file(plan.model.file, plan.model.args)
    model = model_file.build_model().to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in init_state.items()})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = token_model_file(model_file, model, data_path, global_batch_size=plan.global_batch_size)
    losses = []
    for step, ((inputs,), targets) in enumerate(take(data.batches(plan.global_batch_size, 0), steps), start=1):
        opt.zero_grad()
        loss = model_file.loss(model(inputs), targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if held_out is not None and step % held_out[1] == 0:
            tokens = TokenFile.open(held_out[0], seq_len=SEQ, vocab_size=VOCAB, global_batch_size=plan.global_batch_size)
            batches = tokens.in_order(plan.global_batch_size, rows=range(plan.global_batch_size),
                                      num_batches=held_out[2])
            with torch.no_grad():
                held_out[3][step] = statistics.fmean(model_file.loss(model(x), y).item() for (x,), y in batches)
        if checkpoint_at is not None and step == checkpoint_at[0]:
            run = {"optimizer": "sgd", "seed": 0, "global_batch_size": plan.global_batch_size}
            Checkpointer(checkpoint_at[1], every=step, keep=1, model=model, run=run).maybe_save(
                step, model, opt, LossScaler(enabled=False))
    return losses, model.state_dict()


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A tiny Llama checkpoint directory (``save_pretrained``), a token file, the dp 2 plan
    compiled, and that program trained STEPS steps from the checkpoint on the file."""
    root = tmp_path_factory.mktemp("llama")
    model = save_tiny_llama(root / "hf")
    write_tokens(root / "train.bin", 4000, vocab=VOCAB)
    plan = llama_plan(root / "hf", dp=2)
    from hetpar.rewriters import compile_plan

    compile_plan(plan, root / "build")
    result = run_torchrun(root / "build" / "train.py", 2, [
        "--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--init-from", str(root / "hf"),
        "--data", str(root / "train.bin"), "--save-final", "final.pt", "--metrics", "m.jsonl"])
    assert result.returncode == 0, result.stderr[-4000:]
    return root, plan, model.state_dict()


@pytest.mark.slow
def test_data_parallel_2_on_a_token_file_trains_like_one_process(llama_run):
    root, plan, init_state = llama_run
    losses = [r["loss"] for r in read_metrics(root / "build" / "m.jsonl")]
    final = torch.load(root / "build" / "final.pt", weights_only=True)
    ref_losses, ref_state = reference_losses(plan, init_state, root / "train.bin")
    exact_losses, exact_state = reference_losses(plan, init_state, root / "train.bin", dtype=torch.float64)
    assert_within_rounding("sgd", STEPS, losses, final, ref_state, exact_losses, exact_state)
    assert ref_losses[-1] != ref_losses[0]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process checkpoint of step 3
def test_a_run_resumed_at_step_3_of_6_ends_as_an_uninterrupted_one(llama_run, tmp_path):
    """A checkpoint of step 3 (one process's, any plan's loads: [Note: resharding resume]);
    the dp 2 program resumed from it reads the rows of steps 4-6 and ends where the
    uninterrupted run ends."""
    root, plan, init_state = llama_run
    reference_losses(plan, init_state, root / "train.bin", steps=3, checkpoint_at=(3, tmp_path / "ckpt"))
    result = run_torchrun(root / "build" / "train.py", 2, [
        "--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--data", str(root / "train.bin"), "--save-final", str(tmp_path / "final.pt"), "--metrics",
        str(tmp_path / "m.jsonl")])
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resuming from" in result.stderr and "(step 3)" in result.stderr
    resumed = read_metrics(tmp_path / "m.jsonl")
    uninterrupted = read_metrics(root / "build" / "m.jsonl")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    torch.testing.assert_close([r["loss"] for r in resumed], [r["loss"] for r in uninterrupted[3:]], rtol=1e-5, atol=0)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    want = torch.load(root / "build" / "final.pt", weights_only=True)
    assert list(final) == list(want)
    for key in want:
        torch.testing.assert_close(final[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_program_refuses_a_short_token_file_in_one_line(tmp_path, llama_run):
    """One process (plain python) of a one-rank plan: exit 2, one line, no traceback, before step 1."""
    root, _, _ = llama_run
    from hetpar.rewriters import compile_plan

    compile_plan(llama_plan(root / "hf"), tmp_path / "build")
    write_tokens(tmp_path / "short.bin", 5 * SEQ, vocab=VOCAB)
    assert_program_refuses(tmp_path / "build", ["--data", str(tmp_path / "short.bin")],
                           f"hetpar: --data {tmp_path / 'short.bin'} holds 80 uint16 tokens, 4 sequences of 16 + 1, fewer "
                           f"than one global batch of {GLOBAL_BATCH}")


def assert_program_refuses(build: Path, args: list[str], line: str) -> None:
    """The compiled one-rank program in ``build``, run with plain python and ``args``, stops
    before step 1 with exit 2, exactly ``line`` of its own on stderr and no traceback."""
    result = subprocess.run([sys.executable, "train.py", "--steps", "1", *args], cwd=build, env=subprocess_env(),
                            capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    ours = [l for l in result.stderr.splitlines() if l.startswith("hetpar:") and "use_cache" not in l]
    assert ours == [line], result.stderr
    assert "step 1/1" not in result.stderr


# ----------------------------------------------------------------------------- dataset directories


def documents(tokens: np.ndarray, *, seed: int = 0) -> list[list[int]]:
    """``tokens`` cut at random places into documents of 0-12 ids (empty ones too)."""
    rng, out, at = np.random.default_rng(seed), [], 0
    while at < len(tokens):
        size = int(rng.integers(0, 13))
        out.append(tokens[at:at + size].tolist())
        at += size
    return out


def write_dataset(directory: Path, docs: list, *, layout: str, column: str = "input_ids", value_type=None,
                  files: int = 2) -> Path:
    """``docs`` as a dataset directory: ``arrow`` as datasets' save_to_disk writes it (Arrow
    IPC stream files of small record batches, state.json listing them, dataset_info.json),
    or ``parquet`` files; an ``attention_mask`` column beside ``column``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory.mkdir()
    kind = pa.list_(value_type or pa.int32())
    cuts = np.linspace(0, len(docs), files + 1).astype(int)
    names = []
    for f in range(files):
        part = docs[cuts[f]:cuts[f + 1]]
        table = pa.table({column: pa.array(part, type=kind),
                          "attention_mask": pa.array([[1] * len(d) for d in part], type=pa.list_(pa.int8()))})
        if layout == "parquet":
            pq.write_table(table, directory / f"part-{f:02d}.parquet", row_group_size=7)
            continue
        names.append(f"data-{f:05d}-of-{files:05d}.arrow")
        with pa.ipc.new_stream(directory / names[-1], table.schema) as writer:
            for batch in table.to_batches(max_chunksize=5):
                writer.write_batch(batch)
    if layout == "arrow":
        (directory / "state.json").write_text(json.dumps({
            "_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_format_columns": None,
            "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}))
        (directory / "dataset_info.json").write_text("{}")
    return directory


@pytest.mark.parametrize("layout", ["arrow", "parquet"])
def test_a_dataset_directory_reads_as_the_token_file_of_its_concatenated_column(tmp_path, token_model, layout):
    """Documents of a list column concatenated in row order (run_clm's group_texts, no EOS
    added) are the token file of those ids: the same batches for every step, replica rows
    and resumed steps ([Note: token data])."""
    tokens = write_tokens(tmp_path / "train.bin", 5 * 20 + 3)
    saved = write_dataset(tmp_path / "dataset", documents(tokens), layout=layout)
    from_file = token_model_file(*token_model, tmp_path / "train.bin", global_batch_size=8)
    from_dir = token_model_file(*token_model, saved, global_batch_size=8)
    assert from_dir.data.tokens.tolist() == tokens.tolist() and from_dir.data.num_sequences == 20
    for rows, start in ((None, 0), (range(0, 3), 0), (range(3, 8), 0), (range(2, 6), 4)):
        got = take(from_dir.batches(8, 5, rows=rows, start_step=start), 4)  # 32 samples: into a second epoch
        for ((inputs,), targets), ((want_inputs,), want_targets) in zip(got, take(
                from_file.batches(8, 5, rows=rows, start_step=start), 4), strict=True):
            assert inputs.dtype == targets.dtype == torch.int64
            torch.testing.assert_close(inputs, want_inputs, rtol=0, atol=0)
            torch.testing.assert_close(targets, want_targets, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["save_to_disk", "to_parquet"])
def test_a_directory_the_datasets_library_wrote_reads_as_its_concatenated_column(tmp_path, token_model, layout):
    """What ``datasets`` itself writes (several shards of a DatasetDict's split, or
    ``to_parquet`` files), not a layout built here, streams as the token file of its
    column's documents in row order."""
    datasets = pytest.importorskip("datasets")
    tokens = write_tokens(tmp_path / "train.bin", 5 * 40 + 3)
    docs = documents(tokens)
    split = datasets.Dataset.from_dict({"input_ids": docs, "text": [f"doc {i}" for i in range(len(docs))]})
    directory = tmp_path / "dataset"
    if layout == "save_to_disk":
        datasets.DatasetDict({"train": split, "validation": split.select(range(2))}).save_to_disk(
            directory, num_shards={"train": 3, "validation": 1})
        directory = directory / "train"
        assert len(list(directory.glob("data-*.arrow"))) == 3
    else:
        directory.mkdir()
        half = len(docs) // 2
        split.select(range(half)).to_parquet(directory / "part-0.parquet")
        split.select(range(half, len(docs))).to_parquet(directory / "part-1.parquet")
    from_dir = token_model_file(*token_model, directory, global_batch_size=8)
    assert from_dir.data.tokens.tolist() == tokens.tolist()


def test_a_dataset_column_is_chosen_by_name_and_read_at_any_integer_width(tmp_path, token_model):
    import pyarrow as pa

    tokens = write_tokens(tmp_path / "train.bin", 5 * 4 + 1)
    saved = write_dataset(tmp_path / "dataset", documents(tokens), layout="arrow", column="ids",
                          value_type=pa.uint16(), files=1)
    data = token_model_file(*token_model, saved, column="ids", global_batch_size=4).data
    assert data.tokens.dtype == np.uint16 and data.tokens.tolist() == tokens.tolist()


@pytest.mark.parametrize("case,message", [
    ("no files", r"^--data .*dataset holds no Arrow \(data-\*\.arrow\) or Parquet \(\*\.parquet\) files$"),
    ("splits", r"holds no Arrow .* files; it holds the splits test, train: pass one, as --data .*dataset/test$"),
    ("no column", r"^--data .*dataset has no column 'input_ids' \(--data-column\); its columns: text, "
                  r"attention_mask$"),
    ("not a list", r"column 'input_ids' is string, not a list of integer token ids per row"),
    ("float lists", r"column 'input_ids' is list<item: double>, not a list of integer token ids per row"),
    ("null id", r"column 'input_ids' holds a null token id in data-00000-of-00001\.arrow$"),
    ("negative id", r"holds token id -3 in column 'input_ids'; ids are >= 0$"),
    ("short", r"holds 20 int32 tokens, 3 sequences of 5 \+ 1, fewer than one global batch of 4$"),
    ("vocab", r"holds token id 20, but the model's vocabulary has 20 ids \(0-19\); was the column made with this "
              r"model's tokenizer\?$"),
    ("not arrow", r"data-00000-of-00001\.arrow: not a readable Arrow or Parquet file"),
])
def test_a_dataset_directory_that_does_not_fit_is_one_clear_error(tmp_path, token_model, case, message):
    import pyarrow as pa

    saved = tmp_path / "dataset"
    good = [[1, 2, 3]] * 8
    if case == "no files":
        saved.mkdir()
    elif case == "splits":
        for split in ("train", "test"):
            (saved / split).mkdir(parents=True)
            (saved / split / "state.json").write_text("{}")
        (saved / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    elif case == "no column":
        write_dataset(saved, good, layout="parquet", column="text", value_type=pa.int32(), files=1)
        import pyarrow.parquet as pq

        path = saved / "part-00.parquet"
        pq.write_table(pq.read_table(path).set_column(0, "text", pa.array(["a"] * 8)), path)
    elif case == "not a list":
        saved.mkdir()
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"input_ids": ["a b"] * 8}), saved / "x.parquet")
    elif case == "float lists":
        write_dataset(saved, [[1.0, 2.0]] * 8, layout="arrow", value_type=pa.float64(), files=1)
    elif case == "null id":
        write_dataset(saved, [[1, None, 3]] * 8, layout="arrow", files=1)
    elif case == "negative id":
        write_dataset(saved, [[1, -3, 3]] * 8, layout="arrow", files=1)
    elif case == "short":
        write_dataset(saved, [[1] * 5] * 4, layout="arrow", files=1)
    elif case == "vocab":
        write_dataset(saved, [[1, 20, 3]] * 8, layout="parquet", files=1)
    elif case == "not arrow":
        write_dataset(saved, good, layout="arrow", files=1)
        (saved / "data-00000-of-00001.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=message) as raised:
        token_model_file(*token_model, saved, global_batch_size=4)
    assert "\n" not in str(raised.value)


def test_without_pyarrow_a_dataset_directory_is_one_line_and_the_runtime_imports(tmp_path):
    """pyarrow is imported only for a directory: the runtime imports without it, and a
    directory then stops with one line that says how to get it."""
    saved = tmp_path / "dataset"
    saved.mkdir()
    script = (f"import sys; sys.modules['pyarrow'] = None\n"
              f"import hetpar.runtime.data as data\n"
              f"try:\n"
              f"    data._dataset_tokens(__import__('pathlib').Path({str(saved)!r}), 'input_ids')\n"
              f"except data.DataError as exc:\n"
              f"    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "reading a dataset directory needs pyarrow: pip install pyarrow\n"
