"""colossalai.testing as ColossalAI's tests use it: spawn + colossalai.launch, the helpers."""

from __future__ import annotations

import colossalai
import pytest
import torch
import torch.distributed as dist
from colossalai.testing import (
    assert_close,
    assert_close_loose,
    check_state_dict_equal,
    clear_cache_before_run,
    free_port,
    parameterize,
    rerun_if_address_is_in_use,
    rerun_on_exception,
    spawn,
)
from colossalai.testing.random import seed_all

import colossal.core.testing as core_testing


@parameterize("scale", [1, 3])
def _check_all_reduce(scale: int, seen: list[int]) -> None:
    t = torch.tensor([float(dist.get_rank() + 1) * scale])
    dist.all_reduce(t)
    seen.append(int(t.item()))


def _run_dist(rank: int, world_size: int, port: int, offset: int) -> list[int]:
    assert not dist.is_initialized(), "spawn must not launch before the function"
    colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port, backend="gloo")
    seen: list[int] = [offset]
    _check_all_reduce(seen=seen)
    return seen


@rerun_if_address_is_in_use()
@clear_cache_before_run()
def test_spawn_then_launch_at_world_2() -> None:
    """ColossalAI's run_dist pattern: spawn passes a free port, the function launches with it.

    Catches: a group launched before the function (colossalai.launch would fail), a port the
    launch cannot use, keyword arguments not forwarded, parameterize running one value.
    """
    assert spawn(_run_dist, 2, offset=7) == [[7, 3, 9], [7, 3, 9]]


def test_names_are_ours() -> None:
    """Catches: a name served from the wrong module (e.g. spawn as core's launching spawn)."""
    assert spawn is core_testing.spawn_with_port
    assert seed_all is core_testing.seed_all
    assert assert_close is torch.testing.assert_close
    assert check_state_dict_equal is core_testing.check_state_dict_equal
    assert rerun_on_exception is core_testing.rerun_on_exception
    assert isinstance(free_port(), int)
    assert_close_loose(torch.ones(3), torch.ones(3) + 5e-4)
    with pytest.raises(AssertionError):
        assert_close_loose(torch.ones(3), torch.ones(3) + 5e-2)


#: ColossalAI's ``colossalai/testing/__init__.py`` ``__all__``.
COLOSSALAI_TESTING = (
    "assert_equal", "assert_not_equal", "assert_close", "assert_close_loose",
    "assert_equal_in_group", "parameterize", "rerun_on_exception", "rerun_if_address_is_in_use",
    "skip_if_not_enough_gpus", "free_port", "spawn", "clear_cache_before_run",
    "run_on_environment_flag", "check_state_dict_equal", "assert_hf_output_close",
    "DummyDataloader",
)  # fmt: skip


def test_every_colossalai_testing_name_imports() -> None:
    """Catches: a name of ColossalAI's colossalai.testing missing (the test's import fails)."""
    import importlib

    testing = importlib.import_module("colossalai.testing")
    missing = [name for name in COLOSSALAI_TESTING if not hasattr(testing, name)]
    assert missing == []
    for path, name in (
        ("colossalai.testing.utils", "DummyDataloader"),
        ("colossalai.testing.pytest_wrapper", "run_on_environment_flag"),
        ("colossalai.testing.comparison", "assert_equal_in_group"),
    ):
        assert getattr(importlib.import_module(path), name) is getattr(testing, name)
