"""Run a function on N gloo processes and fail fast, with the failing rank's traceback."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from colossal.core.launch import destroy, launch

_R = TypeVar("_R")

_PORT_IN_USE_MARKERS = ("EADDRINUSE", "address already in use", "Address already in use")


class DistributedTestError(RuntimeError):
    """A rank raised, died or hung while running a spawned function."""


class _PortInUseError(DistributedTestError):
    pass


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__name__", repr(fn))


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    results: Any,
    comm_timeout: float,
    backend: str,
    launch_group: bool = True,
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    ok = False
    try:
        if launch_group:
            launch(
                rank,
                world_size,
                "127.0.0.1",
                port,
                backend=backend,
                timeout=comm_timeout,
                verbose=False,
            )
            value = fn(rank, world_size, *args, **kwargs)
        else:  # ColossalAI's contract: the function launches with the port itself
            value = fn(rank, *args, world_size=world_size, port=port, **kwargs)
        if dist.is_initialized():
            dist.barrier()
        # Plain pickle: torch's multiprocessing reducers would share tensors through file
        # descriptors that vanish when this process exits before the parent reads them.
        results.put(("ok", rank, pickle.dumps(value)))
        ok = True
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            destroy()  # keeps every group alive to the end: freeing one later cannot deadlock
        except Exception:  # noqa: BLE001 - the job is over either way
            pass
    if not ok:
        # os._exit skips the queue's feeder thread: flush the report first.
        results.close()
        results.join_thread()
        os._exit(1)


PRELOAD_ENV = "COLOSSAL_TEST_PRELOAD"
"""Comma-separated modules the fork server also imports before forking the ranks (e.g. the
plugins and ``transformers.models.gpt2.modeling_gpt2``: seconds per rank otherwise). Read
when the fork server starts; a module that is not installed is skipped."""


def _context() -> mp.context.SpawnContext | mp.context.ForkServerContext:
    """A fork server with torch preloaded: clean processes without re-importing torch each time."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # symbolic_shapes is imported lazily (and slowly) by the first backward with explicit
    # gradients.
    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "colossal.core"]
        + extra
    )
    return ctx


def _terminate(procs: Sequence[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _spawn_once(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    timeout: float,
    comm_timeout: float,
    backend: str,
    launch_group: bool = True,
) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                fn,
                tuple(args),
                dict(kwargs),
                results,
                comm_timeout,
                backend,
                launch_group,
            ),
            name=f"colossal-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                kind, rank, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                _check_dead(procs, values, results)
                if time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in values]
                    raise DistributedTestError(
                        f"{_name(fn)} timed out after {timeout:.0f} s at world size "
                        f"{world_size}; ranks {waiting} had not finished"
                    ) from None
                continue
            if kind == "error":
                exc = (
                    _PortInUseError
                    if any(m in payload for m in _PORT_IN_USE_MARKERS)
                    else DistributedTestError
                )
                raise exc(f"rank {rank} of {world_size} failed in {_name(fn)}:\n{payload}")
            values[rank] = pickle.loads(payload)
    finally:
        _terminate(procs)
        results.close()
    return [values[r] for r in range(world_size)]


def _check_dead(
    procs: Sequence[mp.process.BaseProcess], values: dict[int, Any], results: Any
) -> None:
    for rank, p in enumerate(procs):
        if rank in values or p.exitcode is None or p.exitcode == 0:
            continue
        # Its report may still be in flight: give the queue a moment before blaming the exit.
        try:
            kind, r, payload = results.get(timeout=1.0)
        except queue_mod.Empty:
            code = p.exitcode
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            raise DistributedTestError(
                f"rank {rank} of {len(procs)} died ({how}) without reporting an error"
            ) from None
        results.put((kind, r, payload))
        return


def spawn(
    fn: Callable[..., _R],
    world_size: int,
    args: Sequence[object] = (),
    kwargs: Mapping[str, object] | None = None,
    *,
    timeout: float = 300.0,
    comm_timeout: float = 120.0,
    backend: str = "gloo",
) -> list[_R]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh processes.

    Each process gets ``torch.set_num_threads(1)``, the torchrun environment variables and a
    default process group (``launch`` on a free localhost port). When one rank raises or dies,
    the others are stopped at once and the failing rank's traceback is raised here. A port
    that turned out to be taken is retried once on another port.

    Args:
        fn: A module-level (picklable) function.
        world_size: Number of processes.
        args: Extra positional arguments for ``fn`` (picklable).
        kwargs: Extra keyword arguments for ``fn`` (picklable).
        timeout: Seconds the whole run may take before it is stopped and reported.
        comm_timeout: Timeout of every collective inside the run.
        backend: torch.distributed backend.

    Returns:
        ``fn``'s return value on each rank, in rank order (values must be picklable).

    Raises:
        DistributedTestError: A rank raised (its traceback is in the message), died, or the
            run exceeded ``timeout``.
        ValueError: ``world_size`` is not a positive int.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    kwargs = kwargs or {}
    try:
        return _spawn_once(fn, world_size, args, kwargs, timeout, comm_timeout, backend)
    except _PortInUseError:
        return _spawn_once(fn, world_size, args, kwargs, timeout, comm_timeout, backend)


def spawn_with_port(
    func: Callable[..., _R],
    nprocs: int = 1,
    *,
    timeout: float = 300.0,
    **kwargs: object,
) -> list[_R]:
    """ColossalAI's ``spawn``: ``func(rank, world_size=nprocs, port=port, **kwargs)`` per rank.

    Unlike :func:`spawn`, nothing is launched first: ``func`` receives a free localhost port
    and starts the job itself, as ColossalAI's tests do::

        def run_dist(rank, world_size, port):
            colossalai.launch(rank=rank, world_size=world_size, host="localhost", port=port,
                              backend="gloo")
            ...

        spawn_with_port(run_dist, 2)

    Every process gets ``torch.set_num_threads(1)`` and the torchrun environment variables
    (``MASTER_PORT`` is the same port). A rank that raises, dies or hangs stops the run at
    once and its traceback is raised here; a port taken between choosing and binding it is
    retried once on another port (and :func:`rerun_if_address_is_in_use` retries the caller).

    Args:
        func: A module-level (picklable) function taking ``rank`` first and the keywords
            ``world_size`` and ``port``.
        nprocs: Number of processes.
        timeout: Seconds the whole run may take.
        **kwargs: More keyword arguments for ``func`` (picklable).

    Returns:
        ``func``'s return value on each rank, in rank order (ColossalAI's returns None).

    Raises:
        DistributedTestError: A rank raised (its traceback is in the message), died, or the
            run exceeded ``timeout``.
        ValueError: ``nprocs`` is not a positive int.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    run = (func, nprocs, (), kwargs, timeout, timeout, "gloo", False)
    try:
        return _spawn_once(*run)
    except _PortInUseError:
        return _spawn_once(*run)
