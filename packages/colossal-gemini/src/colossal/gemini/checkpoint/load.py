"""Loading into Gemini's chunks: each rank writes only the elements its shards hold.

A loader reads, per managed parameter, only the :class:`colossal.core.FlatRange` this rank's
shard holds (:func:`param_part`), writes it into the master piece with :func:`load_piece`
(or the shard, for chunks without a master), and once every parameter is in calls
:func:`refresh_chunks`: the low-precision shards are cast from the masters exactly as after
an optimizer step, kept-gathered payloads are re-gathered and gathered ones released, so
training resumes bit-identically to the run that saved.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from colossal.core import FlatRange
from colossal.core.comm import all_gather
from colossal.gemini.chunk import Chunk, ChunkManager

logger = logging.getLogger(__name__)

__all__ = ["load_piece", "param_part", "refresh_chunks"]


def param_part(chunk: Chunk, param: nn.Parameter) -> FlatRange:
    """The elements of the flattened ``param`` this rank's shard of ``chunk`` holds."""
    start, stop, _ = chunk.tensor_shard(param, source="master")
    return FlatRange(start, stop)


def load_piece(chunk: Chunk, param: nn.Parameter, values: torch.Tensor) -> None:
    """Write this rank's elements of ``param`` (``param_part``'s) into its master piece.

    Without a master (fp32 chunks, frozen chunks) the shard itself is written. Call
    :func:`refresh_chunks` after the last piece.

    Raises:
        ValueError: ``values`` does not have the part's number of elements.
    """
    start, stop, view = chunk.tensor_shard(param, source="master")
    if values.numel() != stop - start:
        raise ValueError(
            f"{chunk.infos[param].name!r}: {values.numel()} values for the {stop - start} "
            f"elements [{start}, {stop}) this rank holds; read param_part(chunk, param)"
        )
    with torch.no_grad():
        view.copy_(values.reshape(-1))


def refresh_chunks(manager: ChunkManager) -> None:
    """Make every chunk's shard and payload follow its (loaded) master; collective.

    As after an optimizer step: the master is cast into the shard; a kept-gathered payload is
    refreshed with one all-gather, a gathered sharded one is released (the next use gathers
    the loaded values). Every rank of the chunks' group must call it.
    """
    for chunk in manager.chunks:
        chunk.wait()
        with torch.no_grad():
            if chunk.master is not None:
                chunk.shard.copy_(chunk.master)
            if chunk.keep_gathered:
                if chunk.world_size > 1:
                    payload = chunk.payload
                    assert payload is not None
                    all_gather(payload, chunk.shard, group=chunk.group)
            elif chunk.is_gathered:
                manager.release(chunk)
