"""A cross entropy that keeps only the logits (and the targets) for the backward.

``F.cross_entropy`` runs ``log_softmax`` then ``nll_loss`` and saves the log-probabilities, a
second ``[tokens, vocab]`` tensor next to the logits the model returns anyway. For a language
model that tensor is the largest activation of the step. :func:`cross_entropy` runs
``log_softmax`` in row chunks into one reused chunk-sized buffer, keeps only each row's
target log-probability, saves the logits and the targets, and in the backward writes
``softmax(logits)`` chunk by chunk straight into the one gradient tensor it returns, then
subtracts the one-hot targets and scales in place. (PyTorch's fused ``_log_softmax`` /
``_softmax`` kernels make one pass per row, so they are used rather than a ``logsumexp`` +
``exp(x - lse)`` formulation, which is slower: colossal-kernels' CHANGELOG.)

Everything is computed in (at least) float32, as transformers' ``ForCausalLMLoss`` does with
``logits.float()``; the gradient comes back in the logits' dtype.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["cross_entropy"]

logger = logging.getLogger(__name__)

REDUCTIONS = ("mean", "sum", "none")
_CHUNK_ELEMENTS = 1 << 20
"""Elements per row chunk of the forward's log-softmax and the backward (4 MB in float32)."""


def _chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(vocab, 1))


