"""Vocab-parallel embedding and LM head (rows of the padded vocabulary split over the group).

The vocabulary is padded to a multiple of ``make_vocab_size_divisible_by * tp`` (ColossalAI's
rule) so every rank holds ``padded / tp`` rows; rank ``r`` holds rows
``[r * padded / tp, (r + 1) * padded / tp)``, of which those below the real vocabulary are
real (the parameter's mark covers only them; the rest are zero padding that never reaches a
checkpoint or the logits users see).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import Block, ShardSpec, shard_parameter, shard_spec
from colossal.shardformer.layer._primitives import (
    copy_to_tp_region,
    gather_from_tp_region,
    is_in_tp_region,
    reduce_from_tp_region,
)
from colossal.shardformer.layer._utils import check_embedding_flags, group_rank, group_size
from colossal.shardformer.layer.loss import mark_vocab_parallel

logger = logging.getLogger(__name__)

__all__ = ["VocabParallelEmbedding1D", "VocabParallelLMHead1D", "padded_vocab_size"]


_SHARDED_ATTR = "_colossal_vocab_sharded"  # on a native weight: (group, its sharded parameter)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp``.

    Raises:
        ValueError: ``make_vocab_size_divisible_by`` is not a positive int.
    """
    if not isinstance(make_vocab_size_divisible_by, int) or make_vocab_size_divisible_by < 1:
        raise ValueError(
            "make_vocab_size_divisible_by must be a positive int, got "
            f"{make_vocab_size_divisible_by!r}"
        )
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _spec(weight: torch.Tensor) -> ShardSpec:
    """The shard record :func:`_vocab_weight` put on ``weight``."""
    spec = shard_spec(weight)
    assert spec is not None, "_vocab_weight marks the weights it returns"
    return spec


def _vocab_weight(
    weight: torch.Tensor,
    process_group: ProcessGroup | None,
    make_vocab_size_divisible_by: int,
    owner: str,
) -> tuple[nn.Parameter, int]:
    """This rank's rows of the vocab-major ``weight`` ``(vocab, d)``, and the padded size.

    Tied embedding and LM head share one ``Parameter``: when ``weight`` is already a
    vocab-sharded parameter it is reused (after checking it is laid out for this group), and
    when it is a native weight an earlier layer of this group already sharded, that layer's
    parameter is reused.
    """
    tp, rank = group_size(process_group), group_rank(process_group)
    done = getattr(weight, _SHARDED_ATTR, None)
    if done is not None and done[0] is process_group:
        weight = done[1]
    spec = shard_spec(weight)
    if spec is not None:
        vocab = int(spec.shape[0])
        per = int(weight.shape[0])
        if not isinstance(spec.part, Block) or spec.part.offsets[0] != min(rank * per, vocab):
            raise ValueError(
                f"{owner}: the weight is already sharded as {spec.part}, not as this rank's "
                f"vocabulary rows over a group of {tp}; tie it to a VocabParallelEmbedding1D "
                "or VocabParallelLMHead1D built on the same process group"
            )
        assert isinstance(weight, nn.Parameter)
        return weight, per * tp
    vocab = int(weight.shape[0])
    padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tp)
    per = padded // tp
    start, stop = min(rank * per, vocab), min((rank + 1) * per, vocab)
    part = Block.along(tuple(weight.shape), 0, start, stop)
    local = (per, *weight.shape[1:])
    param = shard_parameter(weight, part, process_group, local_shape=local)
    setattr(weight, _SHARDED_ATTR, (process_group, param))
    return param, padded


