"""ZeRO over two data-parallel groups at once (ColossalAI's ``extra_dp_group``).

ColossalAI shards over ``dp_process_group x extra_dp_group`` (an intra-node and an inter-node
data-parallel axis). Sharding over the product is sharding over one group holding all of its
ranks, so this builds that group: collective over the whole job, every rank creating every
such group in one agreed order (``torch.distributed.new_group``'s contract).
"""

from __future__ import annotations

import torch.distributed as dist

from colossal.core.comm import group_ranks

__all__ = ["combine_dp_groups"]


def combine_dp_groups(
    dp_group: dist.ProcessGroup | None, extra_dp_group: dist.ProcessGroup
) -> dist.ProcessGroup:
    """The group of every rank in ``dp_group`` x ``extra_dp_group`` (collective over the job).

    Raises:
        ValueError: The two groups are not two axes of one grid (the product's ranks are not
            ``len(dp) * len(extra)`` distinct ranks, e.g. the groups overlap).
    """
    dp = group_ranks(dp_group)
    extra = group_ranks(extra_dp_group)
    gathered: list[tuple[int, ...] | None] = [None] * len(extra)
    dist.all_gather_object(gathered, tuple(dp), group=extra_dp_group)
    mine = tuple(sorted({r for ranks in gathered if ranks is not None for r in ranks}))
    if len(mine) != len(dp) * len(extra):
        raise ValueError(
            f"extra_dp_group {list(extra)} and dp_process_group {list(dp)} are not two axes of "
            f"one grid (their product holds {len(mine)} distinct ranks, not "
            f"{len(dp)} x {len(extra)}); pass the inter-node group as extra_dp_group and the "
            "intra-node one as dp_process_group, e.g. two axes of one ProcessGroupMesh"
        )
    everyone: list[tuple[int, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    combined: dist.ProcessGroup | None = None
    for ranks in sorted({r for r in everyone if r is not None}):
        group = dist.new_group(list(ranks))
        if ranks == mine:
            combined = group
    assert combined is not None
    return combined