class _LeanCrossEntropy(torch.autograd.Function):
    """Per-row or reduced cross entropy of ``logits (..., V)``; saves the logits and targets."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        ignore_index: int,
        reduction: str,
        denom: torch.Tensor | None,
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        compute = torch.promote_types(logits.dtype, torch.float32)
        flat = logits.reshape(-1, vocab)  # a view for the usual contiguous logits
        tgt = target.reshape(-1)
        valid = tgt != ignore_index
        safe = tgt.masked_fill(~valid, 0)
        rows = flat.shape[0]
        step = _chunk_rows(vocab)
        logp = torch.empty(min(step, rows), vocab, dtype=compute, device=flat.device)
        picked = torch.empty(rows, dtype=compute, device=flat.device)
        for start in range(0, rows, step):
            block = flat[start : start + step].to(compute)  # no copy when already `compute`
            stop = start + block.shape[0]
            out = logp[: block.shape[0]]
            torch.ops.aten._log_softmax.out(block, -1, False, out=out)
            picked[start:stop] = out.gather(-1, safe[start:stop, None]).squeeze(-1)
        losses = picked.neg_().masked_fill_(~valid, 0.0)
        ctx.save_for_backward(logits, safe, valid, denom)
        ctx.reduction = reduction
        if reduction == "none":
            return losses.view(target.shape)
        total = losses.sum()
        return total / denom if denom is not None else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, safe, valid, denom = ctx.saved_tensors
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        compute = torch.promote_types(logits.dtype, torch.float32)
        if ctx.reduction == "none":
            scale = grad_out.reshape(-1).to(compute)
        else:
            scale = grad_out.to(compute)
            if denom is not None:
                scale = scale / denom
            scale = scale.expand(valid.shape)
        # ignored rows get exactly zero (F.cross_entropy's gradient there, even for 0 / 0)
        weight = torch.where(valid, scale, torch.zeros((), dtype=compute, device=scale.device))
        grad = torch.empty(flat.shape, dtype=logits.dtype, device=logits.device)
        in_place = logits.dtype == compute
        step = _chunk_rows(vocab)
        for start in range(0, flat.shape[0], step):
            stop = start + step
            block = flat[start:stop].to(compute)  # no copy when already `compute`
            buf = grad[start:stop] if in_place else torch.empty_like(block)
            torch.ops.aten._softmax.out(block, -1, False, out=buf)
            minus_one = torch.full((buf.shape[0], 1), -1.0, dtype=compute, device=buf.device)
            buf.scatter_add_(-1, safe[start:stop, None], minus_one)
            buf.mul_(weight[start:stop, None])
            if not in_place:
                grad[start:stop].copy_(buf)
        return grad.view(logits.shape), None, None, None, None


def _check(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    divisor: torch.Tensor | int | float | None,
    label_smoothing: float,
    weight: torch.Tensor | None,
) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(
            f"cross_entropy: logits must be a floating-point tensor, got "
            f"{getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise TypeError(
            f"cross_entropy: target must be an integer tensor of class ids, got "
            f"{getattr(target, 'dtype', type(target).__name__)}; class probabilities are not "
            "supported, use torch.nn.functional.cross_entropy for them"
        )
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"cross_entropy: logits {tuple(logits.shape)} must be target {tuple(target.shape)} "
            "plus a last (class) dimension; the classes are the LAST dim here, not dim 1 as in "
            "torch.nn.functional.cross_entropy"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if divisor is not None and reduction != "mean":
        raise ValueError(
            f"cross_entropy: divisor={divisor!r} replaces the count of the 'mean' reduction; "
            f"with reduction={reduction!r} drop it (or divide the result yourself)"
        )
    if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor <= 0:
        raise ValueError(f"cross_entropy: divisor must be positive, got {divisor!r}")
    if label_smoothing != 0.0:
        raise ValueError(
            f"cross_entropy: label_smoothing={label_smoothing!r} is not supported; pass 0.0 or "
            "use torch.nn.functional.cross_entropy"
        )
    if weight is not None:
        raise ValueError(
            "cross_entropy: per-class weight is not supported; pass weight=None or use "
            "torch.nn.functional.cross_entropy"
        )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    divisor: torch.Tensor | int | float | None = None,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross entropy of ``logits (..., V)`` against class ids, saving no log-probabilities.

    Equal to ``F.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1), ...)``
    (loss and gradient), but the backward keeps only ``logits`` (already alive) and the
    targets, so one ``[tokens, V]`` float32 tensor less is alive between forward and
    backward. The forward's log-softmax runs in row chunks into one chunk-sized buffer (no
    full-size temporary); the backward allocates only the gradient it returns.

    Args:
        logits: Scores with the classes in the LAST dimension, any floating dtype. Computed
            in float32 (float64 stays float64); the gradient has the logits' dtype.
        target: Integer class ids, ``logits.shape[:-1]``; ``ignore_index`` marks ignored rows.
        ignore_index: Target value that adds nothing to the loss, the count or the gradient.
        reduction: ``"mean"`` (sum over non-ignored rows divided by their count, or by
            ``divisor``), ``"sum"``, or ``"none"`` (per-row losses shaped like ``target``,
            0 where ignored).
        divisor: For ``"mean"``: divide the sum by this instead of the non-ignored count
            (transformers' ``num_items_in_batch``); a tensor or a positive number.
        label_smoothing: Must be 0.0 (not supported).
        weight: Must be None (per-class weights are not supported).

    Returns:
        A float32 (or float64) scalar, or per-row losses for ``reduction="none"``.

    Raises:
        TypeError: ``logits`` not floating point, or ``target`` not integer class ids.
        ValueError: Mismatched shapes, an unknown reduction, a divisor without ``"mean"``
            or not positive, label smoothing, class weights, or a target outside
            ``[0, V)`` that is not ``ignore_index``.
    """
    _check(logits, target, ignore_index, reduction, divisor, label_smoothing, weight)
    target = target.to(device=logits.device, dtype=torch.long)
    vocab = logits.shape[-1]
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        value = int(target[bad][0])
        raise ValueError(
            f"cross_entropy: target {value} is outside the {vocab} classes [0, {vocab}); "
            f"use ignore_index={ignore_index} for positions without a label"
        )
    compute = torch.promote_types(logits.dtype, torch.float32)
    denom: torch.Tensor | None = None
    if reduction == "mean":
        source = (target != ignore_index).sum() if divisor is None else divisor
        denom = torch.as_tensor(source, device=logits.device).to(compute)
    return _LeanCrossEntropy.apply(logits, target, ignore_index, reduction, denom)
