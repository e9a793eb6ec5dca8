"""The Hugging Face model zoo: fifteen families, each its model class with its DEFAULT
config class (tests/models/hf_default_zoo.py: decoder-only, mixture of experts,
encoder-only, encoder-decoder, vision), planned and trained by the generated program.

- At the default size (Llama 7B, Mixtral 8x7B, GPT-NeoX 20B, ...) every family plans on
  the meta device for 2x8xA100-80GB (Mixtral at tp 2 for 4x8), the decoder-only ones
  with tensor parallelism.
- At the tiny size (only size fields changed: widths, depths, heads, vocabulary, positions;
  the defaults do not run on a 2-core CPU) one torchrun launch trains every family
  for two steps in a layout of two ranks (the decoder-only ones at tp 2), and the
  Llama-like and GPT-2-like (tied) models of tests/test_distributed.py at dp 2. Where a
  default config draws no random numbers in training (no dropout, no batch norm) the
  run matches one process ([Note: float tolerance]); dropout draws other masks on other
  layouts, so there the run is checked to train (finite losses, parameters moved). Each
  family's program also starts from ``--seed`` alone (built on the meta device, each
  rank materialising its own part), and its state equals ``build_model()``'s.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_torchrun
from test_distributed import HF_GPT2, HF_LLAMA, LR, assert_matches_reference, reference_run

tf = pytest.importorskip("transformers")

from hetpar.cost_models.cluster import parse_cluster  # noqa: E402
from hetpar.planner.api import plan_model  # noqa: E402
from hetpar.planner.options import SearchOptions  # noqa: E402
from hetpar.rewriters import compile_plan  # noqa: E402
from hetpar.runtime.model_file import load_model_file  # noqa: E402
from hetpar.runtime.module_stage import cut_module_stage, decoder_layout  # noqa: E402
from hetpar.runtime.training import read_metrics  # noqa: E402
from hetpar.vocabulary import Sharding  # noqa: E402

ZOO = ROOT / "tests" / "models" / "hf_default_zoo.py"
DECODERS = ("llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "mixtral", "gpt2", "opt")
OTHERS = ("bert", "roberta", "t5", "bart", "vit", "resnet")
# (dp, tp, pp) of each family's two-rank program: every layout kind, tp wherever it applies
LAYOUTS = {**{family: (1, 2, 1) for family in DECODERS},
           "bert": (2, 1, 1), "roberta": (1, 1, 2), "t5": (1, 1, 2), "bart": (2, 1, 1), "vit": (1, 1, 2),
           "resnet": (2, 1, 1)}
# Default configs without dropout or batch norm: a sharded run computes what one process does.
EXACT = ("llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "mixtral", "vit")
STEPS = 2
GLOBAL_BATCH = 4
SEED = 5


def test_the_zoo_covers_every_family_of_its_file():
    assert set(DECODERS) | set(OTHERS) == set(LAYOUTS) == set(load_model_file(ZOO).module.FAMILIES)


@pytest.mark.parametrize("family", EXACT)
def test_exact_families_draw_no_random_numbers_in_training(family):
    """Two forwards in training mode agree bit for bit (nothing random is drawn), and no
    batch norm takes statistics over a replica's or micro-batch's rows: a sharded run
    computes what one process does."""
    model_file = load_model_file(ZOO, {"family": family})
    model = model_file.build_model().train()
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    inputs = model_file.example_inputs(2)
    torch.testing.assert_close(model(*inputs).logits, model(*inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_stages_cut_at_module_boundaries_chain_to_the_models_output(family):
    """Every decoder-only family is cut into module stages ([Note: stages of the eager
    model]) whose chain computes the model's own output type and logits."""
    model_file = load_model_file(ZOO, {"family": family})
    model = model_file.build_model().eval()  # dropout off: one forward against another
    layout = decoder_layout(model)
    names = ["leading", *(layout.block_path(i) for i in range(layout.num_blocks)), "trailing"]
    tokens = model_file.example_inputs(2)[0]
    expected = model(tokens)
    x = tokens
    for first, last in [(0, 1), (2, 2), (3, 3)]:
        stage = cut_module_stage(model, (tokens,), (first, last), names)
        out = stage.module(x)
        x = out if stage.is_last else out[0]
    assert type(x) is type(expected)
    torch.testing.assert_close(x.logits, expected.logits, rtol=0, atol=0)


