"""Context parallelism in the program (issue 32, item 2): every sequence split over cp
ranks, attention all-gathering keys and values ([Note: context parallelism] in
hetpar/runtime/context.py).

The fast tests run in one process: the chunks, positions and masks; the attention of two
context ranks simulated without a process group against plain causal SDPA (outputs and
gradients); stages cut with a context-parallel group of one rank against the whole
model (fx GPT and Hugging Face Llama); refusals; the program's text. The slow ones run
compiled programs under torchrun on gloo and compare them with one process training on
the same global batch ([Note: float tolerance] in tests/test_distributed.py), for
examples/gpt.py (fx) and a tiny Hugging Face Llama (module stages).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ROOT, run_torchrun
from test_distributed import (
    LR,
    assert_matches_reference,
    assert_within_rounding,
    exact_references,
    run_compiled,
)

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.options import SearchOptions
from hetpar.planner.plan import ParallelPlan
from hetpar.rewriters import compile_plan
from hetpar.rewriters.program import program_source
from hetpar.runtime.context import (
    ATTENTION,
    POSITIONS,
    ContextParallelError,
    ContextSplit,
    attend,
    attention_mask,
    chunk_positions,
    context_attention,
    global_order,
    local_positions,
    split_batches,
    split_sequence,
)
from hetpar.runtime.distributed import StageSpec, locate
from hetpar.runtime.graph import trace_layers
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.shard import ShardError, cut_stage
from hetpar.runtime.training import read_metrics

GPT = ROOT / "examples" / "gpt.py"
GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
ZOO = ROOT / "tests" / "models" / "hf_default_zoo.py"
LLAMA_ARGS = {"family": "llama"}
GLOBAL_BATCH = 8


def cp_plan(model: Path, args: dict, *, cp: int, dp: int = 1, tp: int = 1, pp: int = 1, micro_batch_size: int = 2,
            **pins) -> ParallelPlan:
    """The planner's plan of dp * cp x tp x pp ranks, its rows then made cp context ranks
    of each of dp data replicas by hand (so that the runtime's tests do not hang on what
    the search prices; ``test_plans_the_search_makes_with_cp_train_like_one_process``
    runs the search's own): each replica's micro-batches hold cp times the rows, so the
    global batch stays."""
    options = SearchOptions(global_batch_size=GLOBAL_BATCH, dtype="fp32", **{"schedule": "1f1b", **pins}, dp=dp * cp,
                            tp=tp, pp=pp, micro_batch_size=micro_batch_size)
    plan = plan_model(model, parse_cluster(f"1x{dp * cp * tp * pp}xcpu"), options, model_args=args)
    stages = [dataclasses.replace(s, context_parallel=cp) for s in plan.stages]
    return dataclasses.replace(plan, stages=stages, data_parallel=dp, micro_batch_size=plan.micro_batch_size * cp,
                               replica_batch_shares=None)


# ----------------------------------------------------------------------------- chunks, positions, masks


def test_each_rank_holds_chunk_j_and_its_mirror():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    held = torch.cat([chunk_positions(24, 3, j) for j in range(3)])
    assert sorted(held.tolist()) == list(range(24))  # the ranks' chunks partition the sequence
    assert chunk_positions(24, 3, 1).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert local_positions(4, 2, 1).tolist() == [2, 3, 4, 5]  # from the rank's own length
    with pytest.raises(ContextParallelError, match=r"a sequence of 6 tokens does not split into 2 \* "
                                                   r"context_parallel\(2\) equal chunks; use a sequence length "
                                                   r"divisible by 4"):
        chunk_positions(6, 2, 0)


def test_gathered_chunks_go_back_to_global_order():
    for local, cp in ((2, 2), (4, 3), (6, 1)):
        gathered = torch.cat([local_positions(local, cp, r) for r in range(cp)])  # what all_gather returns
        assert gathered[global_order(local, cp)].tolist() == list(range(local * cp))


def test_inputs_and_targets_split_alike_along_the_sequence():
    tokens = torch.arange(16).view(2, 8)
    targets = tokens + 100
    (inputs,), labels = next(split_batches(iter([((tokens,), targets)]), 2, 1))
    assert inputs.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert labels.tolist() == (inputs + 100).tolist()
    with pytest.raises(ContextParallelError, match=r"a tensor of shape \[8\] has none"):
        split_sequence(torch.zeros(8), 2, 0)


def test_mask_is_causal_by_position_within_the_window():
    q, k = torch.tensor([2, 5]), torch.arange(6)
    assert attention_mask(q, k).int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert attention_mask(q, k, sliding_window=2).int().tolist() == [[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("cp,kv_heads,window", [(2, 4, None), (3, 2, None), (2, 2, 5)],
                         ids=["cp2", "cp3_gqa", "window"])
def test_simulated_context_ranks_attend_like_causal_sdpa(cp, kv_heads, window):
    """Each of cp ranks attends its chunks' queries to the gathered keys (here: all keys,
    no process group); outputs and gradients, summed over the ranks as the reduce-scatter
    sums them, equal one causal SDPA over the whole sequence."""
    torch.manual_seed(0)
    b, heads, seq, d = 2, 4, 12 * cp, 8
    q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    grad_out = torch.randn(b, heads, seq, d, dtype=torch.float64)
    gqa = kv_heads != heads
    full_mask = attention_mask(torch.arange(seq), torch.arange(seq), sliding_window=window) if window else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask, is_causal=window is None, enable_gqa=gqa)
    want = torch.autograd.grad(expected, (q, k, v), grad_out)
    out = torch.empty_like(expected)
    total = 0
    for j in range(cp):
        positions = chunk_positions(seq, cp, j)
        mine = attend(q[:, :, positions], k, v, positions, torch.arange(seq), sliding_window=window, enable_gqa=gqa)
        out[:, :, positions] = mine.detach()
        total = total + (mine * grad_out[:, :, positions]).sum()
    torch.testing.assert_close(out, expected)
    for got, grad in zip(torch.autograd.grad(total, (q, k, v)), want):
        torch.testing.assert_close(got, grad)


@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window"])
def test_attention_layers_share_one_mask_on_cpu(window):
    """On CPU, where torch would build the causal chunk's mask (or the window's) in every
    call and keep it for backward, two attention calls keep one mask between them, and
    attend as causal SDPA (cp 1: the rank holds both chunks, the second under the
    lower-right bias; no process group)."""
    torch.manual_seed(0)
    split = ContextSplit(cp=1, index=0)
    q, k, v = (torch.randn(2, 4, 24, 8, requires_grad=True) for _ in range(3))
    masks = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2:  # q, k, v, outputs and log-sum-exps have more dimensions
            masks.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        first = context_attention(split, q, k, v, causal=True, sliding_window=window)
        second = context_attention(split, q, k, v, causal=True, sliding_window=window)
    assert len(masks) == 2 and len(set(masks)) == 1
    full = attention_mask(torch.arange(24), torch.arange(24), sliding_window=window) if window else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full, is_causal=window is None)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    grads = torch.autograd.grad(first.sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.sum(), (q, k, v))):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- stages with a group of one rank


@pytest.fixture
def one_rank_cp_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fx_gpt_stage_calls_context_positions_and_attention(one_rank_cp_mesh, recompute):
    model_file = load_model_file(GPT, GPT_ARGS)
    torch.manual_seed(0)
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    stage = cut_stage(model, model_file, 2, (0, len(names) - 1), names, recompute=recompute, cp_mesh=one_rank_cp_mesh)
    if recompute == "none":
        calls = [n.target for n in stage.module.graph.nodes if n.op == "call_module"]
        assert calls.count(POSITIONS) == 1 and calls.count(ATTENTION) == GPT_ARGS["n_layers"]
        assert not any(n.target is F.scaled_dot_product_attention for n in stage.module.graph.nodes)
    tokens = torch.randint(0, GPT_ARGS["vocab"], (2, GPT_ARGS["seq_len"]))
    torch.testing.assert_close(stage.module(tokens), model(tokens))


def test_fx_gpt_pipeline_stage_receives_the_local_sequence(one_rank_cp_mesh, monkeypatch):
    """A later stage's receive shapes are [b, T / cp, h]: the stage is cut from a local example."""
    import hetpar.runtime.shard as shard

    model_file = load_model_file(GPT, GPT_ARGS)
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    monkeypatch.setattr(shard.ContextSplit, "of", classmethod(lambda cls, mesh: cls(cp=2, index=1, group=None)))
    stage = cut_stage(model, model_file, 2, (2, len(names) - 1), names, cp_mesh=one_rank_cp_mesh)
    assert [spec.shape for spec in stage.recv] == [(2, GPT_ARGS["seq_len"] // 2, GPT_ARGS["hidden"])]


@pytest.mark.parametrize("family,window", [("llama", None), ("mistral", 3), ("qwen2", None), ("gemma", None),
                                           ("phi", None), ("gpt_neox", None), ("mixtral", None), ("gpt2", None),
                                           ("opt", None)],
                         ids=["llama", "mistral_window_3", "qwen2", "gemma", "phi", "gpt_neox", "mixtral", "gpt2", "opt"])
def test_hugging_face_stage_attends_through_hetpar(one_rank_cp_mesh, family, window):
    """The attention function hetpar registers equals the model's own in every family a
    module stage runs, sliding window included."""
    pytest.importorskip("transformers")
    model_file = load_model_file(ZOO, {"family": family})
    torch.manual_seed(0)
    model = model_file.build_model().eval()  # GPT-2's and OPT's default dropout draws differently in each run
    if window is not None:  # shorter than the sequence of 8, so that it masks
        model.config.sliding_window = window
    names = list(trace_layers(model, example_inputs=model_file.example_inputs(2)).layer_names)
    stage = cut_stage(model, model_file, 2, (0, len(names) - 1), names, cp_mesh=one_rank_cp_mesh)
    implementations = {m.config._attn_implementation for m in model.modules() if type(m).__name__.endswith("Attention")}
    assert implementations == {"hetpar_context"}
    assert model.config._attn_implementation != "hetpar_context"  # the stage's own copy of the config
    tokens = model_file.example_inputs(2)[0]
    torch.testing.assert_close(stage.module(tokens).logits, model(tokens).logits)


HAND_WRITTEN = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, dim=-1)
        MASKED
        return x + y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 32)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs(batch_size, **_):
    return (torch.zeros(batch_size, 8, dtype=torch.long),)
