"""PipelineSharedModuleWrapper: one parameter held by several pipeline stages (tied weights).

The seeds' GPT example shares the word embedding of the first stage with the output head of
the last: ``wrapper = PipelineSharedModuleWrapper([0, pipeline_size - 1])``, then
``wrapper.register_module(embedding)`` on the first stage and ``wrapper.register_module(head)``
on the last. Registering broadcasts the copy of the lowest stage so all copies start equal,
tags each parameter with the group of its copies (``pipeline_shared_module_pg``, which the
``PipelineSharedModuleGradientHandler`` sums gradients over) and marks it replicated over
that group, so the one gradient norm counts it once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import Owned, Placement, Replicate, mark_sharded, shard_spec, whole_shape
from colossal.legacy.context.initializer import new_groups
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode

__all__ = [
    "SHARED_GROUP_ATTR",
    "PipelineSharedModuleWrapper",
    "mark_stage_parameters",
    "shared_parameters",
]

#: The attribute (ColossalAI's name) holding the group of a shared parameter's copies.
SHARED_GROUP_ATTR = "pipeline_shared_module_pg"


class PipelineSharedModuleWrapper:
    """Tie parameters across the given pipeline stages.

    Creating it is collective (every rank builds the same groups): one group per position of
    the other axes, holding that position's ranks on ``pipeline_ranks``.

    Args:
        pipeline_ranks: Pipeline stage indices that hold a copy (e.g. ``[0, stages - 1]``).

    Raises:
        ValueError: Fewer than two stages, or a stage outside the pipeline.
    """

    def __init__(self, pipeline_ranks: Sequence[int]) -> None:
        stages = gpc.pipeline_parallel_size
        wanted = sorted(set(int(r) for r in pipeline_ranks))
        if len(wanted) < 2 or wanted[0] < 0 or wanted[-1] >= stages:
            raise ValueError(
                f"pipeline_ranks={list(pipeline_ranks)} must name at least two stages of the "
                f"{stages}-stage pipeline (0..{stages - 1})"
            )
        self.pipeline_ranks = wanted
        dims = gpc.dims
        every = sorted(
            {tuple(dims.ranks("pp", r)[s] for s in wanted) for r in range(dims.world_size or 1)}
        )
        info = new_groups([list(g) for g in every], "pipeline_shared")
        self.group: ProcessGroup | None = info.group if info is not None else None
        self.ranks: tuple[int, ...] = info.ranks if info is not None else ()

    def register_parameter(self, param: torch.Tensor) -> None:
        """Tie ``param`` (this stage's copy) to the other stages' copies.

        Raises:
            RuntimeError: This rank's stage is not one of ``pipeline_ranks``.
        """
        if self.group is None:
            raise RuntimeError(
                f"this rank's pipeline stage is not in pipeline_ranks={self.pipeline_ranks}; "
                "register only on the stages that hold a copy"
            )
        with torch.no_grad():
            dist.broadcast(param.data, src=self.ranks[0], group=self.group)
        setattr(param, SHARED_GROUP_ATTR, self.group)
        spec = shard_spec(param)
        own = tuple(p for p in spec.placements if p.axis != "pp") if spec is not None else ()
        mark_sharded(param, (Placement("pp", Replicate(), self.group), *own), whole_shape(param))

    def register_module(self, module: nn.Module) -> None:
        """Tie every parameter of ``module``."""
        for param in module.parameters():
            self.register_parameter(param)


def shared_parameters(model: nn.Module) -> list[tuple[torch.Tensor, ProcessGroup]]:
    """The tied parameters of ``model`` with the group of their copies."""
    return [
        (p, getattr(p, SHARED_GROUP_ATTR))
        for p in model.parameters()
        if getattr(p, SHARED_GROUP_ATTR, None) is not None
    ]


def mark_stage_parameters(model: nn.Module) -> int:
    """Mark this stage's own parameters as held by this stage only (for the gradient norm).

    Under a pipeline every stage holds different parameters, so the one gradient norm must
    add every stage's share; tied parameters (registered with a
    :class:`PipelineSharedModuleWrapper`) keep their mark and count once. Without a pipeline
    nothing is marked.

    Returns:
        How many parameters were marked.
    """
    if not gpc.is_initialized(ParallelMode.PIPELINE):
        return 0
    group = gpc.get_group(ParallelMode.PIPELINE)
    stage = gpc.get_local_rank(ParallelMode.PIPELINE)
    marked = 0
    for param in model.parameters():
        spec = shard_spec(param)
        placements = spec.placements if spec is not None else ()
        if any(p.axis == "pp" for p in placements):
            continue
        along = Placement("pp", Owned(stage), group)
        mark_sharded(param, (along, *placements), whole_shape(param))
        marked += 1
    return marked
