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
