"""ColossalAI's mode-dispatched layers (``colossalai.nn.Linear``, ``LayerNorm``...).

Each name builds the layer of the config's tensor mode (``gpc.tensor_parallel_mode``:
None, ``'1d'``, ``'2d'``, ``'2.5d'``, ``'3d'``, ``'sequence'``) and returns that module
itself: torch's module without tensor parallelism, the 1D layers of
``colossal.shardformer.layer``, or its ``tp2d`` / ``tp2p5d`` / ``tp3d`` layers built on the
job's ``ParallelDims`` (``gpc.dims``). Sharded modules give whole tensors in torch's layout
from ``state_dict()`` and take a plain model's state dict (each rank keeps its part), so a
checkpoint moves between modes and the plain model.

The seeds' pages run these in the order the forward uses them: the 1D Linear alternates
column and row, and the 3D layers follow the cube's orientation, from the state each layer
leaves on ``gpc.layer_env`` (:mod:`colossal.legacy.context.layer_env`). Build a model's
layers in forward order; ``gpc.layer_env.reset()`` starts a fresh model. ``Linear2D``,
``Linear2p5D`` and ``Linear3D`` name one mode's Linear (the seeds' ``from colossalai.nn
import Linear2D``).
"""

from colossal.legacy.nn.layer.dropout import Dropout
from colossal.legacy.nn.layer.embedding import (
    Embedding,
    PatchEmbedding,
    VanillaPatchEmbedding,
    VocabParallelEmbedding,
)
from colossal.legacy.nn.layer.linear import Classifier, Linear, VocabParallelClassifier
from colossal.legacy.nn.layer.mode_linear import Linear2D, Linear2p5D, Linear3D
from colossal.legacy.nn.layer.norm import LayerNorm

__all__ = [
    "Classifier",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "Linear2D",
    "Linear2p5D",
    "Linear3D",
    "PatchEmbedding",
    "VanillaPatchEmbedding",
    "VocabParallelClassifier",
    "VocabParallelEmbedding",
]
