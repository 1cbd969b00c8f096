"""Optimizer checkpoints of MoeHybridParallelPlugin (ep 2 x moe_dp 2, ZeRO-2) in the one format.

The AdamW states saved after two steps must continue a single-process run exactly when loaded
back at another expert-parallel size (ep 4, ep 1) or by another plugin (LowLevelZeroPlugin over
the plain model): each expert's states come from the rank holding it.
"""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
from moe_hybrid_testlib import EXPERTS, NET_HIDDEN, MoeNet, adamw
from torch import nn

from colossal.booster import Booster
from colossal.core.comm import all_gather_object
from colossal.core.testing import assert_rel_close, distributed_test

H, E, T = NET_HIDDEN, EXPERTS, 6
RTOL = 1e-5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(100 + step)
    return torch.randn(4, T, H), torch.randn(4, T, H)


def _expert_slice(name: str, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return q[lo:hi] if name.startswith("moe.experts.") else q


def _boost(plugin: object, lo: int, hi: int, ref: MoeNet) -> tuple[Booster, nn.Module, object]:
    model = MoeNet(getattr(plugin, "ep_group", None) if getattr(plugin, "ep_size", 1) > 1 else None)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            p.copy_(_expert_slice(name, q, lo, hi))
    booster = Booster(plugin=plugin)  # type: ignore[arg-type]
    boosted, optimizer, *_ = booster.boost(model, adamw(model))
    return booster, boosted, optimizer


def _step(booster: Booster, boosted: nn.Module, optimizer: object, rank: int, step: int) -> None:
    x, target = _batch(step)
    optimizer.zero_grad()  # type: ignore[attr-defined]
    booster.backward(nn.functional.mse_loss(boosted(x[rank]), target[rank]), optimizer)
    optimizer.step()  # type: ignore[attr-defined]


@distributed_test(4, timeout=180, comm_timeout=60)
def test_moe_optimizer_states_continue_at_ep4_ep1_and_under_zero(
    rank: int, world_size: int
) -> None:
    """Catches: optimizer saves refused or writing only dp rank 0's experts (ep rank 1's
    experts would restart Adam: a first-step update of ``lr`` where the continued run's is a
    third of that), states of one expert loaded into another (a wrong block at ep 4), the
    moe_dp ZeRO shards of an expert state concatenated out of order, and dense states taken
    from a rank whose experts differ."""
    from colossal.booster.plugin import LowLevelZeroPlugin, MoeHybridParallelPlugin

    torch.set_num_threads(1)
    root = all_gather_object(tempfile.mkdtemp(prefix="moe_optim_") if rank == 0 else None)[0]
    assert root is not None
    try:
        torch.manual_seed(0)
        ref = MoeNet(None)
        ref_opt = adamw(ref)
        plugin = MoeHybridParallelPlugin(ep_size=2, precision="fp32", zero_stage=2)
        ep_rank = dist.get_rank(plugin.ep_group)
        booster, boosted, optimizer = _boost(plugin, ep_rank * 2, ep_rank * 2 + 2, ref)
        for step in range(3):
            x, target = _batch(step)
            ref_opt.zero_grad()
            nn.functional.mse_loss(ref(x.reshape(-1, H)), target.reshape(-1, H)).backward()
            ref_opt.step()
            if step == 2:
                break
            _step(booster, boosted, optimizer, rank, step)
            if step == 1:
                booster.save_model(boosted, f"{root}/m", shard=True, size_per_shard=1)
                booster.save_optimizer(optimizer, f"{root}/o", shard=True, size_per_shard=1)
        for make, kwargs, ep in (
            (MoeHybridParallelPlugin, {"ep_size": 4, "precision": "fp32"}, 4),
            (MoeHybridParallelPlugin, {"ep_size": 1, "precision": "fp32", "zero_stage": 1}, 1),
            (LowLevelZeroPlugin, {"stage": 2, "precision": "fp32"}, 1),
        ):
            lo, hi = (rank, rank + 1) if ep == 4 else (0, E)
            torch.manual_seed(7)
            other = make(**kwargs)
            b, m, o = _boost(other, lo, hi, MoeNet(None))
            b.load_model(m, f"{root}/m")
            b.load_optimizer(o, f"{root}/o")  # type: ignore[arg-type]
            _step(b, m, o, rank, 2)
            o.wait_params()  # type: ignore[attr-defined]
            held = m.unwrap() if hasattr(m, "unwrap") else m  # type: ignore[operator]
            for (name, p), q in zip(held.named_parameters(), ref.parameters(), strict=True):
                want = _expert_slice(name, q, lo, hi)
                assert_rel_close(p.detach(), want.detach(), RTOL, f"{make.__name__} ep{ep} {name}")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
