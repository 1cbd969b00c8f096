"""Reading safetensors files: whole files, chosen tensors, slices, and async reads (aiofiles).

Every reader parses and validates the header first, then reads only the byte ranges of the
tensors (or rows) asked for into ``bytearray`` buffers that the returned tensors share
(``torch.frombuffer``), so no numpy and no extra copy are involved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable
from types import EllipsisType, TracebackType
from typing import BinaryIO

import aiofiles
import torch

from colossal.core.io._buffers import tensor_from_buffer
from colossal.core.io._loop import EventLoopThread
from colossal.core.io.handle import ReadHandle
from colossal.core.io.safetensors_format import (
    SafetensorsHeader,
    TensorInfo,
    parse_header,
    parse_header_length,
)

logger = logging.getLogger(__name__)

DEFAULT_READ_CHUNK_BYTES = 32 * 1024 * 1024
"""Bytes per read call of the async reader."""

IndexItem = int | slice | EllipsisType | None
"""One entry of a basic index: an int, a slice, ``...``, or ``None`` (a new axis)."""

Index = IndexItem | tuple[IndexItem, ...]
"""A basic index as ``tensor[...]`` takes it: one entry, or a tuple of entries."""


def read_safetensors_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Parse and validate the header of a safetensors file, without reading tensor data.

    Raises:
        ValueError: The file is truncated or corrupt; the message names the file.
    """
    with open(path, "rb", buffering=0) as file:
        return _read_header(file, os.fsdecode(path))


