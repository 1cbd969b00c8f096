"""Every plugin takes its groups from its ParallelDims: DDP, ZeRO and FSDP use its dp group."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist
from booster_testlib import make_model, make_optimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from colossal.booster import Booster, DPPluginBase
from colossal.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin
from colossal.booster.plugin.base import find_module
from colossal.core import ParallelDims
from colossal.core.testing import distributed_test


def _boost(plugin: object) -> tuple:
    model = make_model()
    return Booster(plugin=plugin).boost(model, make_optimizer(model))  # type: ignore[arg-type]


def _groups_used(name: str, plugin: object) -> list[object]:
    """The groups the boosted model/optimizer and the checkpoint IO communicate over."""
    model, optimizer, *_ = _boost(plugin)
    if name == "ddp":
        ddp = find_module(model, DistributedDataParallel)
        used = [ddp.process_group]  # type: ignore[union-attr]
    elif name == "zero":
        used = [optimizer.dp_group]
    else:
        param = next(model.unwrap().parameters())
        assert isinstance(param, DTensor)
        used = [param.device_mesh.get_group()]
    return [*used, plugin.get_checkpoint_io().group]  # type: ignore[attr-defined]


PLUGINS = {
    "ddp": TorchDDPPlugin,
    "zero": lambda **kw: LowLevelZeroPlugin(stage=2, precision="fp32", **kw),
    "fsdp": TorchFSDPPlugin,
}


@distributed_test(2)
def test_plugin_groups_come_from_parallel_dims(rank: int, world_size: int) -> None:
    """Catches a plugin that builds or defaults its own group instead of the ParallelDims one."""
    singles = [dist.new_group([r]) for r in range(world_size)]
    for name, make in PLUGINS.items():
        # Whole job: the ParallelDims group is the default group; nothing new is created.
        plugin = make()
        dims = plugin.parallel_dims
        assert isinstance(dims, ParallelDims) and dims.dp == 2 and dims.world_size == 2
        assert plugin.dp_group is dims.group("dp") is dist.group.WORLD, name
        assert (plugin.rank, plugin.world_size) == (rank, 2), name
        assert all(g is dims.group("dp") for g in _groups_used(name, plugin)), name
        # A given dp group (here each rank alone): wrapped, not rebuilt, and used everywhere.
        plugin = make(dp_group=singles[rank])
        dims = plugin.parallel_dims
        assert dims.dp_group is singles[rank] and dims.dp == 1 and dims.ranks("dp") == [rank]
        assert (plugin.rank, plugin.world_size) == (0, 1), name
        assert all(g is singles[rank] for g in _groups_used(name, plugin)), name
    _fsdp_hybrid_mesh_comes_from_parallel_dims()
    _zero_plugin_builds_one_scaler_config()


def _fsdp_hybrid_mesh_comes_from_parallel_dims() -> None:
    """Catches HYBRID_SHARD building its 2-D mesh from groups of its own."""
    from torch.distributed.fsdp import ShardingStrategy

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # two "nodes" of one rank: replicate 2 x shard 1
    try:
        plugin = TorchFSDPPlugin(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        model, *_ = _boost(plugin)
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    dims = plugin.parallel_dims
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (2, 2, 1)
    mesh = next(model.unwrap().parameters()).device_mesh
    assert mesh.mesh_dim_names == ("replicate", "shard")
    assert mesh.get_group("replicate") is dims.group("dp_replicate")
    assert mesh.get_group("shard") is dims.group("dp_shard")


def _zero_plugin_builds_one_scaler_config() -> None:
    """Catches plugin scaler settings lost on their way to the optimizer's scaler."""
    plugin = LowLevelZeroPlugin(
        precision="fp16", initial_scale=2**10, growth_interval=7, hysteresis=3, backoff_factor=0.25
    )
    config = plugin.config.scaler_config
    assert (config.initial_scale, config.growth_interval, config.hysteresis) == (2**10, 7, 3)
    assert config.backoff_factor == 0.25
    _, optimizer, *_ = _boost(plugin)
    assert optimizer.scaler.config is config
    with pytest.raises(ValueError, match="dp_group or parallel_dims, not both"):
        DPPluginBase.__init__(plugin, dist.group.WORLD, parallel_dims=ParallelDims.data_parallel())
