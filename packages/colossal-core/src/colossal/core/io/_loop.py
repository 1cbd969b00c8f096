"""A background thread running an asyncio event loop, drained before the interpreter exits."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LIVE: weakref.WeakSet[EventLoopThread] = weakref.WeakSet()
_EXIT_HOOK_LOCK = threading.Lock()
_exit_hook_registered = False


class EventLoopThread:
    """Owns an event loop running in a daemon thread and runs coroutines on it.

    Pending work is finished (not dropped) when the object is closed, garbage collected, or the
    interpreter exits normally. Not usable in a child process forked after its creation.

    Args:
        name: Thread name, shown in debuggers and logs.
        max_workers: Threads of the loop's executor, which runs the blocking file calls.
    """

    def __init__(self, name: str, max_workers: int = 2) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._name = name
        self._pid = os.getpid()
        self._closed = False
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"{name}-io")
        )
        self._thread = threading.Thread(target=_run_loop, args=(self.loop,), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, _request_stop, self.loop, False)
        _register_exit_hook()
        _LIVE.add(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check_usable(self) -> None:
        """Raise ``RuntimeError`` if :meth:`submit` would refuse work."""
        problem = self._unusable_reason()
        if problem is not None:
            raise RuntimeError(f"{self._name}: {problem}")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future of its result.

        Raises:
            RuntimeError: The thread was closed, or this process was forked after its creation.
        """
        with self._lock:
            problem = self._unusable_reason()
            if problem is not None:
                coro.close()
                raise RuntimeError(f"{self._name}: {problem}")
            return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, wait: bool = True) -> None:
        """Stop the loop thread.

        Args:
            wait: Finish pending work first (``True``) or cancel it (``False``; cancelled writes
                remove their temporary files).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _LIVE.discard(self)
        if self._pid != os.getpid():
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self._name}: close() cannot be called from its own loop")
        _request_stop(self.loop, not wait)
        self._thread.join()

    def _unusable_reason(self) -> str | None:
        if self._closed:
            return "already closed"
        if self._pid != os.getpid():
            return "created in a parent process before fork(); create a new one in the child"
        return None


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


async def _drain_and_stop(cancel: bool) -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    if cancel:
        for task in tasks:
            task.cancel()
    elif tasks:
        logger.debug("finishing %d pending IO task(s) before stopping", len(tasks))
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()


def _request_stop(loop: asyncio.AbstractEventLoop, cancel: bool) -> None:
    if loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # the loop closed in the meantime
        asyncio.run_coroutine_threadsafe(_drain_and_stop(cancel), loop)


def _drain_at_exit() -> None:
    for loop_thread in list(_LIVE):
        if loop_thread._pid == os.getpid():
            loop_thread.close(wait=True)


def _register_exit_hook() -> None:
    """Drain pending writes at interpreter exit, before executors refuse new work.

    ``threading._register_atexit`` hooks run before ``concurrent.futures`` shuts its executors
    down (plain ``atexit`` hooks run after, when pending file writes could no longer run).
    """
    global _exit_hook_registered
    with _EXIT_HOOK_LOCK:
        if _exit_hook_registered:
            return
        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("threading._register_atexit is unavailable")
            register(_drain_at_exit)
        except RuntimeError:
            import atexit

            atexit.register(_drain_at_exit)
        _exit_hook_registered = True
