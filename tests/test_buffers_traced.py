"""A model that indexes its buffers by a traced size traces with torch.fx ([Note: buffers as graph
values] in hetpar/runtime/capture.py): nanoGPT's attention written out, its causal mask a registered
buffer sliced to the sequence, keeps tensor parallelism (torch.export, its fallback, has none for
such a model) and trains at tp 2 like one process."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.capture import trace_model
from hetpar.planner.options import SearchOptions
from hetpar.runtime.model_file import load_model_file
from hetpar.vocabulary import Sharding
from test_distributed import assert_trains_like_one_process

MINGPT = Path(__file__).parent / "models" / "mingpt_fused.py"
MASKED = {"flash": False}


def _plan(tp: int):
    options = SearchOptions(global_batch_size=8, dtype="fp32", schedule="1f1b", micro_batch_size=4, tp=tp, dp=1, pp=1)
    return plan_model(MINGPT, parse_cluster(f"1x{tp}xcpu"), options, model_args=MASKED)


def test_a_buffer_sliced_by_the_sequence_traces_with_fx():
    graph = trace_model(load_model_file(MINGPT, MASKED))
    assert graph.capture == "fx"
    assert [l.name for l in graph.layers][1:3] == ["transformer.h.0", "transformer.h.1"]
    assert all(l.tp_capable for l in graph.layers[1:3])


def test_nanogpt_written_out_attention_splits_its_mlp_and_vocabulary():
    (stage,) = _plan(2).stages
    assert stage.tp_sharding["transformer.h.0.mlp.c_fc"] is Sharding.COLWISE
    assert stage.tp_sharding["transformer.h.0.mlp.c_proj"] is Sharding.ROWWISE
    assert stage.tp_sharding["lm_head"] is Sharding.VOCAB_HEAD


@pytest.mark.slow
def test_nanogpt_written_out_attention_trains_like_one_process_at_tp_2(tmp_path):
    assert_trains_like_one_process(_plan(2), tmp_path, "adamw")