# Each default size planned on meta for 16 A100s, the decoder-only ones with tensor
# parallelism pinned (4: every default's heads and key-value heads divide by it).
# Mixtral 8x7B's experts, 45 of its 47B parameters, are not split by tensor parallelism
# (hetpar has no expert parallelism), so at tp 2 it needs 32 A100s: 16 stages of experts.
DEFAULT_SIZE_TP = {**{family: ("2x8xA100-80GB", 4) for family in DECODERS}, "mixtral": ("4x8xA100-80GB", 2),
                   **{family: ("2x8xA100-80GB", None) for family in OTHERS}}


@pytest.mark.parametrize("family", DECODERS + OTHERS)
def test_default_size_plans_on_the_meta_device(family):
    spec, tp = DEFAULT_SIZE_TP[family]
    cluster = parse_cluster(spec)
    options = SearchOptions(global_batch_size=64, dtype="bf16", tp=tp, work_limit_s=2.0)
    plan = plan_model(ZOO, cluster, options, model_args={"family": family, "size": "default"})
    assert [l for s in plan.stages for l in s.layers] == list(range(len(plan.model.layer_names)))
    assert plan.data_parallel * plan.pipeline_parallel * plan.stages[0].tensor_parallel == cluster.world_size
    if family in DECODERS:
        assert all(s.tensor_parallel == tp and s.tp_sharding for s in plan.stages)
    if family == "gpt2":  # issue 30: the default GPT-2's fused c_attn splits by heads, part by part
        blocks = [s for s in plan.stages if s.tp_parts]
        assert blocks and all(how is Sharding.COLWISE and s.tp_parts[path] == [768, 768, 768]
                              for s in blocks for path, how in s.tp_sharding.items() if path.endswith(".attn.c_attn"))
        assert sum(path.endswith(".attn.c_attn") for s in plan.stages for path in s.tp_parts) == 12


@functools.cache
def _plan(model_path: Path, family: str | None, layout: tuple[int, int, int]):
    """The planner's plan of a two-rank layout (cached: the slow test plans them all again)."""
    dp, tp, pp = layout
    options = SearchOptions(global_batch_size=GLOBAL_BATCH, dtype="fp32", dp=dp, tp=tp, pp=pp, micro_batch_size=1)
    args = {"family": family} if family else {}
    return plan_model(model_path, parse_cluster(f"1x{dp * tp * pp}xcpu"), options, model_args=args)


def _check_layout(plan, family: str | None, layout: tuple[int, int, int]) -> None:
    dp, tp, pp = layout
    assert (plan.data_parallel, plan.stages[0].tensor_parallel, plan.pipeline_parallel) == layout
    if tp > 1:  # every block has split Linears (module stages: runtime.module_stage)
        sharding = plan.stages[0].tp_sharding
        assert all(any(path.startswith(f"{block}.") for path in sharding) for block in plan.model.layer_names[1:-1])


# [Note: one launch for the zoo]
# A torchrun launch costs about ten seconds here before its first step (two Python
# processes importing torch and transformers on two cores); a tiny model's two steps
# cost about one. So one launch runs every program: each worker runs the generated
# train.py files one after another (runpy, as ``python train.py`` would), each in its
# own directory with its own arguments, meeting the other worker under its own store
# prefix (TORCHELASTIC_RESTART_COUNT, [Note: restarted workers] in runtime/distributed.py)
# and leaving the process group before the next starts.
RUN_PROGRAMS = '''
import os, runpy, sys

for i, spec in enumerate(sys.argv[1:]):
    directory, *argv = spec.split("|")
    os.environ["TORCHELASTIC_RESTART_COUNT"] = f"program_{i}"
    os.chdir(directory)
    sys.argv = [os.path.join(directory, "train.py"), *argv]
    print(f"zoo: running {directory}", file=sys.stderr, flush=True)
    runpy.run_path(sys.argv[0], run_name="__main__")
'''


