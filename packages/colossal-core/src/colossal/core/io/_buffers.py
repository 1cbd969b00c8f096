"""Zero-copy byte views of tensors, tensors over byte buffers, and reusable staging buffers."""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from colossal.core.io.safetensors_format import TensorInfo

logger = logging.getLogger(__name__)

_SMALL_SLACK = 1 << 20

ALIGNMENT = 4096
"""Alignment of staging buffers: the largest logical block size ``O_DIRECT`` commonly needs."""


def tensor_memoryview(tensor: torch.Tensor) -> memoryview:
    """A zero-copy, read-write byte view of a contiguous CPU tensor (no numpy needed).

    The view does not keep ``tensor`` alive: the caller must hold a reference to the tensor for
    as long as the view is used.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_memoryview needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def empty_aligned(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose memory starts at a multiple of :data:`ALIGNMENT`.

    Such a tensor can be read into and written from with ``O_DIRECT`` (when its byte length is
    a multiple of :data:`ALIGNMENT` too). It is a view of a slightly larger buffer.

    Raises:
        ValueError: ``numel`` is negative.
    """
    if numel < 0:
        raise ValueError(f"numel={numel!r} is invalid; use a count >= 0")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    start = -buffer.data_ptr() % ALIGNMENT
    return buffer[start : start + nbytes].view(dtype)


def tensor_from_buffer(buffer: bytearray, info: TensorInfo) -> torch.Tensor:
    """A tensor of ``info``'s dtype and shape that owns (shares) ``buffer``, without a copy."""
    if info.numel == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    return torch.frombuffer(buffer, dtype=info.dtype, count=info.numel).reshape(info.shape)


class StagingPool:
    """CPU byte buffers that async saves copy tensors into, optionally kept for the next save.

    Allocating fresh memory costs page faults that make a snapshot several times slower than a
    copy into memory that was touched before, so by default freed buffers are kept and reused
    (best fit, at most twice the size needed). The cache never holds more bytes than the peak in
    use at once: a training loop that saves the same shards every N steps keeps one set of
    buffers.

    Args:
        reuse: Keep released buffers for later saves; when ``False`` they are freed at once.
    """

    def __init__(self, reuse: bool = True) -> None:
        self._reuse = reuse
        self._free: list[torch.Tensor] = []
        self._in_use = 0
        self._peak_in_use = 0
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor of ``nbytes`` starting at a multiple of :data:`ALIGNMENT`.

        It is a view of a possibly larger buffer (the alignment allows ``O_DIRECT`` writes).
        """
        with self._lock:
            limit = max(2 * nbytes, nbytes + _SMALL_SLACK)  # don't tie up a big buffer
            fits = [b for b in self._free if nbytes <= b.numel() - ALIGNMENT <= limit]
            buffer = min(fits, key=torch.Tensor.numel) if fits else None
            if buffer is not None:
                self._free = [b for b in self._free if b is not buffer]
            else:
                buffer = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
            self._in_use += buffer.numel()
            self._peak_in_use = max(self._peak_in_use, self._in_use)
        start = -buffer.data_ptr() % ALIGNMENT
        return buffer[start : start + nbytes]

    def release(self, view: torch.Tensor) -> None:
        """Give back a tensor returned by :meth:`acquire`."""
        buffer = view._base if view._base is not None else view
        with self._lock:
            self._in_use -= buffer.numel()
            if not self._reuse:
                return
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            while sum(b.numel() for b in self._free) > self._peak_in_use:
                dropped = self._free.pop()
                logger.debug("dropping a cached %d-byte staging buffer", dropped.numel())

    def clear(self) -> None:
        """Free every cached buffer."""
        with self._lock:
            self._free.clear()
            self._peak_in_use = self._in_use

    @property
    def cached_bytes(self) -> int:
        """Bytes held in free buffers waiting to be reused."""
        with self._lock:
            return sum(b.numel() for b in self._free)
