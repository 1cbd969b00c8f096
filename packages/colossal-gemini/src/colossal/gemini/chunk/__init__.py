"""Chunks: flat, evenly sharded parameter buffers, their manager and the chunk-size search."""

from colossal.gemini.chunk.base import TensorInfo
from colossal.gemini.chunk.chunk import Chunk
from colossal.gemini.chunk.manager import ChunkManager, ChunkSpec
from colossal.gemini.chunk.search import ChunkSearchResult, search_chunk_configuration
from colossal.gemini.chunk.states import LEGAL_TRANSITIONS, IllegalStateTransition, TensorState

__all__ = [
    "LEGAL_TRANSITIONS",
    "Chunk",
    "ChunkManager",
    "ChunkSearchResult",
    "ChunkSpec",
    "IllegalStateTransition",
    "TensorInfo",
    "TensorState",
    "search_chunk_configuration",
]
