"""Crash-safe checkpoint directories: write into a staging directory, then swap it in.

A save writes everything into ``<path>.colossal-tmp``. Only when every file and the index
are durable does rank 0 swap it in, with renames only, so that at every instant a complete
checkpoint is loadable and :func:`resolve_directory` finds it:

1. If ``<path>`` exists, the previous checkpoint is moved to ``<path>.colossal-old`` (an
   older ``.colossal-old`` is first renamed to ``<path>.colossal-trash`` and deleted:
   ``<path>`` is loadable meanwhile). If ``<path>`` is missing because an earlier swap
   crashed between its renames, the ``.colossal-old`` left behind is the only good
   checkpoint: it is kept as it is.
2. The staging directory is renamed onto ``<path>``.
3. ``.colossal-old`` is renamed to ``.colossal-trash`` and deleted.

Directories are only ever deleted under the ``.colossal-trash`` name, so a crash mid-delete
never leaves a half-deleted directory where a loader looks. The loader takes ``<path>``
when it exists, else ``<path>.colossal-old``; the staging directory is never loaded.
"""

from __future__ import annotations

import logging
import os
import shutil

logger = logging.getLogger(__name__)

__all__ = ["commit_directory", "resolve_directory", "staging_directory"]

_TMP = ".colossal-tmp"
_OLD = ".colossal-old"
_TRASH = ".colossal-trash"


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


def _rename(source: str, target: str) -> None:
    """Atomically rename ``source`` to ``target`` and make it durable."""
    os.replace(source, target)
    _fsync_dir(os.path.dirname(os.path.abspath(target)) or ".")


def _remove(path: str) -> None:
    """Delete a file or directory tree (only ever called on trash names)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _discard(path: str, trash: str) -> None:
    """Delete ``path``: rename it to ``trash`` first, so it vanishes atomically."""
    if not os.path.lexists(path):
        return
    _remove(trash)
    _rename(path, trash)
    _remove(trash)


def commit_directory(path: str) -> None:
    """Swap the finished staging directory of ``path`` in (rank 0 only).

    At every instant during the swap either the previous or the new complete checkpoint is
    loadable through :func:`resolve_directory`.

    Raises:
        FileNotFoundError: There is no staging directory for ``path``.
    """
    path = os.path.normpath(path)
    staging, old, trash = path + _TMP, path + _OLD, path + _TRASH
    if not os.path.isdir(staging):
        raise FileNotFoundError(f"no staging directory {staging!r} to commit to {path!r}")
    _remove(trash)  # left over by a crash mid-delete; never loaded
    if os.path.lexists(path):
        _discard(old, trash)  # <path> is loadable meanwhile
        _rename(path, old)  # now <path>.colossal-old is
    # else: a crash between the renames of an earlier swap left <path>.colossal-old (if
    # any) as the only good checkpoint; it stays loadable until <path> appears.
    _rename(staging, path)
    _discard(old, trash)


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
