"""Crash-safe file writes: a temporary file, fsync, atomic rename, directory fsync.

A failed, cancelled or killed write never leaves a file under the final name and never
clobbers the file that was there; a failed or cancelled write also removes its temporary file
(a killed process leaves it behind, under a hidden ``.<name>.<random>.tmp`` name).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiofiles
import aiofiles.os

from colossal.core.io._buffers import ALIGNMENT

logger = logging.getLogger(__name__)

Source = Callable[[bool], AsyncIterator[memoryview]]
"""Gives the chunks of a file, given whether it is opened with ``O_DIRECT``."""


async def _write_chunk(file: Any, data: memoryview) -> None:
    """Write one chunk (module-level so tests can inject failures and delays)."""
    while data:
        written = await file.write(data)
        data = data[written:]


def _direct_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT, 0o666)


def whole_blocks(nbytes: int) -> int:
    """``nbytes`` rounded up to whole :data:`ALIGNMENT` blocks."""
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


async def write_file_atomically(
    path: str, source: Source, size: int, fsync: bool, direct_io: bool
) -> str:
    """Write a file of ``size`` bytes from ``source`` to a temporary name, move it to ``path``.

    Tries ``O_DIRECT`` first when ``direct_io``; if the filesystem rejects it (``EINVAL`` on
    open or on a write), the file is rewritten with buffered writes.
    """
    loop = asyncio.get_running_loop()
    directory = os.path.dirname(path) or "."
    name = os.path.basename(path)[:200]  # stay under NAME_MAX with the suffix
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
    start = time.perf_counter()
    direct = direct_io and hasattr(os, "O_DIRECT")
    try:
        while True:
            try:
                await _write_temp(tmp, source, size, fsync, direct)
                break
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                logger.debug("O_DIRECT failed for %s (%s); writing it buffered", tmp, exc)
                direct = False
        await aiofiles.os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if fsync:
        await loop.run_in_executor(None, _fsync_directory, directory)
    logger.debug("wrote %s (%d bytes) in %.3f s", path, size, time.perf_counter() - start)
    return path


async def _write_temp(tmp: str, source: Source, size: int, fsync: bool, direct: bool) -> None:
    """Write, truncate to ``size`` (dropping block padding) and optionally fsync ``tmp``."""
    loop = asyncio.get_running_loop()
    if direct:
        file = await aiofiles.open(tmp, "wb", buffering=0, opener=_direct_opener)
    else:
        file = await aiofiles.open(tmp, "wb")
    chunks = source(direct)
    try:
        async for chunk in chunks:
            await _write_chunk(file, chunk)
        await file.flush()
        await loop.run_in_executor(None, os.ftruncate, file.fileno(), size)
        if fsync:
            await loop.run_in_executor(None, os.fsync, file.fileno())
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
        await file.close()


def _fsync_directory(directory: str) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
