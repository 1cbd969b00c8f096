"""Loggers for library code, with helpers that log on chosen ranks only.

Library modules use ``get_logger(__name__)`` and never configure handlers; only the CLI (or
the user's script) does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

import torch.distributed as dist

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

    Example:
        >>> log = DistributedLogger(get_logger(__name__))
        >>> log.info("step %d", 3, ranks=[0])
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def process(self, msg: object, kwargs: dict) -> tuple[object, dict]:  # type: ignore[override]
        """Prefix the message with this process's rank."""
        return f"[rank {_this_rank()}] {msg}", kwargs

    def log(
        self,
        level: int,
        msg: object,
        *args: object,
        ranks: Iterable[int] | None = None,
        **kwargs: object,
    ) -> None:  # type: ignore[override]
        """Log on ``ranks`` only (every rank when ``None``)."""
        if ranks is not None and _this_rank() not in set(ranks):
            return
        super().log(level, msg, *args, **kwargs)

    def debug(
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:  # type: ignore[override]
        """Debug-level :meth:`log`."""
        self.log(logging.DEBUG, msg, *args, ranks=ranks, **kw)

    def info(
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:  # type: ignore[override]
        """Info-level :meth:`log`."""
        self.log(logging.INFO, msg, *args, ranks=ranks, **kw)

    def warning(
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:  # type: ignore[override]
        """Warning-level :meth:`log`."""
        self.log(logging.WARNING, msg, *args, ranks=ranks, **kw)

    def error(
        self, msg: object, *args: object, ranks: Iterable[int] | None = None, **kw: object
    ) -> None:  # type: ignore[override]
        """Error-level :meth:`log`."""
        self.log(logging.ERROR, msg, *args, ranks=ranks, **kw)


def get_dist_logger(name: str) -> DistributedLogger:
    """A :class:`DistributedLogger` over ``get_logger(name)``."""
    return DistributedLogger(get_logger(name))
