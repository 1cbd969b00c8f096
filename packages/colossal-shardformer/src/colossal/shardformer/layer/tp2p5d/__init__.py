"""2.5D (Tesseract) tensor parallelism (``tp_mode="2.5d"``): layers on d layers of a q x q grid.

The seed page's algorithm for ``Y = X A`` on ``P = d q^2`` ranks: ``X``'s rows are split
``d*q`` ways and its columns ``q`` ways, ``A`` is split q x q (as in 2D) and replicated over
the depth, and each of the ``d`` layers multiplies its ``q`` row blocks by SUMMA. Parameters
take ``1/q^2`` of the memory, activations and computation ``1/(d q^2)``. The axes come from
``ParallelDims(tp=d*q*q, tp_mode="2.5d", tp_depth=d)`` (``tp_dep``, ``tp_col``, ``tp_row``;
:mod:`._grid`).

Layering (nanotron's): :mod:`._primitives` (autograd Functions that communicate) ->
:mod:`.functional` and :mod:`.loss` -> modules (:mod:`.linear`, :mod:`.norm`,
:mod:`.embedding`, :mod:`.dropout`). Every parameter is a marked part of the whole tensor in
torch's layout, so the gradient norm, checkpoint IO and
:func:`~colossal.shardformer.layer.enable_full_state_dict` work unchanged.
"""

from colossal.shardformer.layer.tp2p5d._grid import Grid2p5D
from colossal.shardformer.layer.tp2p5d.dropout import Dropout2p5D
from colossal.shardformer.layer.tp2p5d.embedding import (
    Embedding2p5D,
    PatchEmbedding2p5D,
    VocabParallelEmbedding2p5D,
)
from colossal.shardformer.layer.tp2p5d.functional import (
    classifier_2p5d,
    embedding_2p5d,
    gather_batch_2p5d,
    gather_output_2p5d,
    layer_norm_2p5d,
    linear_2p5d,
    patch_embedding_2p5d,
    split_batch_2p5d,
    split_input_2p5d,
    vocab_parallel_classifier_2p5d,
    vocab_parallel_embedding_2p5d,
)
from colossal.shardformer.layer.tp2p5d.linear import (
    Classifier2p5D,
    Linear2p5D,
    VocabParallelClassifier2p5D,
)
from colossal.shardformer.layer.tp2p5d.loss import (
    CrossEntropyLoss2p5D,
    VocabParallelCrossEntropyLoss2p5D,
    cross_entropy_2p5d,
    vocab_parallel_cross_entropy_2p5d,
)
from colossal.shardformer.layer.tp2p5d.norm import LayerNorm2p5D

__all__ = [
    "Classifier2p5D",
    "CrossEntropyLoss2p5D",
    "Dropout2p5D",
    "Embedding2p5D",
    "Grid2p5D",
    "LayerNorm2p5D",
    "Linear2p5D",
    "PatchEmbedding2p5D",
    "VocabParallelClassifier2p5D",
    "VocabParallelCrossEntropyLoss2p5D",
    "VocabParallelEmbedding2p5D",
    "classifier_2p5d",
    "cross_entropy_2p5d",
    "embedding_2p5d",
    "gather_batch_2p5d",
    "gather_output_2p5d",
    "layer_norm_2p5d",
    "linear_2p5d",
    "patch_embedding_2p5d",
    "split_batch_2p5d",
    "split_input_2p5d",
    "vocab_parallel_classifier_2p5d",
    "vocab_parallel_cross_entropy_2p5d",
    "vocab_parallel_embedding_2p5d",
]
