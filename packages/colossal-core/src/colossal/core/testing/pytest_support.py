"""A decorator that turns ``fn(rank, world_size, ...)`` into parametrized pytest tests."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

from colossal.core.testing.spawn import spawn


def distributed_test(
    *world_sizes: int, timeout: float = 300.0, comm_timeout: float = 120.0
) -> Callable[[Callable[..., object]], Callable[..., None]]:
    """Make a per-rank function a pytest test run once per world size in spawned processes.

    The decorated function takes ``rank, world_size`` and then any pytest parameters or
    fixtures (they are forwarded to every rank, so they must be picklable)::

        @pytest.mark.parametrize("stage", [1, 2])
        @distributed_test(1, 2, 4)
        def test_zero(rank, world_size, stage):
            ...

    Each (world size, parameter) combination is a separate test case with its own id
    (``world2-...``). The original function stays importable under a hidden module attribute
    so spawned processes can unpickle it.

    Args:
        *world_sizes: World sizes to run (at least one).
        timeout: Seconds each case may take.
        comm_timeout: Timeout of every collective in the case.
    """
    if not world_sizes or any(not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"distributed_test needs positive int world sizes, got {world_sizes}")

    def decorator(fn: Callable[..., object]) -> Callable[..., None]:
        import pytest

        params = list(inspect.signature(fn).parameters.values())
        if [p.name for p in params[:2]] != ["rank", "world_size"]:
            raise TypeError(
                f"{fn.__name__} must take (rank, world_size, ...) as its first arguments"
            )
        module = sys.modules[fn.__module__]
        hidden = f"_distributed_impl_{fn.__name__}"
        test_name, test_qualname = fn.__name__, fn.__qualname__
        fn.__name__ = fn.__qualname__ = hidden
        setattr(module, hidden, fn)

        def test(world_size: int, **kwargs: Any) -> None:
            spawn(fn, world_size, kwargs=kwargs, timeout=timeout, comm_timeout=comm_timeout)

        test.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("world_size", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
            + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[2:]]
        )
        test.__name__, test.__qualname__ = test_name, test_qualname
        test.__module__, test.__doc__ = fn.__module__, fn.__doc__
        ids = [f"world{w}" for w in world_sizes]
        return pytest.mark.parametrize("world_size", list(world_sizes), ids=ids)(test)

    return decorator
