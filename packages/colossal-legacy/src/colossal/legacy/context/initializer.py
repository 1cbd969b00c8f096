"""ProcessGroupInitializer: how a custom parallel mode creates its process groups.

A custom mode ("Add Your Own Parallel Mode"): subclass :class:`ProcessGroupInitializer`,
register it with ``@DIST_GROUP_INITIALIZER.register_module``, map the mode to it in
``colossal.legacy.constants.INITIALIZER_MAPPING`` and name the mode in the config
(``parallel=dict(tensor=dict(size=x, mode='new_mode', arg1=...))``). At launch the context
builds the initializer with the six fixed arguments plus the config's extra keys and calls
:meth:`ProcessGroupInitializer.init_dist_group` on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.legacy.config import Config

__all__ = ["GroupInfo", "GroupTuple", "InitializedGroups", "ProcessGroupInitializer", "new_groups"]


@dataclass(frozen=True)
class GroupInfo:
    """This rank's group of one parallel mode.

    Attributes:
        local_rank: This rank's index in the group.
        world_size: Ranks in the group.
        group: The process group.
        cpu_group: A gloo group over the same ranks (the same group on a gloo job).
        ranks: Global ranks of the group, in group order.
        mode: The parallel mode (a :class:`ParallelMode` or a custom mode's name).
    """

    local_rank: int
    world_size: int
    group: ProcessGroup
    cpu_group: ProcessGroup
    ranks: tuple[int, ...]
    mode: object


#: ColossalAI's form of a :class:`GroupInfo`: ``(local_rank, world_size, group, cpu_group,
#: ranks, mode)``.
GroupTuple: TypeAlias = tuple[int, int, ProcessGroup, ProcessGroup, tuple[int, ...], object]
#: What :meth:`ProcessGroupInitializer.init_dist_group` returns: this rank's group (None when
#: the rank is in none of the mode's groups), or a list of them.
InitializedGroups: TypeAlias = (
    GroupInfo | GroupTuple | None | list[GroupInfo] | list[GroupInfo | GroupTuple | None]
)


def new_groups(rank_lists: Sequence[Sequence[int]], mode: object) -> GroupInfo | None:
    """Create one group per rank list (collective: every rank passes the same lists).

    Returns:
        This rank's group, or ``None`` when no list holds this rank.
    """
    mine: GroupInfo | None = None
    rank = dist.get_rank()
    gloo = dist.get_backend() == "gloo"
    for ranks in rank_lists:
        ranks = tuple(int(r) for r in ranks)
        group = dist.new_group(list(ranks))
        cpu_group = group if gloo else dist.new_group(list(ranks), backend="gloo")
        if rank in ranks:
            mine = GroupInfo(ranks.index(rank), len(ranks), group, cpu_group, ranks, mode)
    return mine


class ProcessGroupInitializer:
    """Base class of a custom parallel mode's group creation.

    Args:
        rank: Global rank.
        world_size: Ranks in the job.
        config: The job's config.
        data_parallel_size: Data-parallel size.
        pipeline_parallel_size: Pipeline stages.
        tensor_parallel_size: Tensor-parallel size (the custom mode's ``size``).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        config: Config,
        data_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.data_parallel_size = data_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.tensor_parallel_size = tensor_parallel_size

    def init_dist_group(self) -> InitializedGroups:
        """Create the mode's groups; return this rank's :class:`GroupInfo` (or a list of them).

        ColossalAI's tuple ``(local_rank, world_size, group, cpu_group, ranks, mode)`` is
        accepted too. The default calls :meth:`init_parallel_groups`, the name the seeds'
        example overrides.
        """
        return self.init_parallel_groups()

    def init_parallel_groups(self) -> InitializedGroups:
        """Override this (or :meth:`init_dist_group`) to create the groups."""
        raise NotImplementedError(
            f"{type(self).__name__} must override init_dist_group() (or "
            "init_parallel_groups()) to create its process groups, e.g. with "
            "colossal.legacy.context.new_groups([[0, 1], [2, 3]], mode='new_mode')"
        )
