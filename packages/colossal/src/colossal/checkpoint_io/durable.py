"""Durable file writes for checkpoints: temporary file, fsync, atomic rename, directory fsync.

The one place in :mod:`colossal.checkpoint_io` that makes small files (indexes, JSON, config
files) crash-safe: after :func:`write_text` or :func:`write_json` returns, ``path`` holds
either the previous content or the new one, never a mix, and the new one survives a power
loss. Tensor shards are written the same way by :class:`colossal.core.io.AsyncTensorWriter`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["fsync_directory", "remove", "replace", "write_json", "write_text"]


def fsync_directory(directory: str) -> None:
    """Make the entries of ``directory`` (renames, new and deleted files) durable.

    Best effort: a platform or filesystem that cannot fsync a directory is skipped.
    """
    try:
        fd = os.open(directory or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace(source: str, target: str) -> None:
    """Atomically rename ``source`` onto ``target`` and make the rename durable."""
    os.replace(source, target)
    fsync_directory(os.path.dirname(os.path.abspath(target)))


def remove(path: str) -> None:
    """Delete a file or a directory tree if it exists (not atomic for trees), durably."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
    else:
        return
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably (temporary file, fsync, rename).

    The temporary file is hidden (``.<name>.<random>.tmp``) and removed if the write fails.
    """
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path``, as :func:`write_text`."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False))
