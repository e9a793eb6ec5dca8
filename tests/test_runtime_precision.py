"""Dynamic loss scaling (runtime.precision.LossScaler), in one process."""

from __future__ import annotations

import torch

from hetpar.runtime.precision import LossScaler


def params_with_grads(*grads: float) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.full((2,), g)
        params.append(p)
    return params


def test_disabled_scaler_leaves_gradients_alone():
    scaler = LossScaler(enabled=False)
    params = params_with_grads(3.0)
    assert scaler.scale == 1.0 and scaler.unscale_and_check(params)
    assert params[0].grad.tolist() == [3.0, 3.0]


def test_finite_gradients_are_unscaled_and_the_scale_grows_after_the_interval():
    scaler = LossScaler(enabled=True, init_scale=8.0, growth_interval=2)
    params = params_with_grads(16.0)
    assert scaler.unscale_and_check(params)
    assert params[0].grad.tolist() == [2.0, 2.0] and scaler.scale == 8.0
    assert scaler.unscale_and_check(params_with_grads(1.0))
    assert scaler.scale == 16.0 and scaler.good_steps == 0


def test_an_overflow_skips_the_step_and_halves_the_scale():
    scaler = LossScaler(enabled=True, init_scale=8.0)
    assert not scaler.unscale_and_check(params_with_grads(1.0, float("inf")))
    assert scaler.scale == 4.0 and scaler.skipped_steps == 1
    restored = LossScaler(enabled=True)
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.skipped_steps) == (4.0, 1)
