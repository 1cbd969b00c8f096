"""Loggers for library code, with helpers that log on chosen ranks only.

Library modules use ``get_logger(__name__)`` and never configure handlers; only the CLI (or
the user's script) does. ColossalAI's names work as there::

    from colossal.core.logging import disable_existing_loggers, get_dist_logger

    disable_existing_loggers()
    logger = get_dist_logger()
    logger.info("initialized", ranks=[0])

``get_logger`` loggers print nothing unless something configures output (``colossal run``,
the script's ``logging.basicConfig(level=logging.INFO)`` or ``logger.log_to_file(directory)``).
``get_dist_logger()`` logs INFO by default, as ColossalAI's does: its logger gets level INFO
(when unset) and a fallback handler that prints to stdout only while nothing else in the
logger's hierarchy handles records, so a script that configures logging sees each line once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterable, Sequence

import torch.distributed as dist

#: The logger ``get_dist_logger()`` returns without a name, parent of every Colossal logger.
DEFAULT_LOGGER_NAME = "colossal"

_WARNED: set[tuple[str, str]] = set()
_WARNED_LOCK = threading.Lock()


def get_logger(name: str) -> logging.Logger:
    """The standard library logger called ``name``."""
    return logging.getLogger(name)


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def log_on_ranks(
    logger: logging.Logger,
    msg: str,
    *args: object,
    ranks: Iterable[int] | None = (0,),
    level: int = logging.INFO,
) -> None:
    """Log ``msg`` only on the given global ``ranks`` (every rank when ``None``)."""
    rank = _this_rank()
    if ranks is None or rank in set(ranks):
        logger.log(level, msg, *args)


def log_on_master(
    logger: logging.Logger, msg: str, *args: object, level: int = logging.INFO
) -> None:
    """Log ``msg`` on global rank 0 only."""
    log_on_ranks(logger, msg, *args, ranks=(0,), level=level)


def warn_once(logger: logging.Logger, msg: str, *args: object) -> bool:
    """Emit a warning the first time this exact message is seen for ``logger``.

    Returns:
        Whether the warning was emitted now.
    """
    key = (logger.name, msg % args if args else msg)
    with _WARNED_LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    logger.warning(msg, *args)
    return True


class DistributedLogger(logging.LoggerAdapter):
    """A logger whose calls accept ``ranks=[...]`` and prefix records with the rank.

    ``ranks`` are global ranks; without an initialized process group this process is rank 0.
    Records name the caller of ``info``/``warning``/... (not this class) as their origin.

    Example:
        >>> log = get_dist_logger()
        >>> log.info("step %d", 3, ranks=[0])
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def process(self, msg: object, kwargs: dict) -> tuple[object, dict]:  # type: ignore[override]
        """Prefix the message with this process's rank."""
        return f"[rank {_this_rank()}] {msg}", kwargs

    def _log_on(
        self,
        level: int,
        msg: object,
        args: tuple[object, ...],
        ranks: Iterable[int] | None,
        kwargs: dict,
    ) -> None:
        if ranks is not None and _this_rank() not in set(ranks):
            return
        # This frame and the public method that called it sit between the user and logging.
        kwargs["stacklevel"] = int(kwargs.get("stacklevel", 1)) + 2
        super().log(level, msg, *args, **kwargs)

    def log(  # type: ignore[override]
        self,
        level: int,
        msg: object,
        *args: object,
        ranks: Iterable[int] | None = None,
        **kwargs: object,
    ) -> None:
        """Log on ``ranks`` only (every rank when ``None``)."""
        self._log_on(level, msg, args, ranks, kwargs)

    def debug(  # type: ignore[override]
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:
        """Debug-level :meth:`log`."""
        self._log_on(logging.DEBUG, msg, args, ranks, kw)

    def info(  # type: ignore[override]
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:
        """Info-level :meth:`log`."""
        self._log_on(logging.INFO, msg, args, ranks, kw)

    def warning(  # type: ignore[override]
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:
        """Warning-level :meth:`log`."""
        self._log_on(logging.WARNING, msg, args, ranks, kw)

    def error(  # type: ignore[override]
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:
        """Error-level :meth:`log`."""
        self._log_on(logging.ERROR, msg, args, ranks, kw)

    def set_level(self, level: int | str) -> None:
        """Set the level of the underlying logger (``"INFO"`` or ``logging.INFO``).

        Raises:
            ValueError: An unknown level name.
        """
        self.logger.setLevel(_level(level))

    def log_to_file(
        self, path: str | os.PathLike[str], mode: str = "a", level: int | str = "INFO",
        suffix: str | None = None,
    ) -> str:  # fmt: skip
        """Also write this logger's records of ``level`` and above to a file, on every rank.

        Args:
            path: A directory (each rank writes ``rank_<rank>.log`` there, or
                ``rank_<rank>_<suffix>.log``) or, when it is not a directory, the file itself.
            mode: ``open`` mode, ``"a"`` (append) or ``"w"``.
            level: Lowest level written; the logger's own level is lowered to it if needed.
            suffix: Added to the per-rank file name.

        Returns:
            The path of the log file.

        Raises:
            ValueError: ``mode`` is not ``"a"``/``"w"`` or ``level`` is unknown.
        """
        if mode not in ("a", "w"):
            raise ValueError(f"log_to_file: mode must be 'a' or 'w', got {mode!r}")
        threshold = _level(level)
        target = os.fspath(path)
        if os.path.isdir(target):
            name = f"rank_{_this_rank()}" + (f"_{suffix}" if suffix else "") + ".log"
            target = os.path.join(target, name)
        handler = logging.FileHandler(target, mode=mode, encoding="utf-8")
        handler.setLevel(threshold)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.logger.addHandler(handler)
        if self.logger.getEffectiveLevel() > threshold:
            self.logger.setLevel(threshold)
        return target


def _level(level: int | str) -> int:
    if isinstance(level, int) and not isinstance(level, bool):
        return level
    value = logging.getLevelName(str(level).upper())
    if not isinstance(value, int):
        raise ValueError(
            f"unknown logging level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL"
        )
    return value


class _FallbackHandler(logging.StreamHandler):
    """Prints to stdout (looked up at emit time) while no other handler would see the record.

    ``get_dist_logger`` installs one, so INFO lines appear without configuration (as in
    ColossalAI); once the script or the CLI configures logging (a handler on the root or on
    any logger the record passes through), this one stays silent and nothing is doubled.
    """

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s - %(levelname)s: %(message)s"))

    @property
    def stream(self) -> object:
        """``sys.stdout`` now (so a redirected or captured stdout is honoured)."""
        return sys.stdout

    @stream.setter
    def stream(self, value: object) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        """Write the record unless another handler on its way up will."""
        current: logging.Logger | None = logging.getLogger(record.name)
        while current is not None:
            if any(h is not self for h in current.handlers):
                return
            if not current.propagate:
                break
            current = current.parent
        super().emit(record)


def get_dist_logger(name: str = DEFAULT_LOGGER_NAME) -> DistributedLogger:
    """A :class:`DistributedLogger` over ``get_logger(name)`` (ColossalAI's ``get_dist_logger``).

    Logs INFO by default, as ColossalAI's does: the logger's level becomes INFO when it is
    unset (``set_level`` changes it) and it gets a fallback handler printing to stdout while
    nothing else in its hierarchy handles records (``logging.basicConfig``, ``colossal run``
    or ``log_to_file`` take over, without doubled lines).

    Args:
        name: Logger name; ``"colossal"`` (the parent of every Colossal logger) by default.
    """
    logger = get_logger(name)
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        logger.addHandler(_FallbackHandler())
    return DistributedLogger(logger)


def disable_existing_loggers(
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (DEFAULT_LOGGER_NAME,),
    level: int | str = logging.WARNING,
) -> list[str]:
    """Quiet the loggers that exist now by raising their level to ``level`` (WARNING).

    As ColossalAI's ``disable_existing_loggers``: every existing logger except ``exclude``
    (Colossal's own by default) is set to WARNING, so third-party INFO chatter goes away. A
    name also covers its children (``"colossal"`` covers ``"colossal.zero"``). Loggers created
    later and the root logger are not changed.

    Args:
        include: Only these loggers (and their children); ``exclude`` is then ignored.
        exclude: Loggers left alone when ``include`` is None.
        level: The level to set.

    Returns:
        The names of the loggers whose level was set, sorted.

    Raises:
        TypeError: ``include`` or ``exclude`` is a single string instead of a list of names.
        ValueError: An unknown level name.
    """
    for arg, value in (("include", include), ("exclude", exclude)):
        if isinstance(value, str):
            raise TypeError(f"disable_existing_loggers: {arg} must be a list of names, "
                            f"got the string {value!r}; write {arg}=[{value!r}]")  # fmt: skip
    threshold = _level(level)

    def covered(name: str, names: Sequence[str]) -> bool:
        return any(name == n or name.startswith(n + ".") for n in names)

    changed = []
    for name, obj in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(obj, logging.Logger):
            continue  # a placeholder for a parent no one created
        selected = covered(name, include) if include is not None else not covered(name, exclude)
        if selected:
            obj.setLevel(threshold)
            changed.append(name)
    return sorted(changed)
