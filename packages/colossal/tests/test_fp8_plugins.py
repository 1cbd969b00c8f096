"""``fp8_communication=True`` on the plugins: training tracks fp32 and moves fewer bytes.

Plain SGD moves each parameter by ``lr * grad``: the update after ``STEPS`` steps carries the
gradients' float8 error (at most 6.25% per element for e4m3, less on average), so it stays
within ``UPDATE_TOL`` of the fp32 plugin's; gradients summed instead of averaged (100% off),
one rank's gradient lost (50%), or a scale lost (NaN) would not. The losses track within
``LOSS_TOL``.
"""

from __future__ import annotations

import pytest
import torch
from booster_testlib import local_batch, make_model

from colossal.booster import Booster
from colossal.core.comm import CommTracker
from colossal.core.testing import distributed_test, relative_error

STEPS = 4
UPDATE_TOL = 0.08  # measured (DDP, world 2): at most 0.042 per tensor
LOSS_TOL = 0.02  # relative; measured at most 2.5e-4 (DDP), 7.8e-3 (ZeRO-2), 5.6e-3 (Gemini)


def _train(
    plugin: object, rank: int, world: int
) -> tuple[list[float], list[torch.Tensor], CommTracker]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    booster = Booster(plugin=plugin)  # type: ignore[arg-type]
    boosted, opt, *_ = booster.boost(model, opt)
    losses = []
    with CommTracker() as tracker:
        for step in range(STEPS):
            x, y = local_batch(step, rank, world)
            loss = (boosted(x) - y).pow(2).mean()
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], tracker


@pytest.mark.parametrize("plugin", ["ddp", "zero2", "gemini", "fsdp"])
@distributed_test(2)
def test_fp8_communication_tracks_fp32(rank: int, world_size: int, plugin: str) -> None:
    """Catches an fp8 flag that is ignored (bytes unchanged), gradients not averaged or missing
    a rank, a lost scale (updates off by far more than ``UPDATE_TOL``), FSDP's collectives left
    in fp32 (no float8 records), and (ddp case) a hybrid plugin dropping its fp8 flags."""
    torch.set_num_threads(1)
    from colossal.booster.plugin import (
        GeminiPlugin,
        LowLevelZeroPlugin,
        TorchDDPPlugin,
        TorchFSDPPlugin,
    )

    def make(fp8: bool) -> object:
        if plugin == "ddp":
            return TorchDDPPlugin(fp8_communication=fp8)
        if plugin == "fsdp":
            return TorchFSDPPlugin(fp8_communication=fp8)
        if plugin == "gemini":
            return GeminiPlugin(
                precision="fp32", chunk_config_dict={"chunk_size": 128}, fp8_communication=fp8
            )
        return LowLevelZeroPlugin(
            stage=2, precision="fp32", reduce_bucket_size_in_m=1, fp8_communication=fp8
        )

    start = [p.detach().clone() for p in make_model().parameters()]
    losses32, params32, t32 = _train(make(False), rank, world_size)
    losses8, params8, t8 = _train(make(True), rank, world_size)
    for a, b in zip(losses8, losses32, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(b), (losses8, losses32)
    for p8, p32, p0 in zip(params8, params32, start, strict=True):
        if plugin != "ddp":  # other ranks' slices arrive as float8 (colossal-zero's
            continue  # test_fp8_communication compares the exact masters)
        assert relative_error(p8 - p0, p32 - p0) <= UPDATE_TOL
    numel = sum(p.numel() for p in start)
    if plugin == "ddp":  # one bucket: fp32 4 n bytes, fp8 n + 4 per scale (w pieces)
        assert t32.calls() == 0  # torch DDP's own all-reduce bypasses the tracker
        padded = -(-numel // world_size) * world_size
        assert t8.bytes("all_reduce") == STEPS * (padded + 4 * world_size), t8.table()
    elif plugin == "fsdp":  # FSDP2's own collectives bypass the tracker; the fp8 ones do not
        assert t32.calls() == 0
        assert t8.bytes("all_gather") > 0 and t8.bytes("reduce_scatter") > 0, t8.table()
    else:
        for kind in ("reduce_scatter", "all_gather"):
            assert 4 * t8.bytes(kind) < 1.1 * t32.bytes(kind), (t8.table(), t32.table())
            assert t8.bytes(kind) > 0
    assert {r.dtype for r in t8.records if r.nbytes > 16} == {"float8_e4m3fn"}, t8.table()
    if plugin == "ddp":
        _check_refusals()


def _check_refusals() -> None:
    """The hybrid plugins keep both fp8 flags (test_use_fp8: float8 matmuls and their refusal)."""
    from colossal.booster.plugin import HybridParallelPlugin, MoeHybridParallelPlugin

    assert HybridParallelPlugin(tp_size=1, pp_size=1, use_fp8=True).use_fp8  # CPU _scaled_mm
    plugin = HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=1, fp8_communication=True)
    assert plugin.zero_config.fp8_communication
    assert MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, use_fp8=True).use_fp8
    moe = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, fp8_communication=True)
    assert moe.zero_config.fp8_communication