def _programs(tmp_path: Path):
    """(name, plan, optimizer) of every program of the launch."""
    programs = []
    for family, layout in LAYOUTS.items():
        plan = _plan(ZOO, family, layout)
        _check_layout(plan, family, layout)
        programs.append((family, plan, "sgd"))
    for name, source, optimizer in (("llama_dp2", HF_LLAMA, "adamw"), ("gpt2_dp2", HF_GPT2, "sgd")):
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        plan = _plan(path, None, (2, 1, 1))
        programs.append((name, plan, optimizer))
    return programs


@pytest.fixture
def float64_experts(monkeypatch):
    """torch's grouped matmul, which transformers' experts use on CPU, has no float64
    kernel: the float64 reference of [Note: float tolerance] takes transformers' own
    fallback (a matmul per expert) instead."""
    moe = pytest.importorskip("transformers.integrations.moe")
    can_use = moe._can_use_grouped_mm
    monkeypatch.setattr(moe, "_can_use_grouped_mm",
                        lambda input, weight, offs: weight.dtype != torch.float64 and can_use(input, weight, offs))


@pytest.mark.slow
def test_every_family_trains_and_the_exact_ones_like_one_process(tmp_path, float64_experts):
    programs = _programs(tmp_path)
    specs = []
    for name, plan, optimizer in programs:
        out = tmp_path / name
        compile_plan(plan, out)
        torch.manual_seed(1234)
        torch.save(load_model_file(plan.model.file, plan.model.args).build_model().state_dict(), out / "init.pt")
        specs.append("|".join([str(out), "--steps", str(STEPS), "--optimizer", optimizer, "--lr", str(LR[optimizer]),
                               "--init-from", "init.pt", "--save-final", "final.pt", "--metrics", "m.jsonl"]))
        if name in LAYOUTS:  # and once more from --seed alone: built on meta, each rank materialising its part
            specs.append("|".join([str(out), "--steps", "0", "--seed", str(SEED), "--save-final", "seeded.pt"]))
    driver = tmp_path / "run_programs.py"
    driver.write_text(RUN_PROGRAMS)
    result = run_torchrun(driver, 2, specs, timeout_s=600)
    assert result.returncode == 0, result.stderr[-6000:]
    for name, plan, optimizer in programs:
        out = tmp_path / name
        losses = [r["loss"] for r in read_metrics(out / "m.jsonl")]
        init = torch.load(out / "init.pt", weights_only=True)
        final = torch.load(out / "final.pt", weights_only=True)
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), name
        assert any(not torch.equal(final[k], init[k]) for k in init if init[k].is_floating_point()), name
        if name in LAYOUTS:  # meta-device construction equals build_model() under the seed
            torch.manual_seed(SEED)
            built = load_model_file(plan.model.file, plan.model.args).build_model().state_dict()
            seeded = torch.load(out / "seeded.pt", weights_only=True)
            assert list(seeded) == list(built), name
            assert [k for k in built if not torch.equal(seeded[k], built[k])] == [], name
        if name in EXACT or name.endswith("_dp2"):
            _, ref_state = reference_run(plan, init, optimizer, STEPS)
            assert_matches_reference(plan, init, optimizer, STEPS, losses, final, ref_state)
    tied = torch.load(tmp_path / "gpt2_dp2" / "final.pt", weights_only=True)
    assert torch.equal(tied["transformer.wte.weight"], tied["lm_head.weight"])
