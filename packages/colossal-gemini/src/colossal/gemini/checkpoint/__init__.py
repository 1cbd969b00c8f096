"""Gemini checkpoints through the sharded-state protocol (``colossal.core.ShardedTensor``).

A sync save gathers nothing: :class:`ChunkTensor` / :class:`ChunkStateTensor` give each
rank's ``FlatRange`` ``part`` and its elements (``local()``), which the checkpoint writer
puts in place in the files. An async save streams chunk by chunk (:class:`ChunkGatherer`:
one gather per chunk and state, about one chunk of extra memory per rank). Loading reads
only each rank's flat range of every parameter and writes it into the masters and shards
(:func:`load_piece`, :func:`refresh_chunks`).
"""

from colossal.gemini.checkpoint.gatherer import ChunkGatherer
from colossal.gemini.checkpoint.load import load_piece, param_part, refresh_chunks
from colossal.gemini.checkpoint.tensors import (
    ChunkStateTensor,
    ChunkTensor,
    model_shards,
    optimizer_shards,
)

__all__ = [
    "ChunkGatherer",
    "ChunkStateTensor",
    "ChunkTensor",
    "load_piece",
    "model_shards",
    "optimizer_shards",
    "param_part",
    "refresh_chunks",
]
