"""The tensor-parallel ILP (planner.tensor_parallel): brute force, Megatron's pattern, valid plans.

A plan is checked by running the layer as ``tp`` ranks would, in one process: each
rank holds its slice of every split Linear, and the collectives (all-reduce of rowwise
outputs, all-gather of colwise_gather outputs) are done by hand. The result must be
the unsplit layer's, on real tensors.
"""

import copy
import itertools
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from hetpar.planner.capture import TpCostModel, find_sharding, layer_collectives
from hetpar.planner.capture.tp_collectives import forward_all_reduces
from hetpar.planner.capture.tp_dry_run import dry_run
from hetpar.planner.capture.tp_ilp import build_problem, evaluate, solve
from hetpar.planner.capture.tp_meta import shard_on_meta
from hetpar.planner.capture.tp_ops import linear_parts, run_graph
from hetpar.runtime.parts import PartLayout, copy_shape_arguments
from hetpar.vocabulary import Sharding
from hetpar.runtime.model_file import load_model_file


# Models ---------------------------------------------------------------------------------------------------------

class MLPStack(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class NormMLP(nn.Module):
    """A norm between two Linears: the first one's split output cannot reach it."""

    def __init__(self, width: int = 128):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return self.fc2(self.norm(F.relu(self.fc1(x))))


class ConvHead(nn.Module):
    def __init__(self, channels: int = 8, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(channels * 8 * 8, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(F.relu(self.conv(x)).flatten(1))))


class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    """RMSNorm, rotary q and k (a cat over the head dimension), SwiGLU."""

    def __init__(self, hidden: int = 128, heads: int = 4, seq: int = 8):
        super().__init__()
        self.head_dim = hidden // heads
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, 3 * hidden, bias=False)
        self.down = nn.Linear(3 * hidden, hidden, bias=False)
        angles = torch.outer(torch.arange(seq).float(), 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2) / self.head_dim))
        self.register_buffer("cos", torch.cat([angles.cos(), angles.cos()], -1))
        self.register_buffer("sin", torch.cat([angles.sin(), angles.sin()], -1))

    def rotate(self, t):
        half = self.head_dim // 2
        return t * self.cos + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * self.sin

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm1(x)
        q = self.rotate(self.q(h).view(B, T, -1, self.head_dim).transpose(1, 2))
        k = self.rotate(self.k(h).view(B, T, -1, self.head_dim).transpose(1, 2))
        v = self.v(h).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class FixedHeads(nn.Module):
    """Attention that views features as [heads, -1] with the head count fixed: a rank's
    half of q's features would become half of every head, so the dry run must refuse it."""

    def __init__(self, hidden: int = 128, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def qkv(self, x):
        B, T, _ = x.shape
        return (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


class WrittenOutAttention(FixedHeads):
    """Attention written out (Megatron-LM's 2022 ``CoreAttention``, nanoGPT's slow path):
    ``q.shape`` read on the split value, Q K^T, a causal mask buffer filled, softmax,
    times V; every op acts on whole heads, so q, k and v split by heads."""

    def __init__(self, hidden: int = 128, heads: int = 4, seq: int = 8):
        super().__init__(hidden, heads)
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores.masked_fill(self.causal, float("-inf")), dim=-1)
        return x + self.o((probs @ v).transpose(1, 2).reshape(B, T, -1))


class BatchMergedAttention(FixedHeads):
    """Megatron-LM's 2022 ``CoreAttention`` as written: heads folded into the batch
    ([B, H, T, D] -> [B*H, T, D]) for ``baddbmm`` and ``bmm``. A rank's heads are a
    contiguous slice of B*H only at B = 1, so q, k and v must not stay split by heads."""

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        b, h, t, d = q.shape
        scores = torch.baddbmm(q.new_empty(b * h, t, t), q.reshape(b * h, t, d), k.reshape(b * h, t, d).transpose(1, 2),
                               beta=0.0, alpha=d ** -0.5)
        y = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(b * h, t, d)).view(b, h, t, d)
        return x + self.o(y.transpose(1, 2).reshape(B, T, -1))


