"""FSDPCheckpointIO: the checkpoint IO of :class:`TorchFSDPPlugin`.

FSDP2's ``DTensor`` parameters and optimizer states reach checkpoint IO through the
``colossal.core.DTensorShard`` implementation of :class:`colossal.core.ShardedTensor`:
full tensors are gathered for saving (written spread over the ranks) and each rank reads only
its rows when loading. Nothing here differs from :class:`CheckpointIO`; the class names the
plugin's IO.
"""

from __future__ import annotations

import logging

from colossal.checkpoint_io import CheckpointIO

logger = logging.getLogger(__name__)

__all__ = ["FSDPCheckpointIO"]


class FSDPCheckpointIO(CheckpointIO):
    """Gathers DTensors for saving; loads only this rank's rows of each tensor."""