def load_safetensors(
    path: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Load tensors from a safetensors file, reading only the requested ones.

    Args:
        path: The file.
        keys: Names to load (all when ``None``).
        device: Where the returned tensors live.

    Returns:
        Name -> tensor, in the order of ``keys`` (file header order when ``None``).

    Raises:
        KeyError: A key is not in the file (the message names the file and the key).
        ValueError: The file is truncated or corrupt.
    """
    name = os.fsdecode(path)
    with open(path, "rb", buffering=0) as file:
        header = _read_header(file, name)
        infos = header.select(keys)
        loaded = {}
        for info in sorted(infos, key=lambda i: i.begin):
            buffer = bytearray(info.nbytes)
            file.seek(header.data_start + info.begin)
            _read_into(file, memoryview(buffer), name, info.name)
            loaded[info.name] = tensor_from_buffer(buffer, info)
    return {info.name: loaded[info.name].to(device) for info in infos}


def read_tensor_slice(path: str | os.PathLike[str], name: str, slices: Index) -> torch.Tensor:
    """Read ``tensor[slices]`` of one tensor, reading only the rows (dim 0) it touches.

    Args:
        path: The file.
        name: The tensor.
        slices: Any basic index (ints, slices with positive steps, ``...``, ``None``), e.g.
            ``(slice(0, 4), slice(None, None, 2))``. When the first entry is an int or a slice,
            only those rows are read.

    Returns:
        A CPU tensor equal to ``full_tensor[slices]``.

    Raises:
        KeyError: No tensor ``name`` in the file.
        IndexError: An index is out of range.
        ValueError: A negative slice step, or a truncated/corrupt file.
    """
    path_str = os.fsdecode(path)
    with open(path, "rb", buffering=0) as file:
        header = _read_header(file, path_str)
        (info,) = header.select([name])
        index = slices if isinstance(slices, tuple) else (slices,)
        low, high, index = _row_window(info, index)
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
        shape = (high - low, *info.shape[1:]) if info.shape else ()
        nbytes = (high - low) * row_bytes if info.shape else info.nbytes
        begin = info.begin + low * row_bytes
        buffer = bytearray(nbytes)
        file.seek(header.data_start + begin)
        _read_into(file, memoryview(buffer), path_str, name)
    block = tensor_from_buffer(buffer, TensorInfo(name, info.dtype, shape, begin, begin + nbytes))
    result = block[index]
    return result.clone() if result.numel() != block.numel() else result


class AsyncTensorReader:
    """Reads safetensors files in the background with aiofiles, on its own event-loop thread.

    Args:
        chunk_bytes: Bytes per read call.
        max_workers: Threads that run the blocking file calls.
    """

    def __init__(
        self, *, chunk_bytes: int = DEFAULT_READ_CHUNK_BYTES, max_workers: int = 2
    ) -> None:
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}")
        self._chunk_bytes = chunk_bytes
        self._loop_thread = EventLoopThread("colossal-async-reader", max_workers=max_workers)

    def load(
        self,
        path: str | os.PathLike[str],
        keys: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
    ) -> ReadHandle:
        """Start loading ``keys`` (all when ``None``) of ``path``; see :func:`load_safetensors`.

        Only the header and the byte ranges of the requested tensors are read.

        Returns:
            A handle whose ``wait()`` returns name -> tensor or raises the read's error
            (``KeyError`` for unknown keys, ``ValueError`` for a corrupt file, ``OSError``).
        """
        name = os.fsdecode(path)
        key_list = None if keys is None else ([keys] if isinstance(keys, str) else list(keys))
        coro = _read_file(name, key_list, torch.device(device), self._chunk_bytes)
        return ReadHandle(self._loop_thread.submit(coro), name)

    def close(self, wait: bool = True) -> None:
        """Stop the reader's thread, finishing (``wait=True``) or cancelling pending reads."""
        self._loop_thread.close(wait=wait)

    def __enter__(self) -> AsyncTensorReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(wait=True)


_DEFAULT_LOCK = threading.Lock()
_default_reader: AsyncTensorReader | None = None


def load_safetensors_async(
    path: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    device: str | torch.device = "cpu",
) -> ReadHandle:
    """Start loading tensors of ``path`` in the background on a shared reader.

    Returns:
        A handle whose ``wait()`` returns the same dict as :func:`load_safetensors`.
    """
    global _default_reader
    with _DEFAULT_LOCK:
        reader = _default_reader
        if reader is None or reader._loop_thread._unusable_reason() is not None:
            reader = _default_reader = AsyncTensorReader()
    return reader.load(path, keys, device)


async def _read_file(
    path: str, keys: list[str] | None, device: torch.device, chunk_bytes: int
) -> dict[str, torch.Tensor]:
    loop = asyncio.get_running_loop()
    async with aiofiles.open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        length = parse_header_length(await file.read(8), size, path)
        raw = await file.read(length)
        header = parse_header(raw, size, path)
        infos = header.select(keys)
        loaded = {}
        for info in sorted(infos, key=lambda i: i.begin):
            buffer = bytearray(info.nbytes)
            view = memoryview(buffer)
            await file.seek(header.data_start + info.begin)
            done = 0
            while done < info.nbytes:
                count = await file.readinto(view[done : done + chunk_bytes])
                if not count:
                    raise _truncated(path, info.name)
                done += count
            del view
            loaded[info.name] = tensor_from_buffer(buffer, info)
    if device.type != "cpu":
        await loop.run_in_executor(None, _move_all, loaded, device)
    return {info.name: loaded[info.name] for info in infos}


def _move_all(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    for name, tensor in tensors.items():
        tensors[name] = tensor.to(device)


def _read_header(file: BinaryIO, path: str) -> SafetensorsHeader:
    size = os.fstat(file.fileno()).st_size
    length = parse_header_length(file.read(8), size, path)
    raw = bytearray(length)
    _read_into(file, memoryview(raw), path, "<header>")
    return parse_header(bytes(raw), size, path)


def _read_into(file: BinaryIO, view: memoryview, path: str, name: str) -> None:
    done = 0
    while done < len(view):
        count = file.readinto(view[done:])  # type: ignore[attr-defined]
        if not count:
            raise _truncated(path, name)
        done += count


def _truncated(path: str, name: str) -> ValueError:
    return ValueError(f"{path}: unexpected end of file while reading {name!r}; file truncated?")


def _row_window(
    info: TensorInfo, index: tuple[IndexItem, ...]
) -> tuple[int, int, tuple[IndexItem, ...]]:
    """Rows ``[low, high)`` of dim 0 that ``index`` touches, and the index for those rows."""
    if not info.shape:
        return 0, 0, index
    rows = info.shape[0]
    first = index[0] if index else slice(None)
    rest = index[1:]
    if isinstance(first, slice):
        start, stop, step = first.indices(rows)
        if step <= 0:
            raise ValueError(f"slice steps must be positive, got {step} for {info.name!r}")
        selected = range(start, stop, step)
        if not selected:
            return 0, 0, (slice(0, 0), *rest)
        low, high = selected[0], selected[-1] + 1
        return low, high, (slice(0, high - low, step), *rest)
    if isinstance(first, int) and not isinstance(first, bool):
        row = first + rows if first < 0 else first
        if not 0 <= row < rows:
            raise IndexError(
                f"index {first} is out of range for dim 0 of {info.name!r} (size {rows})"
            )
        return row, row + 1, (0, *rest)
    return 0, rows, index
