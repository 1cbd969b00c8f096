"""Vocab-parallel cross entropy and a causal-LM ``loss_function`` for Hugging Face models.

Each rank holds logits for its slice of the (padded) vocabulary. The loss needs, per token,
the log of the sum of exponentials over the whole vocabulary and the target's logit; both come
from small all-reduces (the max, then the sum of exponentials and the target logit together),
never from gathering the logits. Backward is local: ``softmax - onehot`` on this rank's slice.
Columns at or past the real ``vocab_size`` are padding and take no part in either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn
from torch.distributed import ProcessGroup, ReduceOp

from colossal.core.comm import all_reduce
from colossal.shardformer.layer._utils import group_rank, group_size

__all__ = [
    "VocabParallelCrossEntropyLoss",
    "causal_lm_loss_fn",
    "cross_entropy_1d",
    "is_vocab_parallel",
    "mark_vocab_parallel",
]

_VOCAB_PARALLEL_ATTR = "_colossal_vocab_parallel"


def mark_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """Tag ``logits`` as this rank's vocabulary slice (what the LM head returns ungathered)."""
    setattr(logits, _VOCAB_PARALLEL_ATTR, True)
    return logits


def is_vocab_parallel(logits: torch.Tensor) -> bool:
    """Whether :func:`mark_vocab_parallel` tagged ``logits``."""
    return bool(getattr(logits, _VOCAB_PARALLEL_ATTR, False))


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss from vocab-sharded logits ``(N, V_local)`` and labels ``(N,)``."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: ProcessGroup | None,
        ignore_index: int,
        vocab_size: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        n_local = logits.shape[-1]
        start = group_rank(group) * n_local
        real = torch.arange(start, start + n_local, device=logits.device) < vocab_size
        x = logits.to(dtype).masked_fill(~real, float("-inf"))
        row_max = x.max(dim=-1).values
        if group_size(group) > 1:
            all_reduce(row_max, op=ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < n_local)
        safe = torch.where(mine, local, torch.zeros_like(local))
        picked = torch.gather(x, -1, safe.unsqueeze(-1)).squeeze(-1)
        target = torch.where(mine, picked, torch.zeros_like(picked))
        x.exp_()
        sums = torch.stack([x.sum(dim=-1), target])
        if group_size(group) > 1:
            all_reduce(sums, group=group)
        sum_exp, target = sums[0], sums[1]
        loss = torch.where(valid, torch.log(sum_exp) - target, torch.zeros_like(target))
        x.div_(sum_exp.unsqueeze(-1))  # now the softmax of this rank's slice
        ctx.save_for_backward(x, safe, mine, valid)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, safe, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, safe.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g.mul_((grad * valid).to(g.dtype).unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None, None, None


def cross_entropy_1d(
    logits_local: torch.Tensor,
    labels: torch.Tensor,
    process_group: ProcessGroup | None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross entropy of vocab-sharded logits, equal to ``F.cross_entropy`` on the full logits.

    Args:
        logits_local: This rank's logits ``(..., V_local)``: columns
            ``[rank * V_local, (rank + 1) * V_local)`` of the padded vocabulary.
        labels: Target ids ``(...)``, the same on every rank of the group.
        process_group: The tensor-parallel group (the whole job when None).
        ignore_index: Labels with this value add nothing to the loss nor the count.
        vocab_size: The real vocabulary; columns at or past it are padding and excluded
            (default: every column is real).
        dtype: Computation dtype (default: at least float32).
        reduction: ``"mean"`` over the non-ignored labels, ``"sum"`` or ``"none"``
            (per-token losses, 0 where ignored).

    Raises:
        ValueError: Shapes disagree, ``vocab_size`` exceeds the columns, or a bad reduction.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if tuple(logits_local.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"cross_entropy_1d: logits {tuple(logits_local.shape)} and labels "
            f"{tuple(labels.shape)} must agree on every dim but the last (vocabulary) one"
        )
    padded = logits_local.shape[-1] * group_size(process_group)
    vocab = padded if vocab_size is None else int(vocab_size)
    if not 0 < vocab <= padded:
        raise ValueError(
            f"cross_entropy_1d: vocab_size={vocab_size} does not fit the {padded} columns the "
            "group holds; pass the real vocabulary size"
        )
    compute = dtype if dtype is not None else torch.promote_types(logits_local.dtype, torch.float32)
    flat = logits_local.reshape(-1, logits_local.shape[-1])
    loss = _VocabParallelCE.apply(
        flat, labels.reshape(-1).to(flat.device), process_group, ignore_index, vocab, compute
    ).reshape(labels.shape)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum()


class VocabParallelCrossEntropyLoss(nn.Module):
    """:func:`cross_entropy_1d` as a module (mean over non-ignored labels).

    Args:
        process_group: The tensor-parallel group.
        ignore_index: Label value to ignore.
        vocab_size: The real vocabulary (padding columns past it are excluded).
    """

    def __init__(
        self,
        process_group: ProcessGroup | None,
        ignore_index: int = -100,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        self.process_group = process_group
        self.ignore_index = ignore_index
        self.vocab_size = vocab_size

    def forward(self, logits_local: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss over the non-ignored labels."""
        return cross_entropy_1d(
            logits_local, labels, self.process_group, self.ignore_index, self.vocab_size
        )


def causal_lm_loss_fn(process_group: ProcessGroup | None) -> Callable[..., torch.Tensor]:
    """A ``model.loss_function`` computing transformers' ``ForCausalLMLoss`` vocab-parallel.

    The returned callable takes ``(logits, labels, vocab_size, num_items_in_batch=None,
    ignore_index=-100, shift_labels=None, **kwargs)`` like transformers' own; it shifts the
    labels once (unless ``shift_labels`` is given) and divides the summed loss by
    ``num_items_in_batch`` when given, else averages over the non-ignored labels. Logits
    may be this rank's vocabulary slice (the LM head's ``parallel_output``) or the full,
    gathered logits (then the loss is computed locally, like transformers).

    Args:
        process_group: The tensor-parallel group (the whole job when None).
    """

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            labels = F.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        reduction = "sum" if num_items_in_batch is not None else "mean"
        local = group_size(process_group) > 1 and (
            is_vocab_parallel(logits) or logits.shape[-1] != vocab_size
        )
        if local:
            loss = cross_entropy_1d(
                logits.float(), shift_labels.to(logits.device), process_group,
                ignore_index=ignore_index, vocab_size=vocab_size, reduction=reduction,
            )
        else:
            flat = logits.float()[..., :vocab_size].reshape(-1, vocab_size)
            loss = F.cross_entropy(
                flat, shift_labels.reshape(-1).to(flat.device),
                ignore_index=ignore_index, reduction=reduction,
            )
        if num_items_in_batch is not None:  # reduction == "sum"
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss

    return loss_function