def test_heads_merged_with_the_batch_are_not_left_split():
    """[Note: dry runs of two samples]: at one sample the merge looks harmless; the dry run
    at two refuses it, as the program would at its micro-batch."""
    gm = fx.symbolic_trace(BatchMergedAttention().to("meta"))
    sharding = find_sharding(gm, [torch.empty(1, 8, 128, device="meta", requires_grad=True)])
    assert not all(sharding.get(p) is Sharding.COLWISE for p in "qkv")
    assert dry_run(gm, [torch.empty(1, 8, 128, device="meta", requires_grad=True)],
                   {"q": Sharding.COLWISE, "k": Sharding.COLWISE, "v": Sharding.COLWISE, "o": Sharding.ROWWISE}, 2) is not None


class FusedQKV(nn.Module):
    """One Linear for q, k and v, chunked: a chunk over split features mixes q, k and v."""

    def __init__(self, hidden: int = 128, heads: int = 4):
        super().__init__()
        self.head_dim = hidden // heads
        self.qkv, self.o = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


def gpt_block(hidden: int = 128, heads: int = 4) -> nn.Module:
    return load_model_file("examples/gpt.py", {"n_layers": 1, "hidden": hidden, "heads": heads}).build_model().blocks[0]


def mlp_block(width: int = 64) -> nn.Module:
    return load_model_file("examples/mlp.py", {"width": width}).build_model()[1]


MODELS = {  # name -> (module factory, input shape of one sample)
    "gpt_block": (gpt_block, (1, 8, 128)),
    "llama_block": (LlamaBlock, (1, 8, 128)),
    "mlp_stack": (MLPStack, (1, 128)),
    "norm_mlp": (NormMLP, (1, 128)),
    "conv_head": (ConvHead, (1, 3, 8, 8)),
    "examples_mlp_block": (mlp_block, (1, 64)),
}
SLOW_LINK = TpCostModel.for_device("V100-16GB", tp=2)  # 300 GB/s NVLink over ~14 TFLOP/s fp32: less to gain


def layer(name: str):
    """(real module, its fx graph on the meta device, meta inputs) for ``MODELS[name]``."""
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    module = factory()
    meta = fx.symbolic_trace(copy.deepcopy(module).to("meta"))
    return module, meta, [torch.empty(shape, device="meta", requires_grad=True)]


def brute_force(problem) -> int:
    names = [s.name for s in problem.linears]
    options = [list(s.choice_ticks) for s in problem.linears]
    costs = (evaluate(problem, dict(zip(names, combo))) for combo in itertools.product(*options))
    return min(c for c in costs if c is not None)


# ILP against brute force ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cost", [TpCostModel.for_device(), SLOW_LINK, TpCostModel.for_device(tp=4, latency=True)],
                         ids=["a100", "v100", "a100_tp4_latency"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ilp_matches_brute_force(name, cost):
    _, gm, inputs = layer(name)
    problem = build_problem(gm, inputs, cost)
    solution = solve(problem)
    assert solution.status == "optimal"
    assert evaluate(problem, solution.choices) == solution.objective_ticks
    assert solution.objective_ticks == brute_force(problem)


# Megatron's pattern, found -------------------------------------------------------------------------------------

def residual_branches(gm: fx.GraphModule) -> int:
    """Additions of a Linear's output to something else: the residual branches of a block."""
    linears = {n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear)}
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and n.target in (operator.add, torch.add) and linears & set(n.all_input_nodes))


def megatron_pattern(gm: fx.GraphModule) -> dict[str, Sharding]:
    """Megatron's sharding, read off the graph: a Linear whose output is added back to the
    residual stream is rowwise, every other Linear colwise."""
    out = {}
    for n in gm.graph.nodes:
        if n.op == "call_module" and isinstance(gm.get_submodule(n.target), nn.Linear):
            to_residual = any(u.op == "call_function" and u.target in (operator.add, torch.add) for u in n.users)
            out[str(n.target)] = Sharding.ROWWISE if to_residual else Sharding.COLWISE
    return out


@pytest.mark.parametrize("name", ["gpt_block", "llama_block"])
def test_megatron_pattern_on_transformer_blocks(name):
    _, gm, inputs = layer(name)
    sharding = find_sharding(gm, inputs)
    assert sharding == megatron_pattern(gm)
    assert forward_all_reduces(sharding) == residual_branches(gm) == 2


def test_megatron_pattern_on_every_gpt_layer_of_a_traced_model():
    from hetpar.planner.capture import trace_model

    graph = trace_model(load_model_file("examples/gpt.py", {"n_layers": 3, "hidden": 128}))
    for index in range(1, 4):
        prefix = f"blocks.{index - 1}."
        assert {p.removeprefix(prefix) for p, s in graph.tp_sharding[index].items() if s is Sharding.ROWWISE} == {
            "attn.o", "mlp.proj"}
        assert forward_all_reduces(graph.tp_sharding[index]) == 2


