"""ColossalAI functions whose Colossal counterpart has another shape (thin adapters only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from colossal.core import DistCoordinator

__all__ = ["priority_execution"]


@contextlib.contextmanager
def priority_execution(executor_rank: int = 0) -> Iterator[bool]:
    """Run the body on ``executor_rank`` first, then on the other ranks of the job.

    ColossalAI's module-level ``colossalai.cluster.dist_coordinator.priority_execution``;
    Colossal's is the method :meth:`colossal.core.DistCoordinator.priority_execution`. Yields
    whether this rank is the executor.
    """
    with DistCoordinator().priority_execution(executor_rank) as first:
        yield first
