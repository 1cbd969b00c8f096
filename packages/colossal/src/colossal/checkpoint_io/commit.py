"""Crash-safe checkpoint directories: write into a staging directory, then swap it in.

A save writes everything into ``<path>.colossal-tmp``; only when every file and the index
are durable does rank 0 move an existing ``<path>`` aside (``<path>.colossal-old``), rename
the staging directory onto ``<path>`` and delete the old one. An interrupted save therefore
never replaces an earlier good checkpoint; if it is interrupted between the two renames, the
loader finds the old checkpoint under ``<path>.colossal-old``.
"""

from __future__ import annotations

import logging
import os
import shutil

logger = logging.getLogger(__name__)

__all__ = ["commit_directory", "resolve_directory", "staging_directory"]

_TMP = ".colossal-tmp"
_OLD = ".colossal-old"


def staging_directory(path: str) -> str:
    """The staging directory of a save to ``path``."""
    return os.path.normpath(path) + _TMP


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit_directory(path: str) -> None:
    """Swap the finished staging directory of ``path`` in (rank 0 only)."""
    path = os.path.normpath(path)
    staging, old = path + _TMP, path + _OLD
    if os.path.exists(old):
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(staging, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)) or ".")
    if os.path.exists(old):
        shutil.rmtree(old) if os.path.isdir(old) else os.remove(old)


def resolve_directory(path: str) -> str:
    """The directory to load for ``path`` (its ``.colossal-old`` twin after a crash mid-swap).

    Raises:
        FileNotFoundError: Neither exists.
    """
    path = os.path.normpath(path)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + _OLD):
        logger.warning("%s is missing; loading the previous checkpoint %s", path, path + _OLD)
        return path + _OLD
    raise FileNotFoundError(
        f"no checkpoint at {path!r}"
        + (" (a save to it was interrupted)" if os.path.isdir(path + _TMP) else "")
    )