def test_a_narrow_block_stays_replicated_where_collectives_cost_more_than_the_split_saves():
    """Split work saves O(h^2) FLOPs per token; a collective moves O(h) bytes and waits its
    latency, which one sample of a narrow block cannot hide."""
    module = gpt_block(hidden=16, heads=2)
    gm = fx.symbolic_trace(module.to("meta"))
    inputs = [torch.empty(1, 8, 16, device="meta", requires_grad=True)]
    assert find_sharding(gm, inputs) != {}
    assert find_sharding(gm, inputs, cost=TpCostModel.for_device(latency=True)) == {}


# Valid plans, on real tensors ------------------------------------------------------------------------------------

def run_as_ranks(gm: fx.GraphModule, sharding: dict[str, Sharding], tp: int, inputs: list[torch.Tensor], *,
                 parts: dict[str, tuple[int, ...]] | None = None) -> list:
    """Each rank's output of ``gm`` under ``sharding``, collectives done by hand; a colwise
    Linear of ``parts`` holds each rank's slice of every part."""
    envs = [{} for _ in range(tp)]
    interpreters = [fx.Interpreter(gm) for _ in range(tp)]
    fed = iter(inputs)
    for node in gm.graph.nodes:
        how = sharding.get(str(node.target)) if node.op == "call_module" else None
        if node.op == "placeholder":
            value = next(fed)
            outs = [value] * tp
        elif how is not None:
            outs = _split_linear(gm.get_submodule(str(node.target)), how, [env[node.args[0]] for env in envs],
                                 (parts or {}).get(str(node.target)))
        else:
            outs = []
            for interpreter, env in zip(interpreters, envs):
                interpreter.env = env
                outs.append(interpreter.run_node(node))
        if node.op == "output":
            return outs
        for env, out in zip(envs, outs):
            env[node] = out
    raise AssertionError("no output node")


def _split_linear(linear: nn.Linear, how: Sharding, xs: list[torch.Tensor], parts=None) -> list[torch.Tensor]:
    tp = len(xs)
    if parts and how is Sharding.COLWISE:
        rows = [PartLayout(tuple(parts), tp).rank_rows(r) for r in range(tp)]
        return [F.linear(x, linear.weight[i], linear.bias[i] if linear.bias is not None else None) for x, i in zip(xs, rows)]
    if how in (Sharding.COLWISE, Sharding.COLWISE_GATHER):
        biases = linear.bias.chunk(tp) if linear.bias is not None else [None] * tp
        outs = [F.linear(x, w, b) for x, w, b in zip(xs, linear.weight.chunk(tp, 0), biases)]
        return [torch.cat(outs, -1)] * tp if how is Sharding.COLWISE_GATHER else outs
    if how is Sharding.ROWWISE_SLICE:
        xs = [x.chunk(tp, -1)[r] for r, x in enumerate(xs)]
    total = sum(F.linear(x, w) for x, w in zip(xs, linear.weight.chunk(tp, 1)))  # the all-reduce
    return [total + linear.bias if linear.bias is not None else total] * tp


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_chosen_plans_compute_the_unsplit_layer(name, tp):
    module, gm, inputs = layer(name)
    sharding = find_sharding(gm, inputs, cost=TpCostModel.for_device(tp=tp))
    assert sharding, f"{name}: nothing split"
    x = torch.randn(inputs[0].shape)
    real = fx.symbolic_trace(module)
    with torch.no_grad():
        expected = real(x)
        for out in run_as_ranks(real, sharding, tp, [x]):
            torch.testing.assert_close(out, expected)


def test_a_norm_after_a_linear_gathers_its_output():
    _, gm, inputs = layer("norm_mlp")
    sharding = find_sharding(gm, inputs)
    # Either way fc1's output reaches the norm whole; the two cost the same (an all-gather
    # and an all-reduce of one width, forward and backward swapped), so either may win.
    assert sharding["fc1"] in (Sharding.COLWISE_GATHER, Sharding.ROWWISE_SLICE)
    # one collective per split Linear and pass, the input's gradient in backward included
    collectives = layer_collectives(gm, inputs, sharding)
    assert [p for p, _, _ in collectives].count("forward") == [p for p, _, _ in collectives].count("backward") == len(sharding)


