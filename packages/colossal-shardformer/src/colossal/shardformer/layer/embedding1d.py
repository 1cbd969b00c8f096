"""``Embedding1D``: an embedding whose width (not its vocabulary) is split over the group.

ColossalAI's 1D embedding: rank ``r`` holds columns ``[r * d / tp, (r + 1) * d / tp)`` of the
``(vocab, d)`` table, looks its ids up in them and all-gathers the output to full width (the
backward keeps this rank's slice of the gradient). Its weight is laid out like a
row-parallel ``Linear1D_Row`` weight of the same ``(vocab, d)`` shape, so a tied LM head is a
``Linear1D_Row`` over the same parameter.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import Block, shard_parameter
from colossal.shardformer.layer._primitives import gather_from_tp_region
from colossal.shardformer.layer._utils import (
    check_divisible,
    check_embedding_flags,
    group_rank,
    group_size,
)

logger = logging.getLogger(__name__)

__all__ = ["Embedding1D"]


class Embedding1D(nn.Module):
    """``nn.Embedding`` with the embedding width split over the group, the output gathered.

    Attributes:
        num_embeddings: Vocabulary size.
        embedding_dim: Whole embedding width.
        padding_idx: As in ``nn.Embedding`` (its row gets no gradient).
        process_group: The tensor-parallel group.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        embedding_dim: int,
        padding_idx: int | None,
        process_group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings = int(weight.shape[0])
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.process_group = process_group
        self.tp_size = group_size(process_group)

    @classmethod
    def from_native_module(
        cls, module: nn.Embedding, process_group: ProcessGroup | None, **kwargs: Any
    ) -> Embedding1D:
        """Split ``module``'s columns over ``process_group``.

        Args:
            module: The native ``nn.Embedding``; its weight may be on ``meta``.
            process_group: The tensor-parallel group (the whole job when None).
            **kwargs: Accepted for ColossalAI compatibility and ignored (logged).

        Raises:
            ValueError: The width does not divide by the group size, or ``module`` uses
                ``max_norm``, ``scale_grad_by_freq`` or ``sparse``.
        """
        if kwargs:
            logger.debug("%s ignores %s", cls.__name__, sorted(kwargs))
        check_embedding_flags(module, cls.__name__)
        shape = tuple(module.weight.shape)
        tp, rank = group_size(process_group), group_rank(process_group)
        check_divisible(
            "embedding_dim", shape[1], tp, cls.__name__, "choose a tensor-parallel size that "
            "divides it, or use VocabParallelEmbedding1D"
        )  # fmt: skip
        per = shape[1] // tp
        weight = shard_parameter(
            module.weight, Block.along(shape, 1, rank * per, (rank + 1) * per), process_group
        )
        return cls(weight, shape[1], module.padding_idx, process_group)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-width embeddings of ``input_ids`` (one all-gather over the group)."""
        out = F.embedding(input_ids, self.weight, self.padding_idx)
        return gather_from_tp_region(out, self.process_group)

    def extra_repr(self) -> str:
        """Sizes and TP size, for ``repr``."""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"tp_size={self.tp_size}, local_weight={tuple(self.weight.shape)}"
        )
