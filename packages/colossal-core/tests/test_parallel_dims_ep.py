"""ParallelDims' expert axes: ``ep`` x ``moe_dp`` inside dp, their rank layout and groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from colossal.core import ParallelDims
from colossal.core.comm import all_reduce
from colossal.core.testing import distributed_test


def test_ep_must_divide_dp_and_the_error_names_the_sizes() -> None:
    """Catches: a silent floor division (moe_dp = dp // ep) when ep does not divide dp."""
    with pytest.raises(ValueError) as err:
        ParallelDims(dp=-1, pp=2, ep=4, world_size=12)  # dp = 6
    msg = str(err.value)
    for part in ("ep=4", "dp=6", "world 12", "pp=2", "[1, 2, 3, 6]"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="ep=0"):
        ParallelDims(ep=0, world_size=4)


def test_sizes_and_unchanged_defaults() -> None:
    """Catches: moe_dp not dp / ep; ep changing the dense layout or the mesh."""
    plain = ParallelDims(dp=4, tp=2, world_size=8)
    dims = ParallelDims(dp=4, tp=2, ep=2, world_size=8)
    assert (dims.ep, dims.moe_dp, dims.size("ep"), dims.size("moe_dp")) == (2, 2, 2, 2)
    assert dims.ep_enabled and not plain.ep_enabled and plain.moe_dp == 4
    assert dims.mesh_shape == plain.mesh_shape and dims.mesh_axes == plain.mesh_axes
    for r in range(8):
        assert dims.ranks("dp", r) == plain.ranks("dp", r)
    with pytest.raises(ValueError, match="asked alone"):
        dims.size(("ep", "tp"))


# world 8, tp 2 (tp inner): dp groups {0,2,4,6} and {1,3,5,7}
EP_INNER = {0: [0, 2], 2: [0, 2], 4: [4, 6], 6: [4, 6], 1: [1, 3], 3: [1, 3], 5: [5, 7], 7: [5, 7]}
MOE_DP_OUTER = {0: [0, 4], 4: [0, 4], 2: [2, 6], 6: [2, 6], 1: [1, 5], 5: [1, 5], 3: [3, 7]}


def test_rank_layout_at_world_8_both_orders() -> None:
    """Catches: ep ranks not consecutive within dp (moe_dp_outside=True, ColossalAI's default),
    the option ignored, or groups crossing dp groups."""
    dims = ParallelDims(dp=4, tp=2, ep=2, world_size=8)
    for r in range(8):
        assert dims.ranks("ep", r) == EP_INNER[r], r
        if r in MOE_DP_OUTER:
            assert dims.ranks("moe_dp", r) == MOE_DP_OUTER[r], r
        assert dims.coordinate("ep", r) == EP_INNER[r].index(r)
    flipped = ParallelDims(dp=4, tp=2, ep=2, world_size=8, moe_dp_outside=False)
    for r in range(8):
        assert flipped.ranks("moe_dp", r) == EP_INNER[r], r  # now moe_dp is consecutive
        if r in MOE_DP_OUTER:
            assert flipped.ranks("ep", r) == MOE_DP_OUTER[r], r
    assert sorted(map(tuple, dims.expert_rank_groups("ep"))) == sorted(
        {tuple(v) for v in EP_INNER.values()}
    )


def _members_and_sum(group: dist.ProcessGroup) -> tuple[list[int], int]:
    t = torch.tensor([float(dist.get_rank())])
    all_reduce(t, group=group)
    return dist.get_process_group_ranks(group), int(t.item())


@distributed_test(4)
def test_expert_groups_at_world_4(rank: int, world_size: int) -> None:
    """Catches: groups whose members or communication differ from ranks(); dist rank in the
    group not equal to coordinate(); ep == dp not reusing the whole job."""
    torch.set_num_threads(1)
    for outside in (True, False):
        dims = ParallelDims(ep=2, moe_dp_outside=outside)
        for name in ("ep", "moe_dp"):
            members, total = _members_and_sum(dims.group(name))
            assert members == dims.ranks(name) and total == sum(members), (outside, name)
            assert dist.get_rank(dims.group(name)) == dims.coordinate(name)
        dims.destroy()
    whole = ParallelDims(ep=4)
    assert whole.group("ep") is dist.group.WORLD
    assert _members_and_sum(whole.group("moe_dp"))[0] == [rank]
    dims = ParallelDims(dp=2, tp=2, ep=2)  # ep == dp: the ep group is the dp group
    assert _members_and_sum(dims.group("ep"))[0] == dims.ranks("dp")
    dims.destroy()
