"""Chunk-streaming gathers for a save: one chunk's buffer at a time, shared by its tensors.

A checkpoint writer asks for the whole tensors of a Gemini model (or of its optimizer states)
one after another, chunk by chunk, each for the rank that writes its file. :class:`ChunkGatherer`
answers the first request for a ``(chunk, state, rank)`` with ONE gather of the ranks'
equal-size flat shards into one buffer on that rank (the others send their shard to it; an
all-gather when every rank asks), serves that request and every later one for the same chunk
and rank as views of the buffer, and drops the buffer as soon as something else is asked for.
A save thus issues one gather per chunk and state (one more where a file boundary gives the
chunk's tensors to another writer), never one per parameter, and only the writing rank holds
the chunk: about one chunk of extra memory per rank (plus what a file writer still holds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from colossal.core import get_accelerator
from colossal.core.comm import all_gather, group_ranks, recv, send
from colossal.gemini.chunk import Chunk

logger = logging.getLogger(__name__)

__all__ = ["ChunkGatherer"]


class ChunkGatherer:
    """Gathers one chunk's flat shards at a time and serves its tensors from that buffer.

    Every rank of the chunk's group must ask for the same chunks, states and ranks in the same
    order (a saver gathers every tensor on every rank in one order, so it does).

    Attributes:
        gathers: Gathers this rank took part in (one per chunk, state and receiving rank).
        peak_bytes: The largest buffer held (bytes).
    """

    def __init__(self) -> None:
        self._key: tuple[int, str, int | None] | None = None
        self._buffer: torch.Tensor | None = None
        self.gathers = 0
        self.peak_bytes = 0

    def buffer(
        self,
        chunk: Chunk,
        state: str,
        shard: Callable[[], torch.Tensor],
        dst: int | None = None,
    ) -> torch.Tensor | None:
        """The whole flat ``state`` of ``chunk`` (payload order, padding included), on the CPU.

        Collective over the chunk's group the first time a ``(chunk, state, dst)`` is asked
        for; the previous buffer is dropped first.

        Args:
            chunk: A ``colossal.gemini.Chunk``.
            state: What is gathered (``"param"``, ``"exp_avg"``, ...), part of the cache key.
            shard: Gives this rank's flat shard of it (``chunk.shard_size`` elements).
            dst: The global rank that needs it (every rank when None).

        Returns:
            The buffer on ``dst`` (every rank when None), None on the other ranks.

        Raises:
            ValueError: ``shard()`` does not have ``chunk.shard_size`` elements, or ``dst``
                is not a rank of the chunk's group.
        """
        key = (id(chunk), state, dst)
        if key == self._key:
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
        ranks = list(group_ranks(chunk.group)) if world > 1 else [] if dst is None else [dst]
        if dst is not None and dst not in ranks:
            raise ValueError(f"dst={dst} is not a rank of chunk {chunk.chunk_id}'s group {ranks}")
        if world > 1 and dst is not None and ranks[chunk.rank] != dst:
            send(local.to(device).contiguous(), dst=dst, group=chunk.group)
            self.gathers += 1
            self._key = key  # the writer has it; nothing is held here
            return None
        out = self._allocate(local.numel() * world, local.dtype, device)
        if world == 1:
            out.copy_(local)
        elif dst is None:
            all_gather(out, local.to(device).contiguous(), group=chunk.group)
            self.gathers += 1
        else:
            n = local.numel()
            for r, holder in enumerate(ranks):  # in rank order, one shard from each
                if holder == dst:
                    out[r * n : (r + 1) * n].copy_(local)
                else:
                    recv(out[r * n : (r + 1) * n], src=holder, group=chunk.group)
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
