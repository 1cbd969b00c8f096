"""Chunk-streaming gathers for a save: one chunk's buffer at a time, shared by its tensors.

A checkpoint writer asks for the whole tensors of a Gemini model (or of its optimizer states)
one after another, chunk by chunk. :class:`ChunkGatherer` answers the first request for a
``(chunk, state)`` with ONE all-gather of the ranks' equal-size flat shards into one buffer,
serves that request and every later one for the same chunk as views of the buffer, and drops
the buffer as soon as another chunk is asked for. A save thus issues one collective per chunk
and state (never one per parameter), and holds about one chunk of extra memory per rank
(plus what a file writer still holds of the previous one).

All ranks all-gather (rather than gather to the one rank writing the tensor): the tensors of
one chunk may go to files written by different ranks, and on gloo an all-gather of equal
shards costs about what a gather to one rank costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from colossal.core import get_accelerator
from colossal.core.comm import all_gather

logger = logging.getLogger(__name__)

__all__ = ["ChunkGatherer"]


class ChunkGatherer:
    """Gathers one chunk's flat shards at a time and serves its tensors from that buffer.

    Every rank of the chunk's group must ask for the same chunks and states in the same order
    (a saver gathers every tensor on every rank in one order, so it does).

    Attributes:
        gathers: All-gathers issued so far (one per chunk and state asked for).
        peak_bytes: The largest buffer held (bytes).
    """

    def __init__(self) -> None:
        self._key: tuple[int, str] | None = None
        self._buffer: torch.Tensor | None = None
        self.gathers = 0
        self.peak_bytes = 0

    def buffer(self, chunk: Any, state: str, shard: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The whole flat ``state`` of ``chunk`` (payload order, padding included), on the CPU.

        Collective over the chunk's group the first time a ``(chunk, state)`` is asked for;
        the previous buffer is dropped first.

        Args:
            chunk: A ``colossal.gemini.Chunk``.
            state: What is gathered (``"param"``, ``"exp_avg"``, ...), part of the cache key.
            shard: Gives this rank's flat shard of it (``chunk.shard_size`` elements).

        Raises:
            ValueError: ``shard()`` does not have ``chunk.shard_size`` elements.
        """
        key = (id(chunk), state)
        if key == self._key and self._buffer is not None:
            return self._buffer
        self.release()
        local = shard().detach().reshape(-1)
        if local.numel() != chunk.shard_size:
            raise ValueError(
                f"chunk {chunk.chunk_id}: the {state!r} shard has {local.numel()} elements, "
                f"the chunk's shards {chunk.shard_size}; pass the rank's whole flat shard"
            )
        world = chunk.world_size
        device = local.device if world == 1 else get_accelerator().get_current_device()
        out = self._allocate(local.numel() * world, local.dtype, device)
        if world == 1:
            out.copy_(local)
        else:
            all_gather(out, local.to(device).contiguous(), group=chunk.group)
            self.gathers += 1
        if out.device.type != "cpu":
            out = out.cpu()
        self.peak_bytes = max(self.peak_bytes, out.numel() * out.element_size())
        self._key, self._buffer = key, out
        return out

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new flat buffer (a method so tests can watch the allocations)."""
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self) -> None:
        """Drop the buffer held (tensors already served keep their memory alive)."""
        self._key, self._buffer = None, None