"""


@pytest.mark.parametrize("attention,message", [
    ("y = F.scaled_dot_product_attention(q, k, v, is_causal=True) + torch.softmax(q @ k.transpose(-2, -1), -1) @ v",
     r"a softmax of a product of two activations"),
    ("y = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))",
     r"scaled_dot_product_attention with an explicit attn_mask"),
], ids=["by_hand", "attn_mask"])
def test_attention_context_parallelism_cannot_split_is_refused(one_rank_cp_mesh, tmp_path, attention, message):
    path = tmp_path / "net.py"
    path.write_text(HAND_WRITTEN.replace("MASKED", attention))
    model_file = load_model_file(path, {})
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    with pytest.raises(ShardError, match=message):
        cut_stage(model, model_file, 2, (0, len(names) - 1), names, cp_mesh=one_rank_cp_mesh)


def test_positions_not_read_from_the_sequence_and_multihead_attention_are_refused(one_rank_cp_mesh, tmp_path):
    """An arange as long as the sequence but not of its length (here half the width of
    16) may or may not count positions: refused rather than guessed."""
    path = tmp_path / "net.py"
    half_width = "x = self.emb(idx)\n        x = x + torch.arange(x.shape[-1] // 2, device=x.device).repeat(2)"
    path.write_text(HAND_WRITTEN.replace("MASKED", "y = F.scaled_dot_product_attention(q, k, v, is_causal=True)")
                    .replace("x = self.emb(idx)", half_width))
    model_file = load_model_file(path, {})
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    with pytest.raises(ShardError, match=r"torch.arange\(floordiv\) has the length of a sequence here but is not "
                                         r"read from a tensor's shape along the sequence"):
        cut_stage(model, model_file, 4, (0, len(names) - 1), names, cp_mesh=one_rank_cp_mesh)

    class WithMultihead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    gm = torch.fx.symbolic_trace(WithMultihead(), concrete_args=None)
    from hetpar.runtime.context import ContextSplit, apply_to_graph

    with pytest.raises(ContextParallelError, match=r"nn.MultiheadAttention under context parallelism"):
        apply_to_graph(torch.fx.GraphModule(gm, gm.graph), {}, {}, 8, ContextSplit(cp=1, index=0))


def test_models_without_attention_or_captured_by_export_are_refused(one_rank_cp_mesh, tmp_path):
    mlp = load_model_file(ROOT / "examples" / "mlp.py", {})  # its dimension 1 is features, not a sequence
    names = list(trace_layers(mlp.build_model()).layer_names)
    with pytest.raises(ShardError, match=r"context parallelism of mlp.py: the model calls no "
                                         r"F.scaled_dot_product_attention"):
        cut_stage(mlp.build_model(), mlp, 2, (0, len(names) - 1), names, cp_mesh=one_rank_cp_mesh)
    path = tmp_path / "branchy.py"  # a branch on a shape: torch.fx cannot trace it, torch.export can
    branch = "y = F.scaled_dot_product_attention(q, k, v, is_causal=True)\n        if x.shape[1] > 1:\n" \
             "            y = y * 2"
    path.write_text(HAND_WRITTEN.replace("MASKED", branch))
    model_file = load_model_file(path, {})
    model = model_file.build_model()
    layered = trace_layers(model, example_inputs=model_file.example_inputs(2))
    assert layered.capture == "export"
    names = list(layered.layer_names)
    with pytest.raises(ShardError, match=r"context parallelism of branchy.py: a model captured with torch.export is "
                                         r"not supported"):
        cut_stage(model, model_file, 2, (0, len(names) - 1), names, cp_mesh=one_rank_cp_mesh)


# ----------------------------------------------------------------------------- layout and program


def test_a_context_rank_keeps_its_share_the_gathered_keys_and_values_and_its_joined_output():
    """[Note: context parallelism costs]: a GPT block's attention reads keys and values of
    [T, h] each and makes an output of [T, h] per sample (fp32); at cp 2 a rank keeps half
    of the block's saved bytes, the other rank's half of the keys and values, and the
    concatenation of its two chunks' outputs."""
    from hetpar.planner.capture.trace import trace_model

    args = {"n_layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 64}
    block = next(l for l in trace_model(load_model_file(ROOT / "examples" / "gpt.py", args)).layers
                 if l.name.startswith("blocks."))
    whole = args["seq_len"] * args["hidden"] * 4
    assert block.attention_kv_bytes == 2 * whole and block.attention_out_bytes == whole
    rank = block.at_context(2)
    assert rank.saved_activation_bytes == pytest.approx(block.saved_activation_bytes / 2 + whole + whole / 2)
    assert rank.attention_out_bytes == block.attention_out_bytes  # the whole sequence's, as the exchange's keys


def test_rows_are_data_replicas_times_context_ranks():
    stages = [StageSpec(layers=(0, 1), device_type="cpu", tensor_parallel=2, ranks=[[0, 1], [2, 3], [4, 5], [6, 7]],
                        context_parallel=2)]
    me = locate(stages, 7)  # row 3: data replica 1, context index 1
    assert (me.replica, me.data_replica, me.context_index, me.tp_index) == (3, 1, 1, 1)
    assert (locate(stages, 2).data_replica, locate(stages, 2).context_index) == (0, 1)


def test_program_splits_sequences_only_where_the_plan_does():
    plan = cp_plan(GPT, GPT_ARGS, cp=2)
    assert plan.data_parallel == 1 and plan.context_parallel == 2 and plan.global_batch_size == GLOBAL_BATCH
    source = program_source(plan)
    for line in ("CONTEXT_PARALLEL = 2", "cp_mesh=groups.cp_mesh", "REPLICA_MICRO_BATCH_SIZES[me.data_replica]",
                 "data = context.split_batches(data, CONTEXT_PARALLEL, me.context_index)",
                 "context_parallel=CONTEXT_PARALLEL)", "grad_sync = data_parallel.wrap(", "dp 1 x cp 2 x pp 1"):
        assert line in source, line
    compile(source, "train.py", "exec")
    plain = program_source(cp_plan(GPT, GPT_ARGS, cp=1))
    assert "context" not in plain and "data_replica" not in plain and "cp_mesh" not in plain


# ----------------------------------------------------------------------------- under torchrun

# (dp, cp, tp, pp, optimizer) of each run: every layout trains with SGD on one model and AdamW on the other
LAYOUTS = {
    "cp2": (1, 2, 1, 1, "sgd"),
    "cp2_tp2": (1, 2, 2, 1, "adamw"),
    "cp2_pp2": (1, 2, 1, 2, "sgd"),
    "dp2_cp2": (2, 2, 1, 1, "adamw"),  # rows 0, 1 read data replica 0's rows of each batch, rows 2, 3 replica 1's
}
OTHER = {"sgd": "adamw", "adamw": "sgd"}


def _trains_like_one_process(plan: ParallelPlan, tmp_path: Path, optimizer: str) -> None:
    run = run_compiled(plan, tmp_path, optimizer)
    assert ", cp 2," in run.stderr, run.stderr[-2000:]
    assert_matches_reference(plan, run.init_state, optimizer, len(run.losses), run.losses, run.final, run.ref_state)
    assert run.ref_losses[-1] != run.ref_losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_trains_like_one_process(tmp_path, layout):
    dp, cp, tp, pp, optimizer = LAYOUTS[layout]
    plan = cp_plan(GPT, GPT_ARGS, dp=dp, cp=cp, tp=tp, pp=pp, micro_batch_size=2 // dp)
    assert (plan.data_parallel, plan.pipeline_parallel, plan.stages[0].tensor_parallel) == (dp, pp, tp)
    _trains_like_one_process(plan, tmp_path, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama_trains_like_one_process(tmp_path, layout):
    pytest.importorskip("transformers")
    dp, cp, tp, pp, optimizer = LAYOUTS[layout]
    plan = cp_plan(ZOO, LLAMA_ARGS, dp=dp, cp=cp, tp=tp, pp=pp, micro_batch_size=2 // dp)
    assert (plan.data_parallel, plan.pipeline_parallel, plan.stages[0].tensor_parallel) == (dp, pp, tp)
    _trains_like_one_process(plan, tmp_path, OTHER[optimizer])


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_zero_over_the_column_trains_like_one_process(tmp_path, zero_stage):
    """FSDP2 shards over all dp * cp rows of the column and averages their gradients: the
    mean over data replicas and context chunks, as the all-reduce does."""
    plan = cp_plan(GPT, GPT_ARGS, cp=2)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(s, zero_stage=zero_stage) for s in plan.stages])
    run = run_compiled(plan, tmp_path, "adamw")
    assert f"ZeRO-{zero_stage} through FSDP2 over 2 replicas" in run.stderr, run.stderr[-2000:]
    assert_matches_reference(plan, run.init_state, "adamw", len(run.losses), run.losses, run.final, run.ref_state)


@pytest.mark.slow
@pytest.mark.parametrize("model,args", [(GPT, GPT_ARGS), (ZOO, LLAMA_ARGS)], ids=["gpt", "llama"])
def test_zero_bubble_and_recompute_train_like_one_process(tmp_path, model, args):
    """W actions run the all-gather's backward (a reduce-scatter) again, and recompute runs
    its forward again in the backward: every rank of a context group alike."""
    if model == ZOO:
        pytest.importorskip("transformers")
    plan = cp_plan(model, args, cp=2, pp=2, micro_batch_size=1, schedule="zb", recompute="full")
    assert plan.schedule == "zb" and all(s.recompute == "full" for s in plan.stages)
    _trains_like_one_process(plan, tmp_path, "sgd")


@pytest.mark.slow
def test_checkpoint_at_cp_2_resumes_in_one_process(tmp_path):
    """Every row of a cp 2 program holds the stage's whole parameters: its checkpoint holds
    the model's own tensors and a program without context parallelism resumes from it,
    ending where one uninterrupted process ends."""
    steps, optimizer = 4, "adamw"
    torch.manual_seed(1234)
    init_state = load_model_file(GPT, GPT_ARGS).build_model().state_dict()
    checkpoints = ["--checkpoint-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    _run(cp_plan(GPT, GPT_ARGS, cp=2), tmp_path / "cp2", init_state, optimizer, [*checkpoints, "--steps", "2"])
    plain = cp_plan(GPT, GPT_ARGS, cp=1)
    final, stderr = _run(plain, tmp_path / "cp1", init_state, optimizer, [*checkpoints, "--steps", str(steps)])
    assert "resum" in stderr and "step 3" in stderr, stderr[-2000:]
    losses = [r["loss"] for r in read_metrics(tmp_path / "cp1" / "m.jsonl")]
    assert len(losses) == steps - 2
    reference, exact_losses, exact, sensitivity = exact_references(plain, init_state, optimizer, steps)
    assert_within_rounding(optimizer, steps, exact_losses[:2] + losses, final, reference, exact_losses, exact,
                           sensitivity)


def _run(plan: ParallelPlan, out: Path, init_state: dict, optimizer: str, args: list[str]) -> tuple[dict, str]:
    """Compile ``plan`` into ``out`` and run it from ``init_state``: its --save-final state and stderr."""
    compile_plan(plan, out)
    torch.save(init_state, out / "init.pt")
    result = run_torchrun(out / "train.py", plan.cluster.world_size,
                          ["--optimizer", optimizer, "--lr", str(LR[optimizer]), "--init-from", "init.pt",
                           "--save-final", "final.pt", "--metrics", "m.jsonl", *args])
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out / "final.pt", weights_only=True), result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model,args", [(GPT, GPT_ARGS), (ZOO, LLAMA_ARGS)], ids=["gpt", "llama"])
def test_with_sequence_parallelism_trains_like_one_process(tmp_path, model, args):
    """Sequence parallelism shards each rank's T / cp tokens again over its tp ranks between
    the attention and MLP blocks; attention still sees the rank's whole share."""
    if model == ZOO:
        pytest.importorskip("transformers")
    plan = cp_plan(model, args, cp=2, tp=2)
    plan = dataclasses.replace(plan, stages=[dataclasses.replace(s, sequence_parallel=True) for s in plan.stages])
    _trains_like_one_process(plan, tmp_path, "sgd")


@pytest.mark.slow
@pytest.mark.parametrize("model,args,pins", [(GPT, GPT_ARGS, dict(tp=1, pp=2)), (ZOO, LLAMA_ARGS, dict(tp=2, pp=1))],
                         ids=["gpt_cp2_pp2", "llama_cp2_tp2"])
def test_plans_the_search_makes_with_cp_train_like_one_process(tmp_path, model, args, pins):
    """End to end: ``hetpar plan --cp 2`` (the search's own layer split and sharding) compiled and run."""
    if model == ZOO:
        pytest.importorskip("transformers")
    options = SearchOptions(global_batch_size=GLOBAL_BATCH, dtype="fp32", schedule="1f1b", dp=1, cp=2,
                            micro_batch_size=2, **pins)
    plan = plan_model(model, parse_cluster("1x4xcpu"), options, model_args=args)
    assert (plan.data_parallel, plan.context_parallel, plan.global_batch_size) == (1, 2, GLOBAL_BATCH)
    _trains_like_one_process(plan, tmp_path, "adamw")


@pytest.mark.slow
def test_tied_gpt2_with_learned_positions_trains_like_one_process(tmp_path):
    """GPT-2's learned position embeddings read the rank's positions; its tied embedding and
    head, held by both pipeline stages, keep one value on every row."""
    pytest.importorskip("transformers")
    from test_distributed import HF_GPT2

    model = tmp_path / "hfgpt2.py"
    model.write_text(HF_GPT2)
    plan = cp_plan(model, {}, cp=2, pp=2, micro_batch_size=1)
    run = run_compiled(plan, tmp_path, "adamw")
    assert torch.equal(run.final["transformer.wte.weight"], run.final["lm_head.weight"])
    assert_matches_reference(plan, run.init_state, "adamw", len(run.losses), run.losses, run.final, run.ref_state)