def test_mlp_stacks_pair_their_linears():
    for depth in (2, 3, 4, 5):
        module = MLPStack(depth=depth)
        gm = fx.symbolic_trace(module.to("meta"))
        sharding = find_sharding(gm, [torch.empty(1, 128, device="meta", requires_grad=True)])
        gathers = sum(1 for s in sharding.values() if s is Sharding.COLWISE_GATHER)
        # one collective per pair of Linears (colwise, rowwise), and one for the odd one out
        assert forward_all_reduces(sharding) + gathers == (depth + 1) // 2
        assert forward_all_reduces(sharding) >= depth // 2


# The dry run -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("factory", [FixedHeads, FusedQKV, WrittenOutAttention])
def test_fixed_head_counts_and_fused_qkv_split_with_local_shapes(factory):
    """A head count fixed in the code and a chunked fused qkv split on the first solve
    (issue 30): the dry run makes the shape constants local ([Note: local shape
    constants]) and lays the fused Linear part by part ([Note: part-laid Linears]), and
    the ranks compute the unsplit layer."""
    torch.manual_seed(0)
    module = factory()
    gm = fx.symbolic_trace(copy.deepcopy(module).to("meta"))
    inputs = [torch.empty(1, 8, 128, device="meta", requires_grad=True)]
    problem = build_problem(gm, inputs, TpCostModel.for_device())
    sharding = solve(problem).sharding(problem)
    assert Sharding.COLWISE in sharding.values() and dry_run(gm, inputs, sharding, 2) is None
    if factory is WrittenOutAttention:  # split by heads: no gather anywhere
        assert sharding == {"q": Sharding.COLWISE, "k": Sharding.COLWISE, "v": Sharding.COLWISE, "o": Sharding.ROWWISE}
    x = torch.randn(1, 8, 128)
    real = fx.symbolic_trace(module)
    local = copy.deepcopy(real)
    copy_shape_arguments(shard_on_meta(gm, sharding, 2, inputs), local,
                         {n.name for n in gm.graph.nodes if n.op in ("call_method", "call_function")})
    parts = linear_parts(gm, sharding, run_graph(gm, inputs))
    with torch.no_grad():
        for out in run_as_ranks(local, sharding, 2, [x], parts=parts):
            torch.testing.assert_close(out, real(x))


def test_dry_run_catches_heads_that_do_not_divide():
    module = gpt_block(hidden=96, heads=3)  # tp=2 splits 96 features, but not 3 heads of 32
    gm = fx.symbolic_trace(module.to("meta"))
    sharding = find_sharding(gm, [torch.empty(1, 8, 96, device="meta", requires_grad=True)])
    # q may still be computed split and gathered whole (colwise_gather), never left split by heads
    assert sharding.get("attn.q") is not Sharding.COLWISE and sharding["mlp.fc"] is Sharding.COLWISE


# The runtime applies every choice ---------------------------------------------------------------------------------

def test_runtime_accepts_every_sharding(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hetpar.runtime.shard import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        module = MLPStack(width=8, depth=4)
        x = torch.randn(2, 8)
        expected = module(x)
        linear = [s for s in Sharding if s not in (Sharding.VOCAB_EMBEDDING, Sharding.VOCAB_HEAD)]  # tests/test_vocab_parallel.py
        apply_tensor_parallel(module, mesh, {f"layers.{i}": s.value for i, s in enumerate(linear)})
        torch.testing.assert_close(module(x), expected)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_plan_with_every_sharding_trains_like_one_process(tmp_path, mlp_path):
    """examples/mlp.py as the trace shards it: its input Linear gathers (a norm follows),
    its blocks pair up, its output Linear slices a replicated input."""
    from conftest import build_plan
    from test_distributed import assert_trains_like_one_process

    from hetpar.planner.capture import trace_model

    args = {"depth": 1, "width": 256, "in_features": 128, "out_features": 64}
    graph = trace_model(load_model_file(mlp_path, args))
    sharding = {path: how.value for layer in graph.tp_sharding for path, how in layer.items()}
    vocab = {Sharding.VOCAB_EMBEDDING, Sharding.VOCAB_HEAD}  # a regression model has no vocabulary: tests/test_vocab_parallel.py
    assert set(sharding.values()) == {s.value for s in Sharding if s not in vocab}
    plan = build_plan(mlp_path, args, splits=[list(range(len(graph.layers)))], tensor_parallel=2,
                      tp_sharding=[sharding], num_microbatches=2)
    assert_trains_like_one_process(plan, tmp_path)
