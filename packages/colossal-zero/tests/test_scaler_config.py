"""LowLevelZeroOptimizer builds one ScalerConfig from its keywords, or takes one whole."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import batch, loss_fn, make_model, make_optimizer

from colossal.core import ScalerConfig
from colossal.core.testing import distributed_test
from colossal.zero import LowLevelZeroOptimizer


@distributed_test(1)
def test_scaler_config_reaches_the_scaler(rank: int, world_size: int) -> None:
    config = ScalerConfig(initial_scale=2**10, backoff_factor=0.25, hysteresis=1)
    model = make_model(torch.float16)
    opt = LowLevelZeroOptimizer(make_optimizer(model), scaler_config=config)
    assert opt.scaler is not None and opt.scaler.config is config
    x, y = batch(0)
    opt.backward(loss_fn(model, x, y) * float("inf"))
    opt.step()
    assert opt.loss_scale == 2**8  # backed off by 0.25 at the first overflow (hysteresis 1)
    # The keyword form builds the same config once.
    kw = LowLevelZeroOptimizer(
        make_optimizer(make_model(torch.float16)),
        initial_scale=2**10,
        backoff_factor=0.25,
        hysteresis=1,
    )
    assert kw.scaler_config == config and kw.scaler.config is kw.scaler_config
    with pytest.raises(TypeError, match=r"not both \(also got \['hysteresis'\]\)"):
        LowLevelZeroOptimizer(
            make_optimizer(make_model(torch.float16)), scaler_config=config, hysteresis=3
        )
    # bf16 has no scaler, but its settings are still validated.
    with pytest.raises(ValueError, match="backoff_factor=2.0"):
        LowLevelZeroOptimizer(make_optimizer(make_model(torch.bfloat16)), backoff_factor=2)
