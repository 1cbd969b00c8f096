"""launch(config) and gpc: the config's rules, and groups that match ParallelDims."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from colossal.core import ParallelDims
from colossal.core.testing import distributed_test
from colossal.legacy import Config, init_context
from colossal.legacy.constants import INITIALIZER_MAPPING
from colossal.legacy.context import (
    ParallelMode,
    ProcessGroupInitializer,
    new_groups,
    parse_parallel,
)
from colossal.legacy.core import gpc
from colossal.legacy.registry import DIST_GROUP_INITIALIZER

# ---- the config ------------------------------------------------------------------------------


def test_config_file_keeps_settings_not_imports(tmp_path: Path) -> None:
    path = tmp_path / "config.py"
    path.write_text(
        "import math\nfrom collections import OrderedDict\n_private = 1\n"
        "BATCH_SIZE = 128\nfp16 = dict(mode='torch', nested=dict(x=math.pi))\n"
        "gradient_handler = [dict(type='DataParallelGradientHandler')]\n"
    )
    cfg = Config.from_file(path)
    assert sorted(cfg) == ["BATCH_SIZE", "fp16", "gradient_handler"]
    assert cfg.BATCH_SIZE == 128 and cfg.fp16.nested.x == pytest.approx(3.14159, abs=1e-5)
    assert cfg.gradient_handler[0].type == "DataParallelGradientHandler"
    with pytest.raises(AttributeError, match="no key 'EPOCHS'"):
        _ = cfg.EPOCHS
    with pytest.raises(ValueError, match="must be a Python file"):
        Config.from_file(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("parallel", "world", "expected"),
    [  # the seeds' "this is ok" examples, and the defaults
        (dict(pipeline=dict(size=2), tensor=dict(size=4, mode="2d")), 16, (2, 2, 4, "2d")),
        (dict(pipeline=2, tensor=dict(size=4, mode="2d")), 8, (1, 2, 4, "2d")),
        (dict(pipeline=2), 4, (2, 2, 1, None)),
        (dict(tensor=dict(size=4, mode="2d")), 4, (1, 1, 4, "2d")),
        (None, 4, (4, 1, 1, None)),
        (dict(tensor=dict(size=8, mode="2.5d", depth=2)), 8, (1, 1, 8, "2.5d")),
        (dict(tensor=dict(size=2, mode="sequence")), 4, (2, 1, 2, "sequence")),
    ],
)
def test_parallel_section_sizes(parallel: dict | None, world: int, expected: tuple) -> None:
    settings = parse_parallel(parallel)
    dims = settings.to_dims(world)
    assert (dims.dp, dims.pp, settings.tensor, settings.mode) == expected
    assert dims.sp == (settings.tensor if settings.mode == "sequence" else 1)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (dict(pipeline=2, tensor=4), r"tensor=4 does not say which tensor parallelism"),
        (dict(tensor=dict(size=4)), r"size 4 but no mode; add mode='1d'"),
        (dict(tensor=dict(size=4, mode="4d")), r"mode='4d' is not one of"),
        (dict(tensor=dict(size=8, mode="2.5d")), r"'2.5d' needs its depth"),
        (dict(pipline=2), r"unknown key\(s\) \['pipline'\]"),
        (dict(pipeline=0), r"pipeline size must be a positive int, got 0"),
    ],
)
def test_parallel_section_errors(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_parallel(parallel)


def test_sizes_that_do_not_fit_the_world_are_refused() -> None:
    with pytest.raises(ValueError, match="tp=8 is not a square"):
        parse_parallel(dict(tensor=dict(size=8, mode="2d"))).to_dims(8)
    with pytest.raises(ValueError, match="does not divide the world size 4"):
        parse_parallel(dict(pipeline=3)).to_dims(4)


def test_gpc_before_launch_says_what_to_call() -> None:
    assert not gpc.is_initialized(ParallelMode.DATA) and gpc.config == {}
    with pytest.raises(RuntimeError, match=r"call colossal.legacy.launch\(config=...\)"):
        gpc.get_world_size(ParallelMode.DATA)


# ---- groups ------------------------------------------------------------------------------------

CASES = {
    4: [
        (dict(pipeline=2), ("dp", "pp")),
        (dict(tensor=dict(size=4, mode="2d")), ("tp_row", "tp_col")),
        (dict(tensor=dict(size=2, mode="1d")), ("tp", "dp")),
        (dict(tensor=dict(size=2, mode="sequence")), ("sp",)),
    ],
    8: [
        (dict(pipeline=2, tensor=dict(size=4, mode="2d")), ("dp", "pp", "tp_row", "tp_col")),
        (dict(tensor=dict(size=8, mode="2.5d", depth=2)), ("tp_row", "tp_col", "tp_dep")),
        (dict(tensor=dict(size=8, mode="3d")), ("tp_input", "tp_weight", "tp_output")),
    ],
}

MODE_OF_AXES = {
    ("dp",): ParallelMode.DATA,
    ("pp",): ParallelMode.PIPELINE,
    ("tp",): ParallelMode.TENSOR,
    ("sp",): ParallelMode.SEQUENCE,
}


def _sum_over(group: dist.ProcessGroup) -> int:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return int(t.item())


def _check_groups(parallel: dict) -> None:
    init_context(dict(parallel=parallel), verbose=False)
    settings = parse_parallel(parallel)
    dims = ParallelDims(
        **{
            "dp": -1,
            "pp": settings.pipeline,
            "tp": 1 if settings.mode == "sequence" else settings.tensor,
            "sp": settings.tensor if settings.mode == "sequence" else 1,
        },
        tp_mode=settings.mode if settings.mode in ("1d", "2d", "2.5d", "3d") else None,
        tp_depth=settings.depth,
    )
    expected = {
        ParallelMode.DATA: "dp",
        ParallelMode.MODEL: ("pp", "sp", "tp"),
        ParallelMode.TENSOR: "sp" if settings.mode == "sequence" else "tp",
        ParallelMode.PARALLEL_2D_ROW: "tp_row",
        ParallelMode.PARALLEL_2D_COL: "tp_col",
        ParallelMode.PARALLEL_2P5D_DEP: "tp_dep",
        ParallelMode.PARALLEL_2P5D_XZ: ("tp_dep", "tp_row"),
        ParallelMode.PARALLEL_3D_INPUT: "tp_input",
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: ("tp_output", "tp_weight"),
        ParallelMode.PIPELINE: "pp",
        ParallelMode.SEQUENCE_DP: ("dp", "sp"),
    }
    needs = {  # modes that exist only with some configs
        ParallelMode.PIPELINE: settings.pipeline > 1,
        ParallelMode.SEQUENCE_DP: settings.mode == "sequence",
        ParallelMode.PARALLEL_2D_ROW: settings.mode == "2d",
        ParallelMode.PARALLEL_2D_COL: settings.mode == "2d",
        ParallelMode.PARALLEL_2P5D_DEP: settings.mode == "2.5d",
        ParallelMode.PARALLEL_2P5D_XZ: settings.mode == "2.5d",
        ParallelMode.PARALLEL_3D_INPUT: settings.mode == "3d",
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: settings.mode == "3d",
    }
    for mode, axes in expected.items():
        if not needs.get(mode, True):
            assert not gpc.is_initialized(mode), mode
            continue
        ranks = dims.ranks(axes)
        assert gpc.get_ranks_in_group(mode) == ranks, mode
        assert gpc.get_world_size(mode) == len(ranks)
        assert gpc.get_local_rank(mode) == ranks.index(dist.get_rank())
        # The group really spans those ranks.
        assert _sum_over(gpc.get_group(mode)) == sum(ranks), mode
    assert gpc.get_world_size(ParallelMode.GLOBAL) == dist.get_world_size()
    assert gpc.pipeline_parallel_size == settings.pipeline
    stage = gpc.get_local_rank(ParallelMode.PIPELINE) if settings.pipeline > 1 else 0
    assert gpc.is_pipeline_first_stage() == (stage == 0)
    assert gpc.is_pipeline_last_stage() == (stage == settings.pipeline - 1)
    gpc.destroy()


@distributed_test(4)
def test_gpc_groups_match_parallel_dims_at_world_4(rank: int, world_size: int) -> None:
    for parallel, _ in CASES[4]:
        _check_groups(parallel)


@distributed_test(8)
def test_gpc_groups_match_parallel_dims_at_world_8(rank: int, world_size: int) -> None:
    for parallel, _ in CASES[8]:
        _check_groups(parallel)


@distributed_test(2)
def test_uninitialized_mode_names_the_config_key(rank: int, world_size: int) -> None:
    init_context(dict(BATCH_SIZE=3), verbose=False)
    assert gpc.config.BATCH_SIZE == 3 and gpc.data_parallel_size == 2
    assert not gpc.is_initialized(ParallelMode.PIPELINE)
    with pytest.raises(RuntimeError, match=r"needs parallel=dict\(pipeline=N\)"):
        gpc.get_local_rank(ParallelMode.PIPELINE)
    with pytest.raises(RuntimeError, match=r"mode='2d'"):
        gpc.get_group(ParallelMode.PARALLEL_2D_ROW)
    assert gpc.is_pipeline_first_stage() and gpc.is_pipeline_last_stage()
    with pytest.raises(RuntimeError, match="already initialized"):
        init_context(dict(), verbose=False)
    gpc.destroy()


@DIST_GROUP_INITIALIZER.register_module
class PairInitializer(ProcessGroupInitializer):
    """A custom mode: ranks in pairs (0, 3) and (1, 2)."""

    def __init__(self, rank, world_size, config, dp, pp, tp, swap: bool = False) -> None:
        super().__init__(rank, world_size, config)
        self.swap = swap

    def init_parallel_groups(self):  # the seeds' name for the hook
        pairs = [[0, 3], [1, 2]] if self.swap else [[0, 1], [2, 3]]
        return new_groups(pairs, "pairs")


@distributed_test(4)
def test_custom_mode_through_the_registry(rank: int, world_size: int) -> None:
    INITIALIZER_MAPPING["pairs"] = "PairInitializer"
    init_context(dict(parallel=dict(tensor=dict(size=2, mode="pairs", swap=True))), verbose=False)
    expected = [[0, 3], [1, 2], [1, 2], [0, 3]][rank]
    assert gpc.get_ranks_in_group("pairs") == expected
    assert _sum_over(gpc.get_group("pairs")) == sum(expected)
    assert gpc.get_world_size(ParallelMode.TENSOR) == 2 and gpc.data_parallel_size == 2
    gpc.destroy()
