"""Rank-aware helpers for scripts: who is master, printing once, running in turns."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.core.comm import barrier
from colossal.core.launch import get_local_rank

P = ParamSpec("P")
R = TypeVar("R")


class DistCoordinator:
    """Answers rank questions for an initialized job and coordinates simple rank-ordered work.

    Not a singleton: make one where you need it, optionally scoped to a process group.

    Args:
        group: The group "master" refers to by default (the whole job when ``None``).

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, group: ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistCoordinator needs torch.distributed initialized; call "
                "colossal.core.launch(...) or launch_from_torch() first"
            )
        self._group = group
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        local_rank = get_local_rank()
        self._local_rank = self._rank if local_rank is None else local_rank

    @property
    def rank(self) -> int:
        """Global rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Rank on this node, from the launcher used (the global rank when none gave one).

        See :func:`colossal.core.launch.get_local_rank` for the lookup order: the value
        ``launch`` received, then ``LOCAL_RANK``, ``SLURM_LOCALID``,
        ``OMPI_COMM_WORLD_LOCAL_RANK``.
        """
        return self._local_rank

    def _resolve(self, group: ProcessGroup | None) -> ProcessGroup | None:
        return self._group if group is None else group

    def is_master(self, group: ProcessGroup | None = None) -> bool:
        """Whether this process is the lowest rank of ``group`` (default: the coordinator's)."""
        group = self._resolve(group)
        return dist.get_rank(group) == 0 if group is not None else self._rank == 0

    def is_node_master(self) -> bool:
        """Whether this process is local rank 0 on its node."""
        return self._local_rank == 0

    def is_last_process(self, group: ProcessGroup | None = None) -> bool:
        """Whether this process is the highest rank of ``group``."""
        group = self._resolve(group)
        if group is None:
            return self._rank == self._world_size - 1
        return dist.get_rank(group) == dist.get_world_size(group) - 1

    def print_on_master(self, *args: Any, group: ProcessGroup | None = None, **kwargs: Any) -> None:
        """``print`` only on the master of ``group``."""
        if self.is_master(group):
            print(*args, **kwargs)

    def print_on_node_master(self, *args: Any, **kwargs: Any) -> None:
        """``print`` only on local rank 0 of each node."""
        if self.is_node_master():
            print(*args, **kwargs)

    def block_all(self, group: ProcessGroup | None = None) -> None:
        """Barrier over ``group`` (default: the coordinator's)."""
        barrier(self._resolve(group))

    @contextlib.contextmanager
    def priority_execution(
        self, executor_rank: int = 0, group: ProcessGroup | None = None
    ) -> Iterator[bool]:
        """Run the body on ``executor_rank`` first, then on every other rank of ``group``.

        Typical use: one rank downloads or preprocesses, the others then read its result.
        Yields whether this rank is the executor. If the executor's body raises, it still
        enters the barrier the others wait in (so they go on at once instead of waiting for
        the collective timeout) and then re-raises its error.
        """
        group = self._resolve(group)
        rank_in_group = dist.get_rank(group) if group is not None else self._rank
        first = rank_in_group == executor_rank
        if not first:
            barrier(group)
        try:
            yield first
        finally:
            if first:
                barrier(group)

    def on_master_only(
        self, group: ProcessGroup | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
        """Decorator: call the function on the master of ``group`` only (others get ``None``)."""

        def decorator(fn: Callable[P, R]) -> Callable[P, R | None]:
            @functools.wraps(fn)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
                return fn(*args, **kwargs) if self.is_master(group) else None

            return wrapper

        return decorator

    def destroy(self, group: ProcessGroup | None = None) -> None:
        """Destroy ``group`` (the default group, ending the job's communication, when ``None``)."""
        dist.destroy_process_group(group)
