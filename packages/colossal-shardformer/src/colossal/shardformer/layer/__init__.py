"""Parallel layers: differentiable primitives, functional ops, modules.

Layering (nanotron's): :mod:`._primitives` (autograd Functions that communicate through
``colossal.core.comm``) -> functional ops (:mod:`.loss`) -> modules (:mod:`.linear`,
:mod:`.embedding`, :mod:`.dropout`) and the region hook (:mod:`.region`).
"""

from colossal.shardformer.layer._primitives import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    split_to_tp_region,
)
from colossal.shardformer.layer.linear import (
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    Linear1D_Row,
)
from colossal.shardformer.layer.region import enter_tp_region

__all__ = [
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "copy_to_tp_region",
    "enter_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "split_to_tp_region",
]
