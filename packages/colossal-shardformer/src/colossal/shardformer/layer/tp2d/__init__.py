"""2D tensor parallelism (``tp_mode="2d"``): layers on a q x q grid of ranks by SUMMA.

The seed page's algorithm for ``Y = X A`` on ``P = q^2`` ranks: rank ``(i, j)`` holds block
``X_ij`` of the input and ``A_ij`` of the weight; in ``q`` steps ``X_it`` is broadcast along
row ``i`` and ``A_tj`` along column ``j``, and ``Y_ij = sum_t X_it A_tj``. Parameters,
activations and computation are all split ``q^2`` ways. The grid comes from
``ParallelDims(tp=q*q, tp_mode="2d")`` (axes ``tp_col`` outer, ``tp_row`` inner; see
:mod:`._grid`).

Layering (nanotron's): :mod:`._summa` and :mod:`._primitives` (collectives, autograd
Functions) -> :mod:`.functional` and :mod:`.loss` -> modules (:mod:`.linear`, :mod:`.norm`,
:mod:`.embedding`, :mod:`.dropout`). Every parameter is a marked part of the whole tensor in
torch's layout, so the gradient norm, checkpoint IO and
:func:`~colossal.shardformer.layer.enable_full_state_dict` work unchanged.
"""

from colossal.shardformer.layer.tp2d._grid import Grid2D
from colossal.shardformer.layer.tp2d.dropout import Dropout2D
from colossal.shardformer.layer.tp2d.embedding import (
    Embedding2D,
    PatchEmbedding2D,
    VocabParallelEmbedding2D,
)
from colossal.shardformer.layer.tp2d.functional import (
    classifier_2d,
    embedding_2d,
    gather_batch_2d,
    gather_output_2d,
    layer_norm_2d,
    linear_2d,
    patch_embedding_2d,
    split_batch_2d,
    split_input_2d,
    vocab_parallel_classifier_2d,
    vocab_parallel_embedding_2d,
)
from colossal.shardformer.layer.tp2d.linear import (
    Classifier2D,
    Linear2D,
    VocabParallelClassifier2D,
)
from colossal.shardformer.layer.tp2d.loss import (
    CrossEntropyLoss2D,
    VocabParallelCrossEntropyLoss2D,
    cross_entropy_2d,
    vocab_parallel_cross_entropy_2d,
)
from colossal.shardformer.layer.tp2d.norm import LayerNorm2D

__all__ = [
    "Classifier2D",
    "CrossEntropyLoss2D",
    "Dropout2D",
    "Embedding2D",
    "Grid2D",
    "LayerNorm2D",
    "Linear2D",
    "PatchEmbedding2D",
    "VocabParallelClassifier2D",
    "VocabParallelCrossEntropyLoss2D",
    "VocabParallelEmbedding2D",
    "classifier_2d",
    "cross_entropy_2d",
    "embedding_2d",
    "gather_batch_2d",
    "gather_output_2d",
    "layer_norm_2d",
    "linear_2d",
    "patch_embedding_2d",
    "split_batch_2d",
    "split_input_2d",
    "vocab_parallel_classifier_2d",
    "vocab_parallel_cross_entropy_2d",
    "vocab_parallel_embedding_2d",
]
