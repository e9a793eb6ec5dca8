"""Expert parallelism in the program (issue 31): the experts of a mixture of experts split
over data-parallel replicas, tokens sent to them by all-to-all ([Note: expert
parallelism] in hetpar/runtime/experts.py).

The fast tests run in one process (a process group of one rank: the dispatch's sorting,
exchanges and weighting against the unsplit module; routing; the program's text). The
slow ones run compiled programs under torchrun on gloo and compare them with one
process training on the same global batch ([Note: float tolerance] in
tests/test_distributed.py), for examples/moe_gpt.py (experts traced as one fx call) and
Hugging Face's Mixtral (module stages).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, checkpoint_model_tensors, run_torchrun
from hetpar.cost_models.cluster import parse_cluster
from hetpar.planner.api import plan_model
from hetpar.planner.options import SearchOptions
from hetpar.planner.plan import ParallelPlan
from hetpar.rewriters import compile_plan
from hetpar.rewriters.program import program_source
from hetpar.runtime.distributed import StageSpec
from hetpar.runtime.experts import (ExpertParallelError, ExpertParallelForward, RoutingLoad, apply_expert_parallel,
                                    expert_parameters, route)
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.training import read_metrics
from test_distributed import LR, assert_matches_reference, assert_within_rounding, exact_references, run_compiled

MOE_GPT = ROOT / "examples" / "moe_gpt.py"
MOE_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "experts": 4, "top_k": 2, "ffn": 32, "vocab": 64, "seq_len": 16}
ZOO = ROOT / "tests" / "models" / "hf_default_zoo.py"
MIXTRAL_ARGS = {"family": "mixtral"}
GLOBAL_BATCH = 8


def _plan(model: Path, args: dict, *, dp: int, ep: int, tp: int = 1, pp: int = 1, micro_batch_size: int = 2,
          **pins) -> ParallelPlan:
    """The planner's plan of dp x tp x pp ranks, its experts split over ep replicas
    (``hetpar plan --dp --tp --pp --ep``)."""
    options = SearchOptions(global_batch_size=GLOBAL_BATCH, dtype="fp32", **{"schedule": "1f1b", **pins}, dp=dp, tp=tp,
                            pp=pp, ep=ep, micro_batch_size=micro_batch_size)
    plan = plan_model(model, parse_cluster(f"1x{dp * tp * pp}xcpu"), options, model_args=args)
    assert [s.expert_parallel for s in plan.stages] == [ep] * len(plan.stages)
    return plan


@pytest.fixture
def float64_experts(monkeypatch):
    """torch's grouped matmul has no float64 kernel: in the float64 reference of
    [Note: float tolerance], Mixtral takes transformers' own fallback (a matmul per
    expert) and moe_gpt's ``F.grouped_mm`` a matmul per group."""
    grouped_mm = torch.nn.functional.grouped_mm

    def per_group(a, b, *, offs=None, **kwargs):
        if a.dtype != torch.float64:
            return grouped_mm(a, b, offs=offs, **kwargs)
        starts = [0, *offs.tolist()[:-1]]
        return torch.cat([a[start:end] @ b[g] for g, (start, end) in enumerate(zip(starts, offs.tolist()))])

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", per_group)
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        return
    can_use = moe._can_use_grouped_mm
    monkeypatch.setattr(moe, "_can_use_grouped_mm",
                        lambda input, weight, offs: weight.dtype != torch.float64 and can_use(input, weight, offs))


# ----------------------------------------------------------------------------- one process


def test_route_sorts_rows_by_rank_and_numbers_experts_locally():
    top_k_index = torch.tensor([[3, 0], [1, 2], [2, 3]])  # rows 0..5 = token * 2 + choice
    order, counts, local_ids = route(top_k_index, per_rank=2, ep=2)
    assert order.tolist() == [1, 2, 0, 3, 4, 5]  # experts 0, 1 (rank 0), then 3, 2, 2, 3 (rank 1), stably
    assert counts.tolist() == [2, 4]
    assert local_ids.tolist() == [0, 1, 1, 0, 0, 1]
    order, counts, local_ids = route(top_k_index, per_rank=4, ep=1)
    assert order.tolist() == list(range(6)) and counts.tolist() == [6] and local_ids.tolist() == [3, 0, 1, 2, 2, 3]


