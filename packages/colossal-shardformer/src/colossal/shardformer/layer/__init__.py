"""Parallel layers: differentiable primitives, functional ops, modules.

Layering (nanotron's): :mod:`._primitives` (autograd Functions that communicate through
``colossal.core.comm``) -> functional ops (:mod:`.loss`) -> modules (:mod:`.linear`,
:mod:`.embedding`, :mod:`.dropout`) and the region hook (:mod:`.region`).
"""

from colossal.shardformer.layer._primitives import (
    copy_to_tp_region,
    gather_from_tp_region,
    is_in_tp_region,
    reduce_from_tp_region,
    scale_grad,
    split_to_tp_region,
)
from colossal.shardformer.layer.dropout import DropoutForParallelInput, DropoutForReplicatedInput
from colossal.shardformer.layer.embedding import (
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    padded_vocab_size,
)
from colossal.shardformer.layer.full_state import (
    enable_full_state_dict,
    full_tensor,
    local_part,
)
from colossal.shardformer.layer.linear import (
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    Linear1D_Row,
)
from colossal.shardformer.layer.loss import (
    VocabParallelCrossEntropyLoss,
    causal_lm_loss_fn,
    cross_entropy_1d,
)
from colossal.shardformer.layer.region import enter_tp_region

__all__ = [
    "DropoutForParallelInput",
    "DropoutForReplicatedInput",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "VocabParallelCrossEntropyLoss",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "causal_lm_loss_fn",
    "copy_to_tp_region",
    "cross_entropy_1d",
    "enable_full_state_dict",
    "enter_tp_region",
    "full_tensor",
    "gather_from_tp_region",
    "is_in_tp_region",
    "local_part",
    "padded_vocab_size",
    "reduce_from_tp_region",
    "scale_grad",
    "split_to_tp_region",
]
