"""No plan predicts more work per second than its devices can do (issue 31).

The work of a step is counted here without hetpar: 6 FLOPs per token for each weight a
token meets in a matmul (2 forward, 4 backward), the experts' weights counted at
top-k / experts of their number (a token meets k experts), embeddings left out (a
lookup). That is a lower bound of the model's FLOPs (attention scores are left out), so
a plan whose predicted step time makes that work run faster than the sum of its
devices' peak rates in the plan's dtype is wrong: work the tracer missed (experts
counted as zero) would show up here, on the models users bring.
"""

import math
from pathlib import Path

import pytest
import torch

from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_graph
from hetpar.planner.capture import trace_model
from hetpar.planner.options import SearchOptions
from hetpar.runtime.experts import experts_modules
from hetpar.runtime.model_file import load_model_file

ROOT = Path(__file__).resolve().parent.parent

# (model file, model args, cluster, global batch, dtype)
CASES = [
    ("examples/gpt.py", {}, "1x4xcpu", 8, "fp32"),
    ("examples/moe_gpt.py", {}, "1x4xcpu", 8, "fp32"),
    ("examples/moe_gpt.py", {"hidden": 512, "ffn": 1024, "experts": 16, "seq_len": 256}, "2x8xA100-80GB", 64, "bf16"),
    ("tests/models/hf_default_zoo.py", {"family": "llama", "size": "default"}, "4x8xH100-80GB", 64, "bf16"),
    ("tests/models/hf_default_zoo.py", {"family": "mixtral", "size": "default", "seq": 4096}, "4x8xA100-80GB", 64, "bf16"),
    ("tests/models/hf_default_zoo.py", {"family": "mixtral", "size": "tiny"}, "1x4xcpu", 8, "fp32"),
]


@pytest.mark.parametrize("path,args,spec,batch,dtype", CASES, ids=[f"{Path(c[0]).stem}-{'-'.join(map(str, c[1].values())) or 'default'}-{c[2]}" for c in CASES])
def test_no_plan_claims_more_than_its_devices_peak(path, args, spec, batch, dtype):
    model_file = load_model_file(ROOT / path, args)
    graph = trace_model(model_file)
    cluster = parse_cluster(spec)
    options = SearchOptions(global_batch_size=batch, dtype=dtype, work_limit_s=2.0)
    plan = plan_graph(graph, cluster, options)
    flops_per_step = _matmul_flops_lower_bound(model_file) * batch
    peak = sum(cluster.profile(t).peak_flops(dtype) for t in cluster.device_types())
    claimed = flops_per_step / plan.predicted.step_time_s
    assert flops_per_step > 0
    assert claimed <= peak, f"{path} {args}: the plan claims {claimed / 1e12:.1f} TFLOP/s on {peak / 1e12:.1f} TFLOP/s of devices"


def _matmul_flops_lower_bound(model_file) -> float:
    """6 x the weights a token meets in matmuls x tokens per sample, per sample."""
    with torch.device("meta"):
        model = model_file.build_model()
    tokens = model_file.example_inputs(1)[0].numel()
    experts = experts_modules(model)
    top_k = _top_k(model)
    in_experts = {id(p) for _, m in experts for p in m.parameters()}
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    dense = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                if p.dim() >= 2 and id(p) not in in_experts | embeddings)
    routed = sum(p.numel() * top_k / m.num_experts for _, m in experts for p in m.parameters() if p.dim() >= 3)
    return 6 * (dense + routed) * tokens


def _top_k(model) -> int:
    config = getattr(model, "config", None)
    for name in ("num_experts_per_tok", "top_k", "moe_topk"):
        if isinstance(getattr(config, name, None), int):
            return getattr(config, name)
    ks = {m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)}
    return ks.pop() if len(ks) == 1 else 0 if not ks else math.nan
