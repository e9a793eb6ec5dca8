"""The stage executor on a single stage, in this process: micro-batching gives the gradient
of the mean loss of the whole batch. (Stages that talk run in tests/test_distributed.py.)"""

from __future__ import annotations

import pytest
import torch

from hetpar.runtime.distributed import Peers
from hetpar.runtime.executor import StageExecutor
from hetpar.runtime.graph import trace_layers
from hetpar.runtime.model_file import load_model_file
from hetpar.runtime.schedule import Action, Kind, make_schedule
from hetpar.runtime.shard import cut_stage, microbatches

GPT_ARGS = {"n_layers": 2, "hidden": 32, "heads": 4, "seq_len": 16, "vocab": 64}
NO_PEERS = Peers(recv_activations_from=None, send_activations_to=(), recv_grads_from=None, send_grads_to=())


def whole_model_stage(path, args, micro_batch_size, recompute="none"):
    model_file = load_model_file(path, args)
    torch.manual_seed(0)
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    return model_file, model, cut_stage(model, model_file, micro_batch_size, (0, len(names) - 1), names,
                                        recompute=recompute)


@pytest.mark.parametrize("schedule,recompute", [("1f1b", "none"), ("gpipe", "none"), ("zb", "none"), ("zb", "full")])
def test_microbatched_gradient_is_the_whole_batch_gradient(gpt_path, schedule, recompute):
    m, mbs = 4, 2
    model_file, model, stage = whole_model_stage(gpt_path, GPT_ARGS, mbs, recompute)
    inputs, targets = next(model_file.batches(m * mbs, 0))

    loss = model_file.loss(model(*inputs), targets)
    loss.backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    executor = StageExecutor(stage=stage, peers=NO_PEERS, loss_fn=model_file.loss, num_microbatches=m,
                             device=torch.device("cpu"))
    data = microbatches(inputs, targets, replica=0, data_parallel=1, num_microbatches=m, device=torch.device("cpu"))
    got_loss = executor.run(make_schedule(schedule, 1, m)[0], data)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-6, atol=1e-6)
    grads = dict(stage.module.named_parameters())
    assert set(grads) == set(expected)
    for k, g in expected.items():
        torch.testing.assert_close(grads[k].grad, g, rtol=1e-5, atol=1e-6)


def test_a_schedule_without_backwards_is_reported(mlp_path):
    model_file, _, stage = whole_model_stage(mlp_path, {}, 2)
    inputs, targets = next(model_file.batches(4, 0))
    data = microbatches(inputs, targets, replica=0, data_parallel=1, num_microbatches=2, device=torch.device("cpu"))
    executor = StageExecutor(stage=stage, peers=NO_PEERS, loss_fn=model_file.loss, num_microbatches=2,
                             device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="left micro-batches 0, 1 of stage 0 without a backward"):
        executor.run([Action(0, Kind.FORWARD, 0), Action(0, Kind.FORWARD, 1)], data)


def test_bf16_autocast_runs_and_keeps_float32_parameters(gpt_path):
    model_file, _, stage = whole_model_stage(gpt_path, GPT_ARGS, 2)
    inputs, targets = next(model_file.batches(4, 0))
    data = microbatches(inputs, targets, replica=0, data_parallel=1, num_microbatches=2, device=torch.device("cpu"))
    executor = StageExecutor(stage=stage, peers=NO_PEERS, loss_fn=model_file.loss, num_microbatches=2,
                             device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    loss = executor.run(make_schedule("1f1b", 1, 2)[0], data)
    assert torch.isfinite(loss)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in stage.module.parameters())


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("layers", [(0, 3), (1, 2)], ids=["whole", "middle"])
def test_recompute_gives_the_same_gradients_and_keeps_parameter_names(gpt_path, mode, layers):
    """A stage whose layers run under torch.utils.checkpoint computes what the plain stage does."""
    model_file = load_model_file(gpt_path, GPT_ARGS)
    torch.manual_seed(0)
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    plain = cut_stage(model, model_file, 2, layers, names)
    recomputed = cut_stage(model, model_file, 2, layers, names, recompute=mode)
    assert [k for k, _ in recomputed.module.named_parameters()] == [k for k, _ in plain.module.named_parameters()]
    assert "checkpoint" not in plain.module.code and "recompute_layer_" in recomputed.module.code
    inputs, _ = next(model_file.batches(2, 0))
    torch.manual_seed(1)
    received = [torch.randn(s.shape, dtype=s.dtype) if s.dtype.is_floating_point else torch.zeros(s.shape, dtype=s.dtype)
                for s in plain.recv]

    def grads(stage):
        model.zero_grad(set_to_none=True)
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in received]
        out = stage.module(*[inputs[i] for i in stage.model_inputs], *leaves)
        outs = out if isinstance(out, tuple) else (out,)
        sum((o.float() ** 2).sum() for o in outs if o.is_floating_point()).backward()
        return [t.grad for t in leaves if t.requires_grad], {k: p.grad.clone() for k, p in stage.module.named_parameters()}

    def saved_elements(stage):
        count = [0]

        def pack(t):
            count[0] += t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            stage.module(*[inputs[i] for i in stage.model_inputs], *[t.requires_grad_(t.is_floating_point())
                                                                      for t in (r.clone() for r in received)])
        return count[0]

    # Inside a checkpoint nothing is saved for backward where autograd can see it.
    assert saved_elements(recomputed) < saved_elements(plain) / 4
    (plain_in, plain_params), (re_in, re_params) = grads(plain), grads(recomputed)
    for a, b in zip(plain_in, re_in, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    for k, g in plain_params.items():
        torch.testing.assert_close(re_params[k], g, rtol=1e-6, atol=1e-6)


def test_recompute_refuses_an_unknown_mode(mlp_path):
    model_file = load_model_file(mlp_path, {})
    model = model_file.build_model()
    names = list(trace_layers(model).layer_names)
    with pytest.raises(ValueError, match="recompute 'some' must be one of none, selective, full"):
        cut_stage(model, model_file, 2, (0, len(names) - 1), names, recompute="some")


def test_a_backward_whose_weight_gradients_never_come_is_reported(mlp_path):
    model_file, _, stage = whole_model_stage(mlp_path, {}, 2)
    inputs, targets = next(model_file.batches(4, 0))
    data = microbatches(inputs, targets, replica=0, data_parallel=1, num_microbatches=2, device=torch.device("cpu"))
    executor = StageExecutor(stage=stage, peers=NO_PEERS, loss_fn=model_file.loss, num_microbatches=2,
                             device=torch.device("cpu"))
    actions = make_schedule("zb", 1, 2)[0][:-1]  # drops 0W1
    with pytest.raises(RuntimeError, match="left micro-batches 1 of stage 0 without a weight-gradient action"):
        executor.run(actions, data)
