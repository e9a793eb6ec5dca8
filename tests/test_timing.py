"""Step and action times ([Note: device timing]): the arithmetic of a StepTimer on the
CPU, and on CUDA (``gpu``) that forwards and backwards timed by events add up to a step
that ends in a synchronize."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from hetpar.runtime import executor, schedule, shard
from hetpar.runtime.distributed import Peers
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.graph import trace_layers
from hetpar.runtime.timing import StepTimer


def test_receives_waits_come_out_of_the_action_they_happen_in():
    timer = StepTimer(torch.device("cpu"))
    timer.action(forward=True)
    timer.include(10.0, 10.5)
    timer.exclude(10.1, 10.2)  # a receive inside the forward
    timer.action(forward=False)
    timer.include(11.0, 12.0)
    timer.action(forward=False)  # a W action counts as backward
    timer.include(12.0, 12.25)
    timer.settle()
    assert timer.steps == [pytest.approx((0.4, 1.25))]
    assert timer.spans == []
    timer.settle()  # nothing marked since: no step
    assert len(timer.steps) == 1


def test_a_cpu_step_is_host_time_and_holds_its_actions():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    start = timer.mark()
    torch.randn(256, 256) @ torch.randn(256, 256)
    timer.include(start, timer.mark())
    step_s = timer.stop()
    assert len(timer.steps) == 1
    forward_s, backward_s = timer.steps[0]
    assert 0 < forward_s <= step_s and backward_s == 0


# 400M parameters, 8192 tokens per micro-batch: compute-bound on a datacenter GPU (a
# forward of about 6.5 TFLOP against a few hundred kernel launches), so the backward's
# share of the step is its arithmetic's.
GPU_MODEL_ARGS = {"n_layers": 8, "hidden": 2048, "heads": 16, "seq_len": 1024, "vocab": 8192}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_forwards_and_backwards_add_up_to_the_step():
    """A one-stage pipeline of 2 micro-batches of a 400M-parameter GPT in bf16: what the
    events give the forwards and backwards is within 10% of the synchronised step, and a
    backward costs about twice its forward, as its arithmetic does (host timers gave the
    forward its launches only)."""
    device = torch.device("cuda")
    model_file = load_model_file(ROOT / "examples" / "gpt.py", GPU_MODEL_ARGS)
    model = model_file.build_model()
    names = list(trace_layers(model, example_inputs=model_file.example_inputs(1)).layer_names)
    micro, count = 8, 2
    stage = shard.cut_stage(model, model_file, micro, (0, len(names) - 1), names)
    stage.module.to(device)
    none = Peers(recv_activations_from=None, send_activations_to=(), recv_grads_from=None, send_grads_to=())
    pipeline = {0: executor.StageExecutor(stage=stage, peers=none, loss_fn=model_file.loss, num_microbatches=count,
                                          device=device, compute_dtype=torch.bfloat16)}
    actions = schedule.make_schedule("1f1b", 1, count, 1)[0]
    batches = model_file.batches(micro * count, 0)
    inputs, targets = next(batches)
    data = shard.microbatches(inputs, targets, num_microbatches=count, device=device)
    timer = StepTimer(device)
    steps = []
    for _ in range(6):
        timer.start()
        executor.run_actions(pipeline, actions, data, device, timer)
        steps.append(timer.stop())
        for p in stage.module.parameters():
            p.grad = None
    step_s = sorted(steps[2:])[len(steps[2:]) // 2]
    forward_s, backward_s = sorted(timer.steps[2:], key=sum)[len(timer.steps[2:]) // 2]
    assert abs(forward_s + backward_s - step_s) <= 0.10 * step_s, (forward_s, backward_s, step_s)
    assert 1.4 < backward_s / forward_s < 3.5, (forward_s, backward_s)
