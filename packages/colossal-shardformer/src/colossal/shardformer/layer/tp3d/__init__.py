"""3D tensor parallelism (``tp_mode="3d"``): layers on a q x q x q cube of ranks.

The seed page's algorithm for ``Y = X A`` on ``P = q^3`` ranks: each rank ``(i, j, l)``
holds ``X_ijl`` and ``A_lji``; ``X`` is all-gathered along the input axis, ``A`` along the
weight axis, and the product reduce-scattered along the output axis, so parameters,
activations and computation are all split ``q^3`` ways and a rank moves ``O(1/q^2)`` of the
activations per layer. The axes come from ``ParallelDims(tp=q**3, tp_mode="3d")``
(``tp_input``, ``tp_weight``, ``tp_output``); a layer's ``swapped`` flag exchanges the input
and output roles, as consecutive linear layers need (:mod:`._cube`).

Layering (nanotron's): :mod:`._primitives` (autograd Functions that communicate) ->
:mod:`.functional` and :mod:`.loss` -> modules (:mod:`.linear`, :mod:`.norm`,
:mod:`.embedding`, :mod:`.dropout`). Every parameter is a marked part of the whole tensor in
torch's layout, so the gradient norm, checkpoint IO and
:func:`~colossal.shardformer.layer.enable_full_state_dict` work unchanged.
"""

from colossal.shardformer.layer.tp3d._cube import Cube3D
from colossal.shardformer.layer.tp3d.dropout import Dropout3D
from colossal.shardformer.layer.tp3d.embedding import (
    Embedding3D,
    PatchEmbedding3D,
    VocabParallelEmbedding3D,
)
from colossal.shardformer.layer.tp3d.functional import (
    classifier_3d,
    embedding_3d,
    gather_batch_3d,
    gather_output_3d,
    layer_norm_3d,
    linear_3d,
    patch_embedding_3d,
    split_batch_3d,
    split_input_3d,
    vocab_parallel_embedding_3d,
)
from colossal.shardformer.layer.tp3d.linear import (
    Classifier3D,
    Linear3D,
    VocabParallelClassifier3D,
)
from colossal.shardformer.layer.tp3d.loss import (
    CrossEntropyLoss3D,
    VocabParallelCrossEntropyLoss3D,
    cross_entropy_3d,
    vocab_parallel_cross_entropy_3d,
)
from colossal.shardformer.layer.tp3d.norm import LayerNorm3D

__all__ = [
    "Classifier3D",
    "CrossEntropyLoss3D",
    "Cube3D",
    "Dropout3D",
    "Embedding3D",
    "LayerNorm3D",
    "Linear3D",
    "PatchEmbedding3D",
    "VocabParallelClassifier3D",
    "VocabParallelCrossEntropyLoss3D",
    "VocabParallelEmbedding3D",
    "classifier_3d",
    "cross_entropy_3d",
    "embedding_3d",
    "gather_batch_3d",
    "gather_output_3d",
    "layer_norm_3d",
    "linear_3d",
    "patch_embedding_3d",
    "split_batch_3d",
    "split_input_3d",
    "vocab_parallel_cross_entropy_3d",
    "vocab_parallel_embedding_3d",
]
