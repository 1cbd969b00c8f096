"""Deferred weight gradients for zero-bubble schedules (ColossalAI's ``WeightGradStore``).

A layer that splits its backward (:class:`LinearWithGradAccum` with ``use_zbv=True``) computes
the input gradient at once and leaves the weight gradient's work here: :meth:`put` records it,
:meth:`flush` closes one backward's records as one item of a chunk's queue, and :meth:`pop`
runs the oldest item, accumulating into each weight's ``grad``. A zero-bubble schedule calls
``flush`` after a chunk's input backward and ``pop`` at its weight backward. Colossal's own
ZB-V executor splits the backward through autograd instead and needs none of this; the store
serves layers and schedules written for ColossalAI's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

__all__ = ["LinearWithGradAccum", "WeightGradStore", "linear_with_grad_accum"]

GradFn = Callable[..., torch.Tensor | None]
"""``func(input, grad_output)`` -> the weight gradient, or ``func(input, grad_output, grad)``
adding it into ``grad``."""

_Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, GradFn]


class WeightGradStore:
    """Class-level queues of deferred weight-gradient work, one queue per model chunk."""

    cache: list[_Entry] = []
    weight_grad_queue: list[deque[list[_Entry]]] = [deque(), deque()]

    @classmethod
    def put(
        cls,
        total_input: torch.Tensor,
        grad_output: torch.Tensor,
        weight: torch.Tensor,
        func: GradFn,
    ) -> None:
        """Record one weight gradient to compute later."""
        cls.cache.append((total_input, grad_output, weight, func))

    @classmethod
    def flush(cls, chunk: int = 0) -> None:
        """Close the records since the last flush as one item of ``chunk``'s queue."""
        cls._queue(chunk).append(cls.cache)
        cls.cache = []

    @classmethod
    def pop(cls, chunk: int = 0) -> None:
        """Compute the oldest item of ``chunk``'s queue into the weights' ``grad``.

        Raises:
            RuntimeError: The queue is empty (a ``pop`` without its ``flush``).
        """
        queue = cls._queue(chunk)
        if not queue:
            raise RuntimeError(
                f"WeightGradStore.pop({chunk}): nothing was flushed for chunk {chunk}; call "
                "flush(chunk) after the chunk's input backward"
            )
        for total_input, grad_output, weight, func in queue.popleft():
            if weight.grad is None:
                weight.grad = func(total_input, grad_output)
            else:
                func(total_input, grad_output, weight.grad)

    @classmethod
    def clear(cls) -> None:
        """Drop every recorded and queued item (e.g. after a failed step)."""
        cls.cache = []
        cls.weight_grad_queue = [deque(), deque()]

    @classmethod
    def _queue(cls, chunk: int) -> deque[list[_Entry]]:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"chunk={chunk!r} must be a non-negative int")
        while len(cls.weight_grad_queue) <= chunk:
            cls.weight_grad_queue.append(deque())
        return cls.weight_grad_queue[chunk]


def _weight_grad(
    total_input: torch.Tensor, grad_output: torch.Tensor, into: torch.Tensor | None = None
) -> torch.Tensor:
    """``grad_output^T @ input`` over every leading dim, added into ``into`` when given."""
    grad = grad_output.reshape(-1, grad_output.shape[-1]).t() @ total_input.reshape(
        -1, total_input.shape[-1]
    )
    if into is None:
        return grad
    return into.add_(grad.to(into.dtype))


class LinearWithGradAccum(torch.autograd.Function):
    """``y = x W^T + b`` whose weight gradient can be deferred to :class:`WeightGradStore`.

    ColossalAI's autograd function: ``LinearWithGradAccum.apply(input, weight, bias,
    async_grad_allreduce, use_zbv)``. With ``use_zbv`` the backward returns the input and bias
    gradients and records the weight gradient for :meth:`WeightGradStore.pop`; without it, the
    weight gradient is returned as usual. ``async_grad_allreduce`` is accepted for
    compatibility: this layer has no process group, so nothing is reduced.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        input_: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        async_grad_allreduce: bool = False,
        use_zbv: bool = False,
    ) -> torch.Tensor:
        """The linear map; saves what the backward needs."""
        ctx.save_for_backward(input_, weight)
        ctx.use_zbv = bool(use_zbv)  # type: ignore[attr-defined]
        ctx.has_bias = bias is not None  # type: ignore[attr-defined]
        ctx.weight = weight  # type: ignore[attr-defined]  # the Parameter whose grad is filled
        out = torch.matmul(input_, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """Input and bias gradients; the weight's now, or deferred with ``use_zbv``."""
        input_, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        grad_input = grad_output.matmul(weight)
        grad_bias = None
        if ctx.has_bias:  # type: ignore[attr-defined]
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        if ctx.use_zbv:  # type: ignore[attr-defined]
            WeightGradStore.put(input_, grad_output, ctx.weight, _weight_grad)  # type: ignore[attr-defined]
            grad_weight = None
        else:
            grad_weight = _weight_grad(input_, grad_output)
        return grad_input, grad_weight, grad_bias, None, None


def linear_with_grad_accum(
    input_: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    async_grad_allreduce: bool = False,
    use_zbv: bool = False,
) -> torch.Tensor:
    """ColossalAI's functional form of :class:`LinearWithGradAccum`."""
    out = LinearWithGradAccum.apply(input_, weight, bias, async_grad_allreduce, use_zbv)
    assert isinstance(out, torch.Tensor)
    return out
