"""A bf16 ZeRO run saved and resumed through the Booster equals the uninterrupted run.

Under bf16 the fp32 master weights carry more than the bf16 parameters: a loader that
re-derived them from the loaded model (bf16-rounded) would still train, a little off. The
resumed run must match the uninterrupted one bit for bit: parameters, fp32 masters and
losses.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from booster_testlib import make_booster, make_model, make_optimizer, train_steps

from colossal.core.testing import distributed_test

BEFORE, AFTER = 3, 3  # steps before the checkpoint, and after it


def _boost(stage: int, seed: int) -> tuple[Any, Any, Any]:
    booster = make_booster(f"zero{stage}", precision="bf16", reduce_bucket_size_in_m=1e-4)
    model = make_model(seed=seed)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model))
    return booster, model, optimizer


def _masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """Full fp32 master weights by parameter index (collective)."""
    return {i: s["master_param"] for i, s in optimizer.state_dict()["state"].items()}


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(2)
def test_resumed_bf16_run_equals_uninterrupted(
    rank: int, world_size: int, stage: int, tmp_path: Any
) -> None:
    model_dir, optim_dir = str(tmp_path / "model"), str(tmp_path / "optim")
    booster, model, optimizer = _boost(stage, seed=1234)
    train_steps(model, optimizer, booster, range(BEFORE), rank, world_size)
    booster.save_model(model, model_dir, shard=True, size_per_shard=0.001)
    booster.save_optimizer(optimizer, optim_dir, shard=True, size_per_shard=0.001)
    saved = _masters(optimizer)
    # The masters hold more than their bf16 rounding: a loader dropping them would show.
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in saved.values())
    expected_losses = train_steps(
        model, optimizer, booster, range(BEFORE, BEFORE + AFTER), rank, world_size
    )
    expected = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    expected_masters = _masters(optimizer)

    booster, model, optimizer = _boost(stage, seed=99)  # other weights: loading must replace them
    booster.load_model(model, model_dir)
    booster.load_optimizer(optimizer, optim_dir)
    loaded = _masters(optimizer)
    for i, master in saved.items():
        assert torch.equal(loaded[i], master), f"master of parameter {i} not restored"
    losses = train_steps(model, optimizer, booster, range(BEFORE, BEFORE + AFTER), rank, world_size)
    assert losses == expected_losses
    for name, param in model.unwrap().named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param.detach(), expected[name]), f"{name} differs after resuming"
    for i, master in _masters(optimizer).items():
        assert torch.equal(master, expected_masters[i]), f"master of parameter {i} differs"
