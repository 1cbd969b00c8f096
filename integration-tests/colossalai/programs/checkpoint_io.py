"""Booster checkpoint IO round trips (ColossalAI's tests/test_checkpoint_io pattern).

For TorchDDPPlugin, LowLevelZeroPlugin (ZeRO-2) and GeminiPlugin: train one step, save the
model and the optimizer (sharded with a small ``size_per_shard``, and as one file where the
plugin writes one), load both into a freshly boosted model and optimizer, and check that the
state dicts are equal and that one more step gives the same loss and weights on both.
"""

import os
import tempfile
from contextlib import contextmanager, nullcontext

import colossalai
import torch
import torch.distributed as dist
import torch.nn as nn
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from colossalai.nn.optimizer import HybridAdam
from colossalai.testing import check_state_dict_equal, rerun_if_address_is_in_use, spawn


@contextmanager
def shared_tempdir():
    """One temporary directory for all ranks (rank 0 creates and removes it)."""
    ctx = tempfile.TemporaryDirectory() if dist.get_rank() == 0 else nullcontext()
    with ctx as tempdir:
        holder = [tempdir]
        dist.broadcast_object_list(holder, src=0)
        try:
            yield holder[0]
        finally:
            dist.barrier()


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))


def criterion(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def step(booster, model, optimizer, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 16, generator=generator).to(get_accelerator().get_current_device())
    loss = criterion(model(x))
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def check_plugin(name, make_plugin, shard: bool) -> None:
    booster = Booster(plugin=make_plugin())
    torch.manual_seed(0)
    model = make_model()
    optimizer = HybridAdam(model.parameters(), lr=1e-2)
    model, optimizer, _, _, _ = booster.boost(model, optimizer)
    step(booster, model, optimizer, seed=1)
    with shared_tempdir() as tempdir:
        model_path = os.path.join(tempdir, "model" if shard else "model.pt")
        optimizer_path = os.path.join(tempdir, "optimizer" if shard else "optimizer.pt")
        booster.save_model(model, model_path, shard=shard, size_per_shard=1)
        booster.save_optimizer(optimizer, optimizer_path, shard=shard, size_per_shard=1)
        dist.barrier()
        torch.manual_seed(123)  # other initial weights: the load must replace them
        new_booster = Booster(plugin=make_plugin())
        new_model = make_model()
        new_optimizer = HybridAdam(new_model.parameters(), lr=1e-2)
        new_model, new_optimizer, _, _, _ = new_booster.boost(new_model, new_optimizer)
        new_booster.load_model(new_model, model_path)
        new_booster.load_optimizer(new_optimizer, optimizer_path)
    check_state_dict_equal(model.state_dict(), new_model.state_dict())
    check_state_dict_equal(optimizer.state_dict(), new_optimizer.state_dict())
    loss = step(booster, model, optimizer, seed=2)
    new_loss = step(new_booster, new_model, new_optimizer, seed=2)
    assert loss == new_loss, f"{name}: {loss} != {new_loss}"
    check_state_dict_equal(model.state_dict(), new_model.state_dict())
    if dist.get_rank() == 0:
        print(f"{name} shard={shard}: state dicts equal, next loss {loss:.6f} on both")


def run_dist(rank, world_size, port):
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    check_plugin("TorchDDPPlugin", TorchDDPPlugin, shard=False)
    check_plugin("TorchDDPPlugin", TorchDDPPlugin, shard=True)
    check_plugin("LowLevelZeroPlugin", lambda: LowLevelZeroPlugin(stage=2, precision="fp32"), True)
    check_plugin("GeminiPlugin", lambda: GeminiPlugin(precision="fp32"), shard=True)


@rerun_if_address_is_in_use()
def test_checkpoint_io():
    spawn(run_dist, 2)


if __name__ == "__main__":
    test_checkpoint_io()
    print("checkpoint_io: OK")
