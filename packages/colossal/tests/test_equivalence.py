"""Every plugin x precision at world 1/2/4 matches the single-process fp32 reference.

One test case per (plugin, precision, world size); each trains two models (an MLP, and one
with an ``nn.ModuleList`` so FSDP shards each block as its own unit). fp16 starts from a
small loss scale everywhere, so no step is skipped and the reference applies.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from booster_testlib import (
    IN,
    OUT,
    full_state,
    make_booster,
    make_model,
    make_optimizer,
    reference,
    train_steps,
)
from torch import nn

from colossal.booster import Booster, MixedPrecision
from colossal.core.testing import distributed_test

STEPS = 4
TOL = {"fp32": 1e-5, "bf16": 4e-2, "fp16": 1e-2}
# Under ZeRO the whole model is fp16 (not autocast), so it drifts further from fp32.
ZERO_FP16_TOL = 5e-2
PRECISIONS = {
    "none": ("fp32", "fp16", "bf16"),
    "ddp": ("fp32", "fp16", "bf16"),
    "zero1": ("fp32", "fp16", "bf16"),
    "zero2": ("fp32", "fp16", "bf16"),
    "fsdp": ("fp32", "bf16"),  # what TorchFSDPPlugin accepts (fp16 is refused: test_api)
    "fsdp-noreshard": ("fp32", "bf16"),
}


class Blocks(nn.Module):
    """An embedding, an ``nn.ModuleList`` of blocks (FSDP units) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, 12)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(12, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make_blocks(seed: int = 1234) -> Blocks:
    torch.manual_seed(seed)
    return Blocks()


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": make_model, "blocks": make_blocks}


def _run(rank: int, world_size: int, plugin: str, precision: str, model_name: str) -> None:
    kwargs: dict = {}
    if plugin.startswith("zero") and precision == "fp16":
        kwargs["initial_scale"] = 2**8
    if plugin == "fsdp-noreshard":
        kwargs["reshard_after_forward"] = False
    if plugin in ("none", "ddp") and precision == "fp16":
        from colossal.booster.plugin import TorchDDPPlugin

        booster = Booster(
            plugin=TorchDDPPlugin() if plugin == "ddp" else None,
            mixed_precision=MixedPrecision("fp16", initial_scale=2**8),
        )
    else:
        booster = make_booster(plugin.split("-")[0], precision, **kwargs)
    model = MODELS[model_name]()
    optimizer = make_optimizer(model)
    model, optimizer, *_ = booster.boost(model, optimizer)
    if plugin == "none":  # no data parallelism: every rank trains on the whole batch
        losses = train_steps(model, optimizer, booster, range(STEPS), 0, 1)
    else:
        losses = train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
    ref_losses, ref_state = reference(STEPS, MODELS[model_name])
    state = full_state(model, booster)
    tol = ZERO_FP16_TOL if plugin.startswith("zero") and precision == "fp16" else TOL[precision]
    where = f"{plugin}/{precision}/{model_name} at world {world_size}"
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=tol,
        atol=tol,
        msg=lambda m: f"{where}: losses differ from the reference: {m}",
    )
    assert state.keys() == ref_state.keys(), where
    for name, ref in ref_state.items():
        torch.testing.assert_close(
            state[name], ref, rtol=tol, atol=tol, msg=lambda m, n=name: f"{where} {n}: {m}"
        )


CASES = [(plugin, precision) for plugin, precs in PRECISIONS.items() for precision in precs]


@pytest.mark.parametrize(("plugin", "precision"), CASES, ids=[f"{p}-{q}" for p, q in CASES])
@distributed_test(1, 2, 4)
def test_plugin_matches_reference(rank: int, world_size: int, plugin: str, precision: str) -> None:
    for model_name in MODELS:
        _run(rank, world_size, plugin, precision, model_name)


def test_fp32_reference_differs_from_bf16() -> None:
    """The tolerances are tight enough to tell precisions apart (tests can fail)."""
    for model_name in MODELS:
        ref_losses, _ = reference(STEPS, MODELS[model_name])
        assert abs(ref_losses[-1] - ref_losses[0]) > TOL["bf16"], model_name
