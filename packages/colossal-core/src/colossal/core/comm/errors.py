"""Errors that say which rank and which collective failed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


class CommError(RuntimeError):
    """A collective or point-to-point operation failed or timed out on this rank."""


def _rank() -> int:
    try:
        return dist.get_rank()
    except (RuntimeError, ValueError):
        return -1


@contextlib.contextmanager
def comm_guard(kind: str, group_ranks: tuple[int, ...]) -> Iterator[None]:
    """Re-raise a backend failure as :class:`CommError` naming the rank, collective and group."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as exc:  # DistBackendError and timeouts are RuntimeErrors
        raise CommError(
            f"rank {_rank()}: {kind} on group {list(group_ranks)} failed: {exc}. "
            f"A peer has probably died, timed out, or is not calling the same {kind}; "
            "check the other ranks' output."
        ) from exc


def require_initialized() -> None:
    """Raise a clear error when torch.distributed has not been set up."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized; call colossal.core.launch(...) or "
            "colossal.core.launch_from_torch() (under torchrun / colossal run) first"
        )
