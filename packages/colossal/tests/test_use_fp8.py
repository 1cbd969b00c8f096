"""``use_fp8=True``: the hybrid plugins' linear layers run as float8 matmuls.

A tiny GPT-2 (tp_size=2, world 2, fp32 otherwise) trains ``STEPS`` SGD steps with and
without ``use_fp8``. Each float8 product is within ~12.5% (forward; ~20% for the gradients) of
its terms' magnitudes, but those errors are unbiased and average out over the sums: the fp8
run's losses stay within ``LOSS_TOL`` of the fp32 run's and fall, and its parameter updates
(SGD: the summed gradients) within ``UPDATE_TOL`` per tensor and ``TOTAL_TOL`` over all. Layers
left in fp32 (the flag ignored) give bit-equal losses; a weight read in the wrong layout
breaks the update bounds (measured below); a lost scale (outputs off by ``amax / 448``, 10-100x
here) the loss bound. Mixtral under ``MoeHybridParallelPlugin(ep_size=2)`` checks that the
MoE plugin switches its attention projections and still tracks fp32. The refusal is checked
with the probe patched to report a missing piece.
"""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import full, global_batch, gpt2, make_optimizer, rows

from colossal.booster import Booster
from colossal.core.testing import distributed_test, relative_error

STEPS = 4
# Measured (world 2, tp 2): loss at most 5.2e-5 relative; parameter updates at most 0.10
# relative per tensor (LayerNorms), 0.035 over all. With the weights read in the wrong layout:
# loss 1e-3 (the tiny-init model is near uniform), updates up to 1.69 per tensor, 0.69 overall.
LOSS_TOL = 5e-4
UPDATE_TOL = 0.25
TOTAL_TOL = 0.08
MOE_STEPS = 3
MOE_LOSS_TOL = 0.01  # Mixtral ep 2, AdamW: measured at most 1.9e-3 relative


def _train(use_fp8: bool) -> tuple[list[float], int, dict[str, torch.Tensor]]:
    from colossal.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", use_fp8=use_fp8)
    model = gpt2()
    booster = Booster(plugin=plugin)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    boosted, opt, *_ = booster.boost(model, make_optimizer(model, "sgd"))
    switched = sum(bool(getattr(m, "_colossal_fp8", False)) for m in boosted.modules())
    losses = []
    for step in range(STEPS):
        loss = boosted(**rows(global_batch(step % 2), 0, 1)).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    named = dict(model.named_parameters())
    updates = {n: full(named[n]) - p0 for n, p0 in start.items() if n in named}
    return losses, switched, updates


@distributed_test(2)
def test_gpt2_tp2_fp8_tracks_fp32(rank: int, world_size: int) -> None:
    """Catches use_fp8 ignored (no layer switched, losses bit-equal to fp32), the Shardformer
    layers skipped, a wrong layout (updates past UPDATE_TOL/TOTAL_TOL), a lost scale (loss past
    LOSS_TOL) and broken gradients (the loss does not fall)."""
    torch.set_num_threads(1)
    losses32, none, updates32 = _train(False)
    losses8, switched, updates8 = _train(True)
    assert none == 0
    assert switched == 4 * 4, switched  # c_attn, attn.c_proj, c_fc, mlp.c_proj; not the head
    assert losses8 != losses32
    for a, b in zip(losses8, losses32, strict=True):
        assert abs(a - b) <= LOSS_TOL * abs(b), (losses8, losses32)
    for name, u32 in updates32.items():
        assert relative_error(updates8[name], u32) <= UPDATE_TOL, name
    every = [torch.cat([u[n].flatten() for n in updates32]) for u in (updates8, updates32)]
    assert relative_error(*every) <= TOTAL_TOL
    assert losses8[2] < losses8[0] and losses8[3] < losses8[1], losses8  # same batch, later


@pytest.mark.parametrize("plugin", ["HybridParallelPlugin", "MoeHybridParallelPlugin"])
def test_refused_where_the_probe_fails(plugin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches use_fp8 accepted where torch._scaled_mm fails, and a refusal that does not say
    what is missing."""
    import colossal.booster.plugin as plugins
    from colossal.booster.plugin import fp8

    missing = "torch._scaled_mm fails on cuda:0 ('T4', compute capability 7.5; float8 needs 8.9+)"
    monkeypatch.setattr(fp8, "kernel_fp8_missing", lambda device: missing)
    with pytest.raises(NotImplementedError, match=rf"{plugin}\(use_fp8=True\).*T4"):
        getattr(plugins, plugin)(tp_size=1, pp_size=1, use_fp8=True)


def _train_moe(use_fp8: bool, rank: int) -> tuple[list[float], int]:
    from moe_hybrid_testlib import adamw, batch, mixtral
    from moe_hybrid_testlib import rows as moe_rows

    from colossal.booster.plugin import MoeHybridParallelPlugin

    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", use_fp8=use_fp8
    )
    model = mixtral()
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model))
    switched = sum(bool(getattr(m, "_colossal_fp8", False)) for m in boosted.modules())
    losses = []
    for step in range(MOE_STEPS):
        loss = boosted(**moe_rows(batch(step % 2), rank, 2)).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, switched


@distributed_test(2)
def test_mixtral_ep2_fp8_tracks_fp32(rank: int, world_size: int) -> None:
    """Catches use_fp8 ignored by MoeHybridParallelPlugin (no layer switched, bit-equal losses),
    and float8 attention projections that break expert-parallel training (loss off the fp32
    run's by more than MOE_LOSS_TOL, or not falling)."""
    torch.set_num_threads(1)
    losses32, none = _train_moe(False, rank)
    losses8, switched = _train_moe(True, rank)
    assert none == 0
    assert switched == 2 * 4, switched  # q, k, v, o per layer (the router is no nn.Linear)
    assert losses8 != losses32
    for a, b in zip(losses8, losses32, strict=True):
        assert abs(a - b) <= MOE_LOSS_TOL * abs(b), (losses8, losses32)
    assert losses8[2] < losses8[0], losses8