@pytest.fixture
def one_rank_mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def _experts_of(family: str) -> torch.nn.Module:
    if family == "moe_gpt":
        return load_model_file(MOE_GPT, MOE_ARGS).build_model().blocks[0].moe.experts
    pytest.importorskip("transformers")
    experts = load_model_file(ZOO, {"family": family}).build_model().model.layers[0].mlp.experts
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    return experts


@pytest.mark.parametrize("family", ["moe_gpt", "mixtral"])
def test_dispatch_equals_the_unsplit_module_and_its_gradients(one_rank_mesh, family):
    """Through the dispatch (sorting, exchanges, the module's own forward on one choice
    per row, weights applied after), outputs and gradients equal the module's own."""
    torch.manual_seed(0)
    experts = _experts_of(family)
    tokens, hidden_size = 12, experts.gate_up.shape[1] if family == "moe_gpt" else experts.gate_up_proj.shape[2]
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    top_k_index = torch.stack([torch.randperm(experts.num_experts)[:2] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, 2, requires_grad=True)
    expected = experts(hidden, top_k_index, top_k_weights)
    expected.square().sum().backward()
    want = {"hidden": hidden.grad, "weights": top_k_weights.grad,
            **{n: p.grad.clone() for n, p in experts.named_parameters()}}
    hidden.grad = top_k_weights.grad = None
    experts.zero_grad(set_to_none=True)

    assert apply_expert_parallel(experts, one_rank_mesh) == [""]
    assert isinstance(experts.forward, ExpertParallelForward) and len(expert_parameters(experts)) == 2
    out = experts(hidden, top_k_index, top_k_weights)
    out.square().sum().backward()
    torch.testing.assert_close(out, expected)
    got = {"hidden": hidden.grad, "weights": top_k_weights.grad,
           **{n: p.grad.to_local() for n, p in experts.named_parameters()}}
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ExpertParallelError, match="split already"):
        apply_expert_parallel(experts, one_rank_mesh)


def test_a_rank_that_receives_no_rows_still_gives_its_experts_a_gradient(one_rank_mesh):
    """Hugging Face's eager experts loop over the experts hit: with no rows, none; the
    dispatch still ties every slice to the output, so the gradient all-reduce finds one."""
    pytest.importorskip("transformers")
    experts = _experts_of("mixtral")
    experts.config._experts_implementation = "eager"
    apply_expert_parallel(experts, one_rank_mesh)
    hidden = torch.randn(0, experts.gate_up_proj.shape[2], requires_grad=True)
    experts(hidden, torch.zeros(0, 2, dtype=torch.long), torch.ones(0, 2)).sum().backward()
    assert all(p.grad is not None and not p.grad.to_local().any() for p in experts.parameters())


def test_experts_that_do_not_divide_are_refused():
    class ThreeRanks:  # what apply_expert_parallel asks of a mesh before it splits anything
        def size(self):
            return 3

    model = load_model_file(MOE_GPT, MOE_ARGS).build_model()
    with pytest.raises(ExpertParallelError, match=r"blocks\.0\.moe\.experts has 4 experts, which expert_parallel\(3\)"):
        apply_expert_parallel(model, ThreeRanks())


def test_stage_spec_checks_expert_parallel():
    StageSpec(layers=(0, 1), device_type="cpu", tensor_parallel=1, ranks=[[0], [1], [2], [3]], expert_parallel=2)
    with pytest.raises(ValueError, match=r"expert_parallel\(3\) must divide its 4 data-parallel replicas"):
        StageSpec(layers=(0, 1), device_type="cpu", tensor_parallel=1, ranks=[[0], [1], [2], [3]], expert_parallel=3)


@pytest.mark.parametrize("option", [dict(zero_stage=1), dict(compression="fp16"), dict(aggregation="median"),
                                    dict(sync_every=4)])
