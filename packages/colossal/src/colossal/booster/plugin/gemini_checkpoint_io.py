"""GeminiCheckpointIO: the checkpoint IO of :class:`GeminiPlugin` (work in progress).

Gemini keeps each parameter as a flat range of a chunk sharded over the data-parallel group;
its checkpoints go through the sharded-state protocol (:class:`colossal.core.ShardedTensor`)
chunk by chunk.
"""

from __future__ import annotations

import logging

from colossal.checkpoint_io import CheckpointIO

logger = logging.getLogger(__name__)

__all__ = ["GeminiCheckpointIO"]


class GeminiCheckpointIO(CheckpointIO):
    """Checkpoint IO of Gemini models and optimizers."""
