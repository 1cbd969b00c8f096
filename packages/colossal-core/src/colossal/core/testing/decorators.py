"""ColossalAI's test decorators: parameterize, rerun on an error, clear the cache first."""

from __future__ import annotations

import functools
import gc
import re
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

import torch.multiprocessing

from colossal.core.accelerator import get_accelerator

__all__ = [
    "ADDRESS_IN_USE_PATTERN",
    "clear_cache_before_run",
    "parameterize",
    "rerun_if_address_is_in_use",
    "rerun_on_exception",
    "run_on_environment_flag",
    "skip_if_not_enough_gpus",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_F = TypeVar("_F", bound=Callable[..., object])

#: A line of an error message that says a port was taken (gloo, nccl and the OS spell it so).
ADDRESS_IN_USE_PATTERN = r".*(Address already in use|address already in use|EADDRINUSE).*"


def parameterize(
    argument: str, values: Iterable[object]
) -> Callable[[Callable[..., object]], Callable[..., None]]:
    """Call the decorated function once per value of ``argument`` (ColossalAI's decorator).

    Like ``pytest.mark.parametrize`` but inside one process, so a distributed test launches
    its group once and runs every case in it. Stacked decorators run the cartesian product,
    the outer decorator's values in the outer loop::

        @parameterize("stage", [1, 2])
        @parameterize("dtype", [torch.float32, torch.bfloat16])
        def check(stage, dtype, world_size): ...

        check(world_size=2)   # (1, fp32), (1, bf16), (2, fp32), (2, bf16)

    The other arguments are passed through (ColossalAI requires them as keywords). The
    wrapper returns None.

    Raises:
        TypeError: ``argument`` is not a string or ``values`` is a string.
        ValueError: ``values`` is empty.
    """
    if not isinstance(argument, str) or not argument:
        raise TypeError(f"parameterize: argument must be a parameter name, got {argument!r}")
    if isinstance(values, (str, bytes)):
        raise TypeError(f"parameterize: values must be a list of values, got the string {values!r}")
    cases = list(values)
    if not cases:
        raise ValueError(f"parameterize: no values given for {argument!r}; pass at least one")

    def decorator(func: Callable[..., object]) -> Callable[..., None]:
        def run_each(*args: object, **kwargs: object) -> None:
            for value in cases:
                func(*args, **{**kwargs, argument: value})

        # No __wrapped__: pytest must see (**kwargs), not the parameterized names as fixtures.
        run_each.__name__ = getattr(func, "__name__", "parameterized")
        run_each.__qualname__ = getattr(func, "__qualname__", run_each.__name__)
        run_each.__doc__ = func.__doc__
        run_each.__module__ = func.__module__
        return run_each

    return decorator


def _matches(error: BaseException, pattern: str | None) -> bool:
    if pattern is None:
        return True
    return any(re.match(pattern, line) for line in str(error).split("\n"))


def rerun_on_exception(
    exception_type: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    pattern: str | None = None,
    max_try: int | None = 5,
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Run the function again when it raises ``exception_type`` (ColossalAI's decorator).

    Args:
        exception_type: The exception class (or classes) that cause a rerun.
        pattern: Rerun only when a line of the message matches this regular expression
            (``re.match``); None reruns on any message.
        max_try: Attempts in all (the last error is raised after them); None tries forever.

    Raises:
        TypeError: ``max_try`` is neither None nor a positive int (``ValueError`` for < 1),
            or ``exception_type`` is not an exception class.
    """
    if max_try is not None and (not isinstance(max_try, int) or isinstance(max_try, bool)):
        raise TypeError(f"rerun_on_exception: max_try must be None or an int, got {max_try!r}")
    if max_try is not None and max_try < 1:
        raise ValueError(f"rerun_on_exception: max_try must be >= 1 (or None), got {max_try}")
    types = exception_type if isinstance(exception_type, tuple) else (exception_type,)
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in types):
        raise TypeError(
            f"rerun_on_exception: exception_type must be an exception class, got {exception_type!r}"
        )
    if pattern is not None:
        re.compile(pattern)  # a bad pattern fails here, not at the first error

    def decorator(func: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(func)  # keeps the signature: pytest.mark.parametrize still works
        def run_until_success(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            attempt = 0
            while True:
                attempt += 1
                try:
                    return func(*args, **kwargs)
                except types as error:
                    if (max_try is not None and attempt >= max_try) or not _matches(error, pattern):
                        raise

        return run_until_success

    return decorator


def rerun_if_address_is_in_use() -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Rerun (up to 5 attempts) when a spawned run failed because its port was taken.

    Matches the errors of :func:`~colossal.core.testing.spawn_with_port` and
    :func:`~colossal.core.testing.spawn` (a ``RuntimeError`` carrying the rank's traceback)
    and torch's ``ProcessRaisedException``, when a line says "Address already in use"; every
    other error is raised at once.
    """
    errors = (RuntimeError, torch.multiprocessing.ProcessRaisedException)
    return rerun_on_exception(exception_type=errors, pattern=ADDRESS_IN_USE_PATTERN)


def clear_cache_before_run() -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Free cached device memory, reset the peak counters and collect garbage first.

    On the accelerator of this process (:func:`~colossal.core.accelerator.get_accelerator`):
    ``empty_cache``, ``reset_peak_memory_stats``, ``synchronize``, then ``gc.collect()``, so
    the function's ``max_memory_allocated`` measures only itself.
    """

    def decorator(func: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.wraps(func)
        def cleared(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            gc.collect()
            accelerator = get_accelerator()
            accelerator.empty_cache()
            accelerator.synchronize()
            accelerator.reset_peak_memory_stats()
            return func(*args, **kwargs)

        return cleared

    return decorator


def skip_if_not_enough_gpus(min_gpus: int) -> Callable[[Callable[_P, None]], Callable[_P, None]]:
    """Run the function only where at least ``min_gpus`` CUDA devices are visible.

    ColossalAI's decorator (a silent no-op otherwise). On the CPU accelerator the function
    always runs: its processes share the host instead of each taking a GPU.

    Raises:
        ValueError: ``min_gpus`` is not a positive int.
    """
    if not isinstance(min_gpus, int) or min_gpus < 1:
        raise ValueError(f"skip_if_not_enough_gpus: min_gpus must be an int >= 1, got {min_gpus!r}")

    def decorator(func: Callable[_P, None]) -> Callable[_P, None]:
        @functools.wraps(func)
        def maybe(*args: _P.args, **kwargs: _P.kwargs) -> None:
            accelerator = get_accelerator()
            if accelerator.name == "cpu" or accelerator.device_count() >= min_gpus:
                func(*args, **kwargs)

        return maybe

    return decorator


def run_on_environment_flag(name: str) -> Callable[[_F], _F]:
    """Skip a pytest test unless the environment variable ``name`` (upper-cased) is ``1``.

    ColossalAI's marker for slow or hardware-specific tests.
    """
    import os

    import pytest

    if not isinstance(name, str) or not name:
        raise TypeError(f"run_on_environment_flag: name must be a variable name, got {name!r}")
    flag = os.environ.get(name.upper(), "0")
    marker = pytest.mark.skipif(flag != "1", reason=f"environment variable {name.upper()}={flag}")
    return marker
