"""ColossalAI's mixed-precision names: each mapped onto MixedPrecision or refused with the list."""

from __future__ import annotations

import pytest
import torch
from booster_testlib import batch, make_model

import colossal.booster as booster_pkg
import colossal.booster.mixed_precision as mp_module
from colossal.booster import (
    BF16MixedPrecision,
    Booster,
    FP8MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
)
from colossal.core import ScalerConfig


def _step(booster: Booster, model: torch.nn.Module, optimizer: object, poison: bool) -> None:
    x, y = batch(0)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    booster.backward(loss * float("inf") if poison else loss, optimizer)
    optimizer.step()  # type: ignore[attr-defined]
    optimizer.zero_grad()  # type: ignore[attr-defined]


def test_fp16_torch_settings_reach_the_scaler() -> None:
    """Catches settings dropped or replaced by defaults (hysteresis 2, growth every 2000)."""
    mp = FP16TorchMixedPrecision(
        init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2
    )
    booster = Booster(mixed_precision=mp)
    model = make_model()
    model, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _step(booster, model, optimizer, poison=True)
    state = optimizer.state_dict()["loss_scaler"]
    # Like torch's GradScaler: backed off by backoff_factor at the first overflow.
    assert state["scale"] == 256.0
    assert (state["growth_factor"], state["backoff_factor"]) == (4.0, 0.25)
    assert (state["growth_interval"], state["hysteresis"]) == (2, 1)
    _step(booster, model, optimizer, poison=False)
    assert optimizer.loss_scale == 256.0
    _step(booster, model, optimizer, poison=False)
    assert optimizer.loss_scale == 1024.0  # grew by growth_factor after growth_interval steps


def test_fp16_torch_defaults_are_colossalai_s() -> None:
    config = FP16TorchMixedPrecision().scaler_config
    assert (config.initial_scale, config.growth_factor, config.backoff_factor) == (
        2.0**16,
        2.0,
        0.5,
    )
    assert config.growth_interval == 2000 and config.hysteresis == 1
    assert FP16TorchMixedPrecision().precision == "fp16"
    with pytest.raises(ValueError, match="backoff_factor=1.5"):
        FP16TorchMixedPrecision(backoff_factor=1.5)


@pytest.mark.parametrize(
    ("name", "precision", "initial_scale"),
    [
        ("fp16", "fp16", 2.0**16),
        ("FP16", "fp16", 2.0**16),
        ("bf16", "bf16", 2.0**16),
        ("fp16_naive", "fp16", 2.0**32),
    ],
)
def test_strings_still_work(name: str, precision: str, initial_scale: float) -> None:
    mp = Booster(mixed_precision=name).mixed_precision
    assert isinstance(mp, MixedPrecision) and mp.precision == precision
    assert mp.scaler_config.initial_scale == initial_scale
    assert Booster(mixed_precision="fp32").mixed_precision is None
    assert Booster(mixed_precision=None).mixed_precision is None


@pytest.mark.parametrize("name", ["fp16_apex", "fp8", "int8", "float16x"])
def test_unknown_names_are_refused_with_the_list(name: str) -> None:
    with pytest.raises(ValueError) as err:
        Booster(mixed_precision=name)
    msg = str(err.value)
    assert repr(name) in msg
    for supported in ("'fp16'", "'bf16'", "'fp32'", "'fp16_naive'", "FP16TorchMixedPrecision"):
        assert supported in msg, (supported, msg)


@pytest.mark.parametrize("cls", [FP16ApexMixedPrecision, FP8MixedPrecision])
def test_unavailable_classes_are_refused_with_the_list(cls: type) -> None:
    with pytest.raises(ValueError, match=f"{cls.__name__}.*supported.*'fp16'.*'bf16'"):
        cls(opt_level="O1") if cls is FP16ApexMixedPrecision else cls()


def test_bf16_and_naive_map_onto_mixed_precision() -> None:
    bf16 = BF16MixedPrecision()
    assert bf16.precision == "bf16" and bf16.dtype == torch.bfloat16
    assert bf16.make_scaler() is None
    naive = FP16NaiveMixedPrecision(
        False, initial_scale=2**10, growth_factor=3, backoff_factor=0.25, hysteresis=3
    )
    assert naive.scaler_config == ScalerConfig(
        initial_scale=2**10, growth_factor=3, backoff_factor=0.25, hysteresis=3
    )


def test_mixed_precision_keeps_one_scaler_config() -> None:
    """Catches MixedPrecision rebuilding or dropping the settings on their way to the scaler."""
    config = ScalerConfig(initial_scale=2**8, hysteresis=1)
    whole = MixedPrecision("fp16", scaler_config=config)
    assert whole.scaler_config is config
    scaler = whole.make_scaler()
    assert scaler is not None and scaler.config is config
    by_keywords = MixedPrecision("fp16", initial_scale=2**8, hysteresis=1)
    assert by_keywords == whole and by_keywords.initial_scale == 2**8  # old field reads work
    with pytest.raises(TypeError, match="not both"):
        MixedPrecision("fp16", initial_scale=2**4, scaler_config=config)
    with pytest.raises(AttributeError):
        by_keywords.precision = "bf16"  # type: ignore[misc]


def test_names_are_exported_from_both_modules() -> None:
    for name in (
        "FP16TorchMixedPrecision",
        "FP16NaiveMixedPrecision",
        "FP16ApexMixedPrecision",
        "BF16MixedPrecision",
        "FP8MixedPrecision",
    ):
        assert name in booster_pkg.__all__ and name in mp_module.__all__
        assert getattr(booster_pkg, name) is getattr(mp_module, name)