def test_data_parallel_refuses_what_does_not_combine_with_split_experts(option):
    from hetpar.runtime import data_parallel

    zero = option.pop("zero_stage", 0)
    stage = StageSpec(layers=(0, 1), device_type="cpu", tensor_parallel=1, ranks=[[0], [1], [2], [3]],
                      expert_parallel=2, zero_stage=zero)
    with pytest.raises(ValueError, match=r"expert_parallel\(2\) works with the plain gradient all-reduce only"):
        data_parallel.check_expert_parallel(stage, option.get("compression", "none"),
                                            option.get("aggregation", "mean"), option.get("sync_every", 1))


def test_program_splits_experts_only_where_the_plan_does():
    plan = _plan(MOE_GPT, MOE_ARGS, dp=4, ep=2, micro_batch_size=1)
    source = program_source(plan)
    assert "experts.apply_expert_parallel(model_shard, groups.ep_mesh)" in source
    assert "expert_parallel=2," in source and "| tp | ep" in source
    compile(source, "train.py", "exec")
    plain = program_source(_plan(MOE_GPT, MOE_ARGS, dp=4, ep=1, micro_batch_size=1))
    assert "expert_parallel" not in plain and "distributed, experts," not in plain
    assert "| ep" not in plain


# ----------------------------------------------------------------------------- under torchrun


def _trains_like_one_process(plan: ParallelPlan, tmp_path: Path, optimizer: str) -> None:
    run = run_compiled(plan, tmp_path, optimizer)
    assert "experts split over ep 2" in run.stderr, run.stderr[-2000:]
    assert_matches_reference(plan, run.init_state, optimizer, len(run.losses), run.losses, run.final, run.ref_state)
    assert run.ref_losses[-1] != run.ref_losses[0]


# (dp, ep, tp, pp, micro-batch size, optimizer) of each run; dp 4 has expert-data-parallel
# groups of two replicas, dp 2 none (each replica holds its own experts)
LAYOUTS = {
    "dp2_ep2": (2, 2, 1, 1, 2, "adamw"),
    "dp4_ep2": (4, 2, 1, 1, 1, "sgd"),
    "ep2_pp2": (2, 2, 1, 2, 1, "sgd"),
    "ep2_tp2": (2, 2, 2, 1, 2, "adamw"),
}


