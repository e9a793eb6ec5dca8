"""Training data across data-parallel replicas (runtime.shard, runtime.model_file): each
replica reads only its rows, the replicas' rows partition every global batch, even and
uneven shares, and a resumed run continues the data order exactly."""

from __future__ import annotations

import dataclasses
import itertools
import types

import pytest
import torch

from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.shard import ShardError, microbatches, replica_batches, replica_rows

GPT_ARGS = {"n_layers": 1, "hidden": 16, "heads": 2, "seq_len": 8, "vocab": 32}
MLP_ARGS = {"depth": 1, "width": 8, "in_features": 6, "out_features": 3}

# A token model without ``batches``: synthetic integer inputs and class targets.
TOKENS = """
import torch
import torch.nn as nn


def build_model():
    return nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20))


def example_inputs(batch_size):
    return (torch.randint(0, 20, (batch_size, 5)),)
"""

# (micro-batch size of each replica, micro-batches): equal and uneven shares
SHARES = [([4], 2), ([2, 2], 2), ([1, 1, 1, 1], 3), ([3, 1], 2), ([1, 2, 5], 1)]


@pytest.fixture(params=["synthetic float", "synthetic tokens", "model file batches"])
def model_file(request, tmp_path, mlp_path, gpt_path):
    if request.param == "synthetic float":
        return load_model_file(mlp_path, MLP_ARGS)
    if request.param == "synthetic tokens":
        path = tmp_path / "tokens.py"
        path.write_text(TOKENS)
        return load_model_file(path)
    return load_model_file(gpt_path, GPT_ARGS)


def take(batches, n: int) -> list:
    return list(itertools.islice(batches, n))


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (inputs, targets), (want_inputs, want_targets) in zip(got, want):
        assert len(inputs) == len(want_inputs)
        for t, w in zip(inputs, want_inputs):
            torch.testing.assert_close(t, w, rtol=0, atol=0)
        torch.testing.assert_close(targets, want_targets, rtol=0, atol=0)


@pytest.mark.parametrize("sizes, m", SHARES)
def test_replica_rows_partition_the_global_batch(model_file, sizes, m):
    batch = sum(sizes) * m
    rows = [replica_rows(sizes, m, d) for d in range(len(sizes))]
    assert [len(r) for r in rows] == [n * m for n in sizes]
    assert [i for r in rows for i in r] == list(range(batch))  # no overlap, nothing left out, in replica order
    shards = [take(replica_batches(model_file, batch, 7, rows=r), 3) for r in rows]
    union = [
        (tuple(torch.cat(parts) for parts in zip(*(shard[k][0] for shard in shards))),
         torch.cat([shard[k][1] for shard in shards]))
        for k in range(3)
    ]
    assert_same_batches(union, take(model_file.batches(batch, 7), 3))


@pytest.mark.parametrize("sizes, m", [([2, 2], 2), ([3, 1], 2)])
def test_micro_batches_of_a_replica_are_those_of_the_global_batch(model_file, sizes, m):
    batch = sum(sizes) * m
    cpu = torch.device("cpu")
    global_batch = next(model_file.batches(batch, 0))
    for d in range(len(sizes)):
        inputs, targets = next(replica_batches(model_file, batch, 0, rows=replica_rows(sizes, m, d)))
        mine = microbatches(inputs, targets, num_microbatches=m, device=cpu)
        sliced = microbatches(*global_batch, replica=d, data_parallel=len(sizes), num_microbatches=m, device=cpu,
                              micro_batch_sizes=sizes)
        assert [t.shape[0] for t in mine[0][0]] == [sizes[d]]
        assert_same_batches(mine, sliced)


def test_resumed_data_continues_the_order_exactly(model_file):
    rows = replica_rows([3, 1], 2, 0)
    uninterrupted = take(replica_batches(model_file, 8, 3, rows=rows), 5)
    assert_same_batches(take(replica_batches(model_file, 8, 3, rows=rows, start_step=3), 2), uninterrupted[3:])


def test_synthetic_data_varies_by_step_row_and_seed_and_leaves_the_global_rng_alone(mlp_path):
    model_file = load_model_file(mlp_path, MLP_ARGS)
    state = torch.get_rng_state()
    (x0,), _ = next(model_file.batches(4, 0))
    (x1,), _ = next(model_file.batches(4, 0, start_step=1))
    (y0,), _ = next(model_file.batches(4, 1))
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(x0, x1) and not torch.equal(x0, y0) and not torch.equal(x0[0], x0[1])
    assert x0.shape == (4, 6) and x0.dtype == torch.float32


def test_token_ids_stay_in_the_examples_range(tmp_path):
    path = tmp_path / "tokens.py"
    path.write_text(TOKENS)
    (ids,), targets = next(load_model_file(path).batches(64, 0))
    assert ids.dtype == torch.long and ids.shape == (64, 5) and 0 <= int(ids.min()) and int(ids.max()) < 20
    assert targets.dtype == torch.long and targets.shape == (64, 5) and int(targets.max()) < 20


def test_a_model_file_batch_too_small_for_the_rows_is_an_error(gpt_path):
    model_file = load_model_file(gpt_path, GPT_ARGS)
    short = with_batches(model_file, lambda batch_size, seed, **_: iter([((torch.zeros(2, 8),), torch.zeros(2, 8))]))
    with pytest.raises(ShardError, match=r"gave a batch without rows 2-3 .* it must yield 4 rows per batch"):
        next(replica_batches(short, 4, 0, rows=range(2, 4)))


def with_batches(model_file, batches):
    """``model_file`` with its module's ``batches`` replaced."""
    module = types.SimpleNamespace(**vars(model_file.module))
    module.batches = batches
    return dataclasses.replace(model_file, module=module)
