"""Where the bytes of an async write come from: a staged snapshot or the caller's tensors.

Snapshot mode: the caller's thread copies the header and every tensor into one aligned CPU
staging buffer holding the exact file image; the loop thread then writes that buffer in chunks
(with ``O_DIRECT`` where possible). The write does not start while the copy runs: overlapping
them slows the copy, and so the caller (buffered writes; measured: colossal-core's CHANGELOG).

Direct mode (``copy=False``): the loop thread reads the caller's tensors while it writes. With
``O_DIRECT`` the bytes are packed into two alternating aligned bounce buffers of a chunk's size
(DMA needs aligned memory); with buffered writes they are written from the tensors with zero
copies.
Tensors that are not contiguous CPU tensors are converted one at a time in the background.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence

import torch

from colossal.core.io._buffers import ALIGNMENT, StagingPool, tensor_memoryview
from colossal.core.io.safetensors_format import TensorInfo

_BATCH_BELOW = 1 << 20
"""Buffered direct writes batch tensors smaller than this into one write."""


def stage_tensors(
    staging: torch.Tensor,
    header: bytes,
    infos: Sequence[TensorInfo],
    tensors: Mapping[str, torch.Tensor],
) -> None:
    """Build the file image in ``staging`` (uint8 CPU): ``header``, tensor data, zero padding.

    Each tensor copy is one ``Tensor.copy_``, which torch spreads over its intra-op threads;
    device tensors are copied to CPU and non-contiguous ones packed on the way.
    """
    start = len(header)
    end = start + (infos[-1].end if infos else 0)
    staging[:start].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    staging[end:].zero_()
    with torch.no_grad():
        for info in infos:
            if info.nbytes:
                dst = staging[start + info.begin : start + info.end].view(info.dtype)
                dst.view(info.shape).copy_(tensors[info.name].detach())


async def buffer_chunks(buffer: memoryview, chunk_bytes: int) -> AsyncIterator[memoryview]:
    """Yield ``buffer`` in slices of ``chunk_bytes``."""
    for start in range(0, len(buffer), chunk_bytes):
        yield buffer[start : start + chunk_bytes]


async def direct_chunks(
    header: bytes,
    infos: Sequence[TensorInfo],
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int,
) -> AsyncIterator[memoryview]:
    """Yield ``header`` then the bytes of ``tensors`` in file order, small tensors batched."""
    loop = asyncio.get_running_loop()
    batch = bytearray(header)
    for info in infos:
        if info.nbytes == 0:
            continue
        tensor = tensors[info.name].detach()
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = await loop.run_in_executor(None, _contiguous_cpu, tensor)
        view = tensor_memoryview(tensor)
        if len(view) < _BATCH_BELOW and len(batch) + len(view) <= chunk_bytes:
            batch += view
            continue
        if batch:
            yield memoryview(batch)
            batch = bytearray()
        for start in range(0, len(view), chunk_bytes):
            yield view[start : start + chunk_bytes]
        del view, tensor
    if batch:
        yield memoryview(batch)


async def packed_chunks(
    header: bytes,
    infos: Sequence[TensorInfo],
    tensors: Mapping[str, torch.Tensor],
    pool: StagingPool,
    chunk_bytes: int,
) -> AsyncIterator[memoryview]:
    """Yield the file image in whole :data:`ALIGNMENT` blocks, packed into bounce buffers.

    Two buffers alternate: the next chunk is packed (in the executor) while the previous one is
    written. ``chunk_bytes`` must be a multiple of :data:`ALIGNMENT`; the last chunk is
    zero-padded (the writer truncates the file afterwards).
    """
    loop = asyncio.get_running_loop()
    packer = _Packer(header, infos, tensors)
    buffers = [pool.acquire(chunk_bytes), pool.acquire(chunk_bytes)]
    pending: asyncio.Future[int] | None = loop.run_in_executor(None, packer.fill, buffers[0])
    try:
        for turn in itertools.count():
            buffer = buffers[turn % 2]
            assert pending is not None  # a fill is in flight at the top of every turn
            filled = await pending
            pending = None
            if filled == chunk_bytes:
                pending = loop.run_in_executor(None, packer.fill, buffers[(turn + 1) % 2])
            elif filled == 0:
                return
            padded = -(-filled // ALIGNMENT) * ALIGNMENT
            buffer[filled:padded].zero_()
            yield tensor_memoryview(buffer)[:padded]
            if filled < chunk_bytes:
                return
    finally:
        if pending is None or pending.done():
            for buffer in buffers:
                pool.release(buffer)
        else:  # a fill still runs in the executor: recycle its buffer only once it is done

            def recycle(_: object) -> None:
                for b in buffers:
                    pool.release(b)

            pending.add_done_callback(recycle)


class _Packer:
    """Copies the bytes of the file image, in order, into the buffers it is given."""

    def __init__(
        self, header: bytes, infos: Sequence[TensorInfo], tensors: Mapping[str, torch.Tensor]
    ) -> None:
        self._pieces = self._flat_pieces(header, infos, tensors)
        self._piece: torch.Tensor | None = torch.empty(0, dtype=torch.uint8)
        self._done = 0

    @staticmethod
    def _flat_pieces(
        header: bytes, infos: Sequence[TensorInfo], tensors: Mapping[str, torch.Tensor]
    ) -> Iterator[torch.Tensor]:
        yield torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for info in infos:
            if info.nbytes:
                tensor = tensors[info.name].detach()
                if tensor.device.type != "cpu" or not tensor.is_contiguous():
                    tensor = _contiguous_cpu(tensor)
                yield tensor.reshape(-1).view(torch.uint8)

    def fill(self, buffer: torch.Tensor) -> int:
        """Copy the next ``len(buffer)`` bytes (fewer at the end) into ``buffer``."""
        filled = 0
        with torch.no_grad():
            while filled < buffer.numel() and self._piece is not None:
                if self._done == self._piece.numel():
                    self._piece, self._done = next(self._pieces, None), 0
                    continue
                count = min(buffer.numel() - filled, self._piece.numel() - self._done)
                buffer[filled : filled + count].copy_(self._piece[self._done : self._done + count])
                filled, self._done = filled + count, self._done + count
        return filled


def _contiguous_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu").contiguous()
