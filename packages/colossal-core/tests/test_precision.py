"""Precision parsing and the dynamic loss scaler, including the cross-rank overflow verdict."""

from __future__ import annotations

import math

import pytest
import torch

from colossal.core.comm import CommTracker
from colossal.core.precision import (
    DynamicGradScaler,
    Precision,
    ScalerConfig,
    agree_overflow,
    local_overflow,
    parse_precision,
)
from colossal.core.testing import distributed_test


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fp32", torch.float32),
        ("FP16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("half", torch.float16),
        (torch.float32, torch.float32),
        ("torch.bfloat16", torch.bfloat16),
    ],
)
def test_parse_precision(value: object, expected: torch.dtype) -> None:
    assert parse_precision(value).dtype == expected  # type: ignore[arg-type]


def test_parse_precision_errors() -> None:
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'.*'fp32', 'fp16', 'bf16'"):
        parse_precision("fp8")
    with pytest.raises(TypeError, match="int 16"):
        parse_precision(16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no training precision for dtype torch.int8"):
        parse_precision(torch.int8)
    assert Precision.FP16.needs_loss_scaling and not Precision.BF16.needs_loss_scaling


def test_scaler_growth() -> None:
    scaler = DynamicGradScaler(initial_scale=8, growth_interval=3, max_scale=32)
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 8
    scaler.update(False)
    assert scaler.scale == 16
    for _ in range(6):
        scaler.update(False)
    assert scaler.scale == 32  # capped at max_scale


def test_scaler_backoff_with_hysteresis() -> None:
    scaler = DynamicGradScaler(initial_scale=1024, hysteresis=2, backoff_factor=0.25, min_scale=32)
    scaler.update(True)
    assert scaler.scale == 1024  # first overflow absorbed by hysteresis
    scaler.update(True)
    assert scaler.scale == 256
    scaler.update(True)
    assert scaler.scale == 64  # hysteresis already spent: every overflow backs off
    scaler.update(True)
    assert scaler.scale == 32  # clamped at min_scale
    scaler.update(True)
    assert scaler.scale == 32


def test_scaler_growth_resets_hysteresis_and_overflow_resets_growth() -> None:
    scaler = DynamicGradScaler(initial_scale=4, growth_interval=2, hysteresis=2)
    scaler.update(True)  # hysteresis 1/2
    scaler.update(False)
    scaler.update(True)  # growth counter reset; hysteresis 2/2 -> backoff
    assert scaler.scale == 2
    scaler.update(False)
    scaler.update(False)  # growth -> 4, hysteresis restarts
    assert scaler.scale == 4
    scaler.update(True)
    assert scaler.scale == 4  # one overflow absorbed again


def test_scaler_state_dict_roundtrip() -> None:
    a = DynamicGradScaler(initial_scale=64, growth_interval=5, hysteresis=3)
    a.update(True)
    a.update(False)
    state = a.state_dict()
    b = DynamicGradScaler()
    b.load_state_dict(state)
    assert b.state_dict() == state
    assert b.scale == 64 and b.config.growth_interval == 5
    with pytest.raises(KeyError, match="'scale'"):
        b.load_state_dict({})


def test_scaler_validation_names_every_problem() -> None:
    with pytest.raises(ValueError) as info:
        DynamicGradScaler(
            initial_scale=0.5, min_scale=1, growth_factor=1, backoff_factor=2, hysteresis=0
        )
    msg = str(info.value)
    for fragment in (
        "initial_scale=0.5",
        "growth_factor=1.0",
        "backoff_factor=2.0",
        "hysteresis=0",
    ):
        assert fragment in msg


def test_scaler_takes_one_config_whole() -> None:
    config = ScalerConfig(initial_scale=64, backoff_factor=0.25, hysteresis=1, min_scale=2)
    scaler = DynamicGradScaler(config)
    assert scaler.config is config  # kept whole, not rebuilt from its fields
    scaler.update(True)
    assert scaler.scale == 16.0
    assert DynamicGradScaler(
        initial_scale=64, backoff_factor=0.25, hysteresis=1, min_scale=2
    ).config == config
    assert ScalerConfig(initial_scale=8).initial_scale == 8.0
    assert isinstance(ScalerConfig(initial_scale=8).initial_scale, float)
    with pytest.raises(TypeError, match="not both"):
        DynamicGradScaler(config, hysteresis=2)
    with pytest.raises(TypeError, match=r"\['init_scale'\].*'initial_scale'"):
        DynamicGradScaler(init_scale=2.0)
    with pytest.raises(TypeError, match="must be a ScalerConfig"):
        DynamicGradScaler({"initial_scale": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_scale='big' must be a number"):
        ScalerConfig(max_scale="big")  # type: ignore[arg-type]


def test_scale_and_unscale() -> None:
    scaler = DynamicGradScaler(initial_scale=128)
    loss = torch.tensor(0.5)
    assert scaler.scale_loss(loss).item() == 64.0 and scaler.inv_scale == 1 / 128


def test_local_overflow() -> None:
    assert not local_overflow([torch.ones(3), None, torch.empty(0)])
    assert local_overflow([torch.ones(3), torch.tensor([1.0, math.inf])])
    assert local_overflow([torch.tensor([math.nan], dtype=torch.float16)])
    assert not local_overflow([])


@distributed_test(1, 2, 4)
def test_overflow_agreed_across_ranks(rank: int, world_size: int) -> None:
    bad_rank = world_size - 1
    grads = [torch.ones(4)]
    if rank == bad_rank:
        grads.append(torch.tensor([0.0, math.inf]))
    scaler = DynamicGradScaler(initial_scale=2**10, hysteresis=1)
    with CommTracker() as tracker:
        overflow = scaler.check_overflow(grads)
    assert overflow, f"rank {rank} did not learn of rank {bad_rank}'s overflow"
    assert tracker.calls("all_reduce") == 1
    scaler.update(overflow)
    assert scaler.scale == 2**9
    assert not scaler.check_overflow([torch.ones(2)])
    assert agree_overflow(rank == 0) is True


@distributed_test(4)
def test_overflow_agreed_within_a_subgroup_only(rank: int, world_size: int) -> None:
    from colossal.core import ProcessGroupMesh

    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))
    tp = mesh.get_group_along_axis("tp")  # tp groups: [0, 1] and [2, 3]
    grads = [torch.ones(4)]
    if rank == 3:
        grads.append(torch.tensor([math.nan]))
    scaler = DynamicGradScaler(hysteresis=1)
    with CommTracker() as tracker:
        overflow = scaler.check_overflow(grads, group=tp)
    expected = rank in (2, 3)  # rank 3's group learns of it; the group [0, 1] does not
    assert overflow == expected, f"rank {rank}: overflow={overflow}, expected {expected}"
    assert tracker.calls("all_reduce") == 1
    # A sequence of groups ORs along each in turn: tp then dp reaches every rank.
    dp = mesh.get_group_along_axis("dp")
    assert agree_overflow(rank == 3, [tp, dp]) is True


class _RecordingAccelerator:
    def __init__(self) -> None:
        self.asked = 0

    def get_current_device(self) -> torch.device:
        self.asked += 1
        return torch.device("cpu")


def test_overflow_flag_lives_on_the_accelerator_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import colossal.core.precision.scaler as scaler_mod

    acc = _RecordingAccelerator()
    seen: list[torch.device] = []

    def fake_all_reduce(t: torch.Tensor, op: object = None, group: object = None) -> None:
        seen.append(t.device)

    monkeypatch.setattr(scaler_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(scaler_mod, "get_accelerator", lambda: acc)
    monkeypatch.setattr(scaler_mod, "all_reduce", fake_all_reduce)
    assert agree_overflow(True) is True
    assert acc.asked == 1 and seen == [torch.device("cpu")]
