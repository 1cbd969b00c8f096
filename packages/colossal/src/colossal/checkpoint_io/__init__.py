"""colossal.checkpoint_io: one checkpoint format for every plugin and world size.

Models: Hugging Face safetensors directories (``model.safetensors`` or sharded with
``model.safetensors.index.json``, which also records each file's size and CRC-32).
Optimizers: ``"<param name>.<state name>"`` shards plus ``optimizer.safetensors.index.json``
(param groups by name, hyper-parameters, steps, loss scaler). Saves are spread over ranks,
optionally async, and never replace a good checkpoint until they are complete.
"""

from __future__ import annotations

from colossal.checkpoint_io.general import GeneralCheckpointIO
from colossal.checkpoint_io.index import CheckpointError, read_index
from colossal.checkpoint_io.names import group_param_names
from colossal.checkpoint_io.reader import TensorReader
from colossal.checkpoint_io.template import MODEL_INDEX, OPTIMIZER_INDEX, CheckpointIO

__all__ = [
    "CheckpointError",
    "CheckpointIO",
    "GeneralCheckpointIO",
    "MODEL_INDEX",
    "OPTIMIZER_INDEX",
    "TensorReader",
    "group_param_names",
    "read_index",
]