@pytest.mark.slow
def test_moe_gpt_with_zero_bubble_and_recompute_trains_like_one_process(tmp_path, float64_experts):
    """W actions run the exchanges' backward again (with the parameters as inputs), and
    recompute runs their forward again in the backward: every rank of a group alike."""
    plan = _plan(MOE_GPT, MOE_ARGS, dp=2, ep=2, pp=2, micro_batch_size=1, schedule="zb", recompute="full")
    assert plan.schedule == "zb" and all(s.recompute == "full" for s in plan.stages)
    _trains_like_one_process(plan, tmp_path, "sgd")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_gpt_trains_like_one_process(tmp_path, layout, float64_experts):
    dp, ep, tp, pp, micro, optimizer = LAYOUTS[layout]
    plan = _plan(MOE_GPT, MOE_ARGS, dp=dp, ep=ep, tp=tp, pp=pp, micro_batch_size=micro)
    assert (plan.data_parallel, plan.pipeline_parallel, plan.stages[0].tensor_parallel) == (dp, pp, tp)
    if tp > 1:  # the dense part split, the experts not
        assert plan.stages[0].tp_sharding and not any("experts" in path for path in plan.stages[0].tp_sharding)
    _trains_like_one_process(plan, tmp_path, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2_ep2", "ep2_pp2", "ep2_tp2"])
def test_mixtral_trains_like_one_process(tmp_path, layout, float64_experts):
    pytest.importorskip("transformers")
    dp, ep, tp, pp, micro, optimizer = LAYOUTS[layout]
    plan = _plan(ZOO, MIXTRAL_ARGS, dp=dp, ep=ep, tp=tp, pp=pp, micro_batch_size=micro)
    assert (plan.data_parallel, plan.pipeline_parallel, plan.stages[0].tensor_parallel) == (dp, pp, tp)
    _trains_like_one_process(plan, tmp_path, "sgd" if optimizer == "adamw" else "adamw")


@pytest.mark.slow
def test_checkpoint_at_ep_2_resumes_at_ep_1(tmp_path, float64_experts):
    """A checkpoint written by dp 2 x ep 2 holds the model's own tensors, whole; programs
    of dp 1 and of dp 2 without expert parallelism resume from it and end where one
    uninterrupted process ends. (And the ep 2 program builds its slices from the seed.)"""
    steps, optimizer = 4, "adamw"
    split = _plan(MOE_GPT, MOE_ARGS, dp=2, ep=2)
    torch.manual_seed(1234)
    init_state = load_model_file(MOE_GPT, MOE_ARGS).build_model().state_dict()
    ckpt = ["--checkpoint-every", "2"]
    first, _ = _run(split, tmp_path / "ep2", init_state,
                    [*ckpt, "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2"])
    (saved_dir,) = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")]
    # the routing's load in the metrics: at most all rows to one of the 2 ranks (twice the even share)
    loads = [r.get("expert_imbalance") for r in read_metrics(tmp_path / "ep2" / "m.jsonl")]
    assert len(loads) == 2 and all(1.0 <= x <= 2.0 for x in loads), loads
    saved = checkpoint_model_tensors(saved_dir)
    assert saved["blocks.0.moe.experts.gate_up"].shape == init_state["blocks.0.moe.experts.gate_up"].shape
    assert [k for k in first if not torch.equal(saved[k], first[k])] == []
    # built from --seed alone, each rank making only its slice of the experts: build_model()'s values
    result = run_torchrun(tmp_path / "ep2" / "train.py", 2, ["--steps", "0", "--seed", "7", "--save-final", "seeded.pt"])
    assert result.returncode == 0, result.stderr[-4000:]
    torch.manual_seed(7)
    built = load_model_file(MOE_GPT, MOE_ARGS).build_model().state_dict()
    seeded = torch.load(tmp_path / "ep2" / "seeded.pt", weights_only=True)
    assert list(seeded) == list(built) and [k for k in built if not torch.equal(seeded[k], built[k])] == []
    reference, exact_losses, exact, sensitivity = exact_references(split, init_state, optimizer, steps)
    for name, dp in (("dp1", 1), ("dp2", 2)):
        plain = _plan(MOE_GPT, MOE_ARGS, dp=dp, ep=1, micro_batch_size=GLOBAL_BATCH // dp)
        checkpoints = tmp_path / f"ckpt_{name}"
        shutil.copytree(saved_dir, checkpoints / saved_dir.name)
        final, stderr = _run(plain, tmp_path / name, init_state, [*ckpt, "--checkpoint-dir", str(checkpoints),
                                                                  "--steps", str(steps)])
        assert "resum" in stderr and "step 3" in stderr, stderr[-2000:]
        losses = [r["loss"] for r in read_metrics(tmp_path / name / "m.jsonl")]
        assert len(losses) == steps - 2
        assert all("expert_imbalance" not in r for r in read_metrics(tmp_path / name / "m.jsonl"))  # no split experts
        assert_within_rounding(optimizer, steps, exact_losses[:2] + losses, final, reference, exact_losses, exact,
                               sensitivity)


def _run(plan: ParallelPlan, out: Path, init_state: dict, args: list[str]) -> tuple[dict, str]:
    """Compile ``plan`` into ``out`` and run it with AdamW from ``init_state``: its --save-final state and stderr."""
    compile_plan(plan, out)
    torch.save(init_state, out / "init.pt")
    result = run_torchrun(out / "train.py", plan.cluster.world_size,
                          ["--optimizer", "adamw", "--lr", str(LR["adamw"]), "--init-from", "init.pt",
                           "--save-final", "final.pt", "--metrics", "m.jsonl", *args])
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out / "final.pt", weights_only=True), result.stderr


def test_routing_load_is_the_most_rows_one_rank_is_sent_over_the_even_share():
    load = RoutingLoad()
    assert load.take() is None
    load.record([3, 1])  # 3 of 4 rows to rank 0 of 2: 1.5 times the even 2
    load.record([0, 0])  # nothing routed: no figure
    load.record([2, 2, 2, 2])
    assert load.take() == 1.5
    assert load.take() is None
