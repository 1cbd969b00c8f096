"""zero_model_wrapper / zero_optim_wrapper and the seeds' GeminiDDP against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core.testing import distributed_test
from colossal.legacy.zero import (
    GeminiAdamOptimizer,
    GeminiDDP,
    zero_model_wrapper,
    zero_optim_wrapper,
)
from colossal.legacy.zero.gemini import placement_arguments

STEPS, LR = 3, 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _my_half(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    per = x.shape[0] // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def test_placement_names_map_to_ours() -> None:
    assert placement_arguments("cpu")["offload_optim_frac"] == 1.0
    assert placement_arguments("cpu")["offload_param_frac"] == 1.0
    assert placement_arguments("cuda")["offload_param_frac"] == 0.0
    assert placement_arguments("auto") == {"placement_policy": "auto"}
    with pytest.raises(ValueError, match=r"placement_policy='gpu' is not one of"):
        placement_arguments("gpu")
    with pytest.raises(ValueError, match="zero_stage=4 must be 1, 2 or 3"):
        zero_model_wrapper(nn.Linear(2, 2), zero_stage=4)
    with pytest.raises(ValueError, match="needs the model returned by zero_model_wrapper"):
        zero_optim_wrapper(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), 0.1))


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_low_level_stages_equal_one_process(rank: int, world_size: int, stage: int) -> None:
    """Catches a missing gradient average over ranks or a wrong stage (SGD shows scale)."""
    expected = _reference()
    model = zero_model_wrapper(_model(), zero_stage=stage)
    optimizer = zero_optim_wrapper(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert optimizer.config.stage == stage
    for step in range(STEPS):
        x, y = _my_half(step, rank, world_size)
        optimizer.zero_grad()
        optimizer.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


@distributed_test(2)
def test_stage_3_gemini_equals_one_process(rank: int, world_size: int) -> None:
    """Catches a Gemini wrapper that drops the seeds' arguments or steps on wrong shards."""
    expected = _reference()
    config = dict(
        placement_policy="cpu", precision="fp32", search_range_mb=1, min_chunk_size_mb=0.001
    )
    model = zero_model_wrapper(_model(), zero_stage=3, gemini_config=config)
    assert isinstance(model, GeminiDDP)
    optimizer = zero_optim_wrapper(model, torch.optim.SGD(model.parameters(), lr=LR))
    for step in range(STEPS):
        x, y = _my_half(step, rank, world_size)
        optimizer.zero_grad()
        optimizer.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
    state = model.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    dist.barrier()


@distributed_test(1)
def test_gemini_adam_optimizer_splits_its_keywords(rank: int, world_size: int) -> None:
    model = GeminiDDP(_model(), placement_policy="cuda", precision="fp32", min_chunk_size_mb=0.001)
    optimizer = GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5)
    assert optimizer.param_groups[0]["lr"] == 1e-3
