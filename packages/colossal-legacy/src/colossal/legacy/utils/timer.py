"""``Timer`` and ``MultiTimer`` (ColossalAI's ``colossalai.utils.timer``): named stopwatches.

The clock waits for the accelerator's queued work first (a no-op on CPU), so a stopped timer
covers the device time of what ran between ``start`` and ``stop``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from colossal.core import get_accelerator

__all__ = ["MultiTimer", "Timer"]


def _synchronized_clock() -> float:
    get_accelerator().synchronize()
    return time.perf_counter()


class Timer:
    """A stopwatch that adds up its intervals and can keep each one in a history.

    Args:
        clock: Seconds as a float; by default ``time.perf_counter`` after synchronizing the
            accelerator.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or _synchronized_clock
        self._started = False
        self._start_time = 0.0
        self._elapsed = 0.0
        self._history: list[float] = []

    @property
    def has_history(self) -> bool:
        """Whether an interval was kept in the history since the last reset."""
        return bool(self._history)

    @property
    def is_started(self) -> bool:
        """Whether the timer is running."""
        return self._started

    @property
    def current_time(self) -> float:
        """The clock now."""
        return self._clock()

    def start(self) -> None:
        """Start an interval (restarting it if the timer runs already)."""
        self._start_time = self._clock()
        self._started = True

    def lap(self) -> float:
        """Seconds since :meth:`start`, without stopping."""
        if not self._started:
            raise RuntimeError("Timer.lap: the timer is not running; call start() first")
        return self._clock() - self._start_time

    def stop(self, keep_in_history: bool = False) -> float:
        """End the interval, add it to the elapsed time and return its length in seconds.

        Args:
            keep_in_history: Also append the interval to the history.

        Raises:
            RuntimeError: The timer is not running.
        """
        if not self._started:
            raise RuntimeError("Timer.stop: the timer is not running; call start() first")
        interval = self._clock() - self._start_time
        self._elapsed += interval
        self._started = False
        if keep_in_history:
            self._history.append(interval)
        return interval

    def get_elapsed_time(self) -> float:
        """Seconds of all stopped intervals since the last reset.

        Raises:
            RuntimeError: The timer is running (stop it first).
        """
        if self._started:
            raise RuntimeError("Timer.get_elapsed_time: stop the timer first")
        return self._elapsed

    def get_history(self) -> list[float]:
        """The kept intervals, oldest first."""
        return list(self._history)

    def get_history_sum(self) -> float:
        """Sum of the kept intervals."""
        return sum(self._history)

    def get_history_mean(self) -> float:
        """Mean of the kept intervals.

        Raises:
            RuntimeError: No interval was kept.
        """
        if not self._history:
            raise RuntimeError("Timer.get_history_mean: no interval was kept in the history")
        return sum(self._history) / len(self._history)

    def reset(self) -> None:
        """Stop, and forget the elapsed time and the history."""
        self._started = False
        self._elapsed = 0.0
        self._history = []


class MultiTimer:
    """Timers by name, created at their first ``start``.

    Args:
        on: False makes every call a no-op (``stop`` returns None).
        clock: The clock of the timers it creates (see :class:`Timer`).
    """

    def __init__(self, on: bool = True, clock: Callable[[], float] | None = None) -> None:
        self._on = on
        self._clock = clock
        self._timers: dict[str, Timer] = {}

    def start(self, name: str) -> None:
        """Start the timer ``name``, creating it if needed."""
        if not self._on:
            return
        if name not in self._timers:
            self._timers[name] = Timer(self._clock)
        self._timers[name].start()

    def stop(self, name: str, keep_in_history: bool = False) -> float | None:
        """Stop the timer ``name`` and return the interval (None when the timers are off).

        Raises:
            KeyError: No timer ``name`` was started.
        """
        if not self._on:
            return None
        return self.get_timer(name).stop(keep_in_history)

    def get_timer(self, name: str) -> Timer:
        """The timer ``name``.

        Raises:
            KeyError: No timer ``name`` was started (the message lists the timers).
        """
        if name not in self._timers:
            raise KeyError(f"no timer {name!r}; started timers: {sorted(self._timers)}")
        return self._timers[name]

    def has(self, name: str) -> bool:
        """Whether a timer ``name`` exists."""
        return name in self._timers

    def reset(self, name: str | None = None) -> None:
        """Reset the timer ``name``, or every timer when None (an unknown name is ignored)."""
        if not self._on:
            return
        if name is None:
            for timer in self._timers.values():
                timer.reset()
        elif name in self._timers:
            self._timers[name].reset()

    def is_on(self) -> bool:
        """Whether the timers run."""
        return self._on

    def set_status(self, mode: bool) -> None:
        """Switch the timers on or off."""
        self._on = mode

    def __iter__(self) -> Iterator[tuple[str, Timer]]:
        """``(name, timer)`` pairs in creation order."""
        return iter(list(self._timers.items()))