class VocabParallelEmbedding1D(nn.Module):
    """``nn.Embedding`` with the (padded) vocabulary rows split over the group.

    The forward looks up the ids this rank holds, zeroes the others and all-reduces once.

    Attributes:
        num_embeddings: The real vocabulary size (as in ``nn.Embedding``).
        embedding_dim: Width of an embedding.
        padding_idx: As in ``nn.Embedding`` (its row gets no gradient).
        vocab_size: The real vocabulary size.
        padded_vocab_size: The padded vocabulary size over the whole group.
        process_group: The tensor-parallel group.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        num_embeddings: int,
        padded_vocab_size: int,
        padding_idx: int | None,
        process_group: ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.num_embeddings = self.vocab_size = num_embeddings
        self.padded_vocab_size = padded_vocab_size
        self.embedding_dim = int(weight.shape[1])
        self.padding_idx = padding_idx
        self.process_group = process_group
        self.tp_size = group_size(process_group)
        self.tp_rank = group_rank(process_group)
        self.vocab_start = self.tp_rank * (padded_vocab_size // self.tp_size)
        self.vocab_end = self.vocab_start + padded_vocab_size // self.tp_size

    @classmethod
    def from_native_module(
        cls,
        module: nn.Embedding,
        process_group: ProcessGroup | None,
        make_vocab_size_divisible_by: int = 64,
        **kwargs: Any,
    ) -> VocabParallelEmbedding1D:
        """Shard ``module``'s rows over ``process_group`` (reusing an already-sharded tied weight).

        Args:
            module: The native ``nn.Embedding``; its weight may be on ``meta``.
            process_group: The tensor-parallel group (the whole job when None).
            make_vocab_size_divisible_by: Pad the vocabulary to a multiple of this times the
                TP size.
            **kwargs: Accepted for ColossalAI compatibility and ignored (logged).

        Raises:
            ValueError: ``module`` uses ``max_norm``, ``scale_grad_by_freq`` or ``sparse``
                (not supported sharded), or its weight is sharded some other way.
        """
        if kwargs:
            logger.debug("%s ignores %s", cls.__name__, sorted(kwargs))
        check_embedding_flags(module, cls.__name__)
        weight, padded = _vocab_weight(
            module.weight, process_group, make_vocab_size_divisible_by, cls.__name__
        )
        vocab = int(_spec(weight).shape[0])
        padding_idx = getattr(module, "padding_idx", None)
        return cls(weight, vocab, padded, padding_idx, process_group)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids`` (ids outside this rank's rows come from the others)."""
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        pad = self.padding_idx
        local_pad = (
            pad - self.vocab_start
            if pad is not None and not (pad < self.vocab_start or pad >= self.vocab_end)
            else None
        )
        out = F.embedding(local_ids, self.weight, local_pad)
        if self.tp_size > 1:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.process_group, inplace=True)

    def extra_repr(self) -> str:
        """Sizes and TP size, for ``repr``."""
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padded_vocab_size="
            f"{self.padded_vocab_size}, padding_idx={self.padding_idx}, tp_size={self.tp_size}, "
            f"local_weight={tuple(self.weight.shape)}"
        )


class VocabParallelLMHead1D(nn.Module):
    """Column-parallel LM head over the (padded) vocabulary.

    The input enters the TP region (one all-reduce of its gradient backward). With
    ``gather_output`` the logits are all-gathered and the padding dropped, so users see
    ``(..., vocab)``; otherwise (``parallel_output``) they stay this rank's ``(...,
    padded_vocab / tp)`` columns, tagged for :func:`causal_lm_loss_fn`, whose loss ignores
    the padding columns.

    Attributes:
        in_features: Hidden size.
        out_features: The real vocabulary size.
        vocab_size: The real vocabulary size.
        padded_vocab_size: The padded vocabulary size over the whole group.
        gather_output: Whether the forward gathers the logits.
        process_group: The tensor-parallel group.
    """

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        vocab_size: int,
        padded_vocab_size: int,
        process_group: ProcessGroup | None,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = bias
        self.in_features = int(weight.shape[1])
        self.out_features = self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.process_group = process_group
        self.gather_output = bool(gather_output)
        self.tp_size = group_size(process_group)
        self.tp_rank = group_rank(process_group)

    @classmethod
    def from_native_module(
        cls,
        module: nn.Linear,
        process_group: ProcessGroup | None,
        gather_output: bool = False,
        make_vocab_size_divisible_by: int = 64,
        **kwargs: Any,
    ) -> VocabParallelLMHead1D:
        """Shard ``module`` (``nn.Linear(hidden, vocab)``) by vocabulary rows.

        A weight already sharded by a :class:`VocabParallelEmbedding1D` (tied embeddings) is
        reused as the same ``Parameter``.

        Args:
            module: The native LM head; its weight may be on ``meta``.
            process_group: The tensor-parallel group (the whole job when None).
            gather_output: Gather the logits to ``(..., vocab)``.
            make_vocab_size_divisible_by: Pad the vocabulary to a multiple of this times the
                TP size.
            **kwargs: Accepted for ColossalAI compatibility and ignored (logged).

        Raises:
            ValueError: The weight is already sharded some other way.
        """
        if kwargs:
            logger.debug("%s ignores %s", cls.__name__, sorted(kwargs))
        weight, padded = _vocab_weight(
            module.weight, process_group, make_vocab_size_divisible_by, cls.__name__
        )
        vocab = int(_spec(weight).shape[0])
        bias = None
        if getattr(module, "bias", None) is not None:
            tp, rank = group_size(process_group), group_rank(process_group)
            per = padded // tp
            part = Block.along((vocab,), 0, min(rank * per, vocab), min((rank + 1) * per, vocab))
            bias = shard_parameter(module.bias, part, process_group, local_shape=(per,))
        return cls(weight, bias, vocab, padded, process_group, gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits: ``(..., vocab)`` gathered, else this rank's ``(..., padded_vocab / tp)``."""
        if not is_in_tp_region(x, self.process_group):
            x = copy_to_tp_region(x, self.process_group)
        logits = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            return gather_from_tp_region(logits, self.process_group)[..., : self.vocab_size]
        return mark_vocab_parallel(logits)

    def extra_repr(self) -> str:
        """Sizes, TP size and gathering, for ``repr``."""
        return (
            f"in_features={self.in_features}, vocab_size={self.vocab_size}, "
            f"padded_vocab_size={self.padded_vocab_size}, tp_size={self.tp_size}, "
            f"local_weight={tuple(self.weight.shape)}, gather_output={self.gather_output}"
        )
