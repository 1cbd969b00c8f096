"""ColossalAI's plugin attributes and arguments: pg_mesh, the groups, the axes, the sizes.

ColossalAI's tests read ``plugin.pg_mesh``, ``plugin.tp_group``, ``plugin.stage_manager``,
``plugin.dp_size``... and pass ``overlap_p2p=``, ``overlap_allgather=``, ``scheduler_nodes=``,
``inner_ring_size=``, ``sequence_parallelism_mode=`` (with sequence parallelism off).
"""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist
from hybrid_testlib import MODELS, make_optimizer

from colossal.booster import Booster
from colossal.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin
from colossal.booster.plugin.hybrid import plugin as hybrid_module
from colossal.core import ProcessGroupMesh
from colossal.core.testing import distributed_test


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return list(dist.get_process_group_ranks(group))


def _along(mesh: ProcessGroupMesh, axis: int | str | tuple[int | str, ...]) -> list[int]:
    return _ranks(mesh.get_group_along_axis(axis))


@distributed_test(4)
def test_attributes_are_the_groups_the_plugins_use(rank: int, world_size: int) -> None:
    """Catches: an axis index pointing at another axis of pg_mesh, a group attribute that is
    not the group the plugin trains with, sizes that disagree with the groups, the stage
    manager on a different pipeline axis than pp_axis."""
    plugin = HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2, precision="fp32")
    mesh = plugin.pg_mesh
    tp = [2 * (rank // 2), 2 * (rank // 2) + 1]  # default order: dp, pp, sp, tp (tp inner)
    pp = [rank % 2, rank % 2 + 2]
    assert _ranks(plugin.tp_group) == _along(mesh, plugin.tp_axis) == tp
    assert _ranks(plugin.pp_group) == _along(mesh, plugin.pp_axis) == pp
    assert _along(mesh, plugin.dp_axis) == [rank] and _along(mesh, plugin.sp_axis) == [rank]
    assert plugin.mixed_dp_group is plugin.zero_group
    assert (plugin.dp_size, plugin.tp_size, plugin.pp_size, plugin.sp_size) == (1, 2, 2, 1)
    assert plugin.stage_manager is not None
    assert plugin.stage_manager.stage == mesh.coordinate(plugin.pp_axis) == rank // 2
    assert (plugin.precision, plugin.zero_stage, plugin.max_norm) == ("fp32", 0, 0.0)
    shard_config = plugin.shard_config
    assert shard_config.tensor_parallel_process_group is plugin.tp_group
    assert shard_config.pipeline_stage_manager is plugin.stage_manager

    dp = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    assert _ranks(dp.dp_group) == _along(dp.pg_mesh, dp.dp_axis) == [rank % 2, rank % 2 + 2]
    assert dp.dp_size == 2 and dp.stage_manager is None

    gemini = GeminiPlugin(tp_size=2, precision="fp32", enable_async_reduce=False)
    assert _ranks(gemini.tp_group) == _along(gemini.pg_mesh, "tp") == tp
    assert _ranks(gemini.zero_group) == _along(gemini.pg_mesh, ("dp_replicate", "dp_shard"))
    assert gemini.dp_size == 2 and gemini.enable_async_reduce is False
    with pytest.raises(TypeError, match="enable_async_reduce='yes' must be True or False"):
        GeminiPlugin(enable_async_reduce="yes")  # type: ignore[arg-type]

    zero = LowLevelZeroPlugin(stage=1, precision="fp32")
    assert zero.dp_size == 4 and zero.pg_mesh.size("dp_shard") == 4 and zero.precision == "fp32"
    assert _ranks(zero.pg_mesh.get_group_along_axis("dp_shard")) == [0, 1, 2, 3]


def test_sequence_parallelism_mode_is_ignored_when_off() -> None:
    """Catches: the mode refused while sequence parallelism is off (ColossalAI ignores it),
    or kept (the model would be sharded for a sequence split that is not there)."""
    from colossal.booster.plugin.hybrid.config import HybridConfig

    cfg = HybridConfig(tp_size=2, pp_size=1, world_size=4, sequence_parallelism_mode="ring")
    assert cfg.sequence_parallelism_mode is None and cfg.resolved_sp_size == 1
    with pytest.raises(ValueError, match="'ulysses' is not one of"):
        HybridConfig(tp_size=1, pp_size=1, world_size=4, sequence_parallelism_mode="ulysses")


def _options(**kwargs: object) -> None:
    from colossal.booster.plugin.hybrid.colossalai_options import check_colossalai_options
    from colossal.booster.plugin.hybrid.config import HybridConfig

    layout = {
        k: kwargs.pop(k)
        for k in ("pp_size", "pp_style", "num_model_chunks", "num_microbatches", "sp_size",
                  "enable_sequence_parallelism", "sequence_parallelism_mode")
        if k in kwargs
    }  # fmt: skip
    cfg = HybridConfig(tp_size=1, world_size=4, **{"pp_size": 1, **layout})  # type: ignore[arg-type]
    options = {"overlap_p2p": True, "overlap_allgather": True, "scheduler_nodes": None,
               "inner_ring_size": None, **kwargs}  # fmt: skip
    check_colossalai_options(cfg, logging.getLogger("test"), **options)  # type: ignore[arg-type]


def test_colossalai_tuning_options(caplog: pytest.LogCaptureFixture) -> None:
    """Catches: scheduler_nodes silently accepted where no schedule uses them, an inner ring
    that does not divide sp_size accepted under ring_attn, overlap_p2p=False accepted without
    saying it has no effect."""
    zbv = {"pp_size": 2, "pp_style": "zbv", "num_model_chunks": 2, "num_microbatches": 4}
    _options(scheduler_nodes=[], **zbv)
    with pytest.raises(ValueError, match="scheduler_nodes is for pp_style='zbv'"):
        _options(scheduler_nodes=[], pp_size=2, num_microbatches=2)
    with pytest.raises(TypeError, match="scheduler_nodes must be the list"):
        _options(scheduler_nodes="nodes", **zbv)
    ring = {"sp_size": 4, "enable_sequence_parallelism": True,
            "sequence_parallelism_mode": "ring_attn"}  # fmt: skip
    _options(inner_ring_size=2, **ring)
    with pytest.raises(ValueError, match="inner_ring_size=3 must divide sp_size=4"):
        _options(inner_ring_size=3, **ring)
    _options(inner_ring_size=3)  # not ring attention: ignored, as ColossalAI does
    with pytest.raises(TypeError, match="overlap_allgather='yes' must be True or False"):
        _options(overlap_allgather="yes")
    with caplog.at_level(logging.WARNING):
        _options(overlap_p2p=False)
    assert "overlap_p2p=False) has no effect" in caplog.text


@distributed_test(1)
def test_overlap_allgather_reaches_zero(rank: int, world_size: int) -> None:
    """Catches: overlap_allgather accepted by the plugin but not given to ZeRO (it would get
    no such keyword, or its own default True)."""
    seen: list[object] = []

    class Recording(hybrid_module.LowLevelZeroOptimizer):  # type: ignore[misc, name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            seen.append(kwargs.get("overlap_allgather"))
            super().__init__(*args, **kwargs)

    hybrid_module.LowLevelZeroOptimizer = Recording  # type: ignore[attr-defined, misc]
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=1, precision="fp32", zero_stage=1, overlap_allgather=False
    )
    model = MODELS["gpt2"]()
    Booster(plugin=plugin).boost(model, make_optimizer(model, "sgd"))
    assert seen == [False]
