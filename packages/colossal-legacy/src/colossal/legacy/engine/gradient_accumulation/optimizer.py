"""GradAccumOptimizer: steps once every ``accumulate_size`` micro-steps."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from colossal.core import GradientAccumulator, OptimizerWrapper

__all__ = ["GradAccumOptimizer"]


class GradAccumOptimizer(OptimizerWrapper):
    """Accumulates the gradients of ``accumulate_size`` micro-steps, then steps once.

    Each micro-step is ``zero_grad()``, ``backward(loss)``, ``step()`` as without
    accumulation. ``backward`` divides the loss by ``accumulate_size`` (so the step sees the
    mean over the micro-steps); ``zero_grad`` clears only at the start of a cycle; ``step``
    and :meth:`clip_grad_by_norm` act only on the last micro-step. On the other micro-steps
    the backward runs without data-parallel communication. For a DDP model that is decided
    at its forward, so the wrapper sets DDP's ``require_backward_grad_sync`` (what
    ``no_sync()`` toggles) for the coming micro-step at every :meth:`step` (and
    :meth:`zero_grad`): True only before the last one. An inner optimizer that is a
    :class:`colossal.core.GradientAccumulator` (ZeRO stage 1) runs those backwards in its
    ``no_sync()``; ZeRO stage 2, which keeps no local gradients, reduces every micro-step
    and accumulates the reduced slices.

    Args:
        optim: The optimizer (wrapper) that steps.
        accumulate_size: Micro-steps per optimizer step (>= 1).
        model: The model (a DDP model's ``no_sync`` is used).

    Raises:
        ValueError: ``accumulate_size`` is not a positive int.
    """

    def __init__(
        self,
        optim: OptimizerWrapper | Optimizer,
        accumulate_size: int,
        model: nn.Module | None = None,
    ) -> None:
        if (
            isinstance(accumulate_size, bool)
            or not isinstance(accumulate_size, int)
            or (accumulate_size < 1)
        ):
            raise ValueError(f"accumulate_size={accumulate_size!r} must be an int >= 1")
        inner = optim if isinstance(optim, OptimizerWrapper) else OptimizerWrapper(optim)
        super().__init__(inner.unwrap())
        self.inner = inner
        self.accumulate_size = accumulate_size
        self.model = model
        #: Micro-steps done in the current cycle (0 at its start).
        self.accumulate_step = 0
        #: Optimizer steps taken (one per cycle); the lr scheduler wrapper follows it.
        self.num_updates = 0
        self._local = self._inner_accumulates()
        self._set_ddp_sync()

    def _inner_accumulates(self) -> bool:
        if not isinstance(self.inner, GradientAccumulator):
            return False
        try:
            with self.inner.no_sync():
                pass
        except RuntimeError:  # e.g. ZeRO stage 2: every backward reduces
            return False
        return True

    @property
    def is_last_micro_step(self) -> bool:
        """Whether the current micro-step ends the cycle (its ``step`` updates)."""
        return self.accumulate_step == self.accumulate_size - 1

    def _set_ddp_sync(self) -> None:
        """DDP reduces in the backward of a forward run while this flag is True."""
        if isinstance(self.model, DistributedDataParallel):
            self.model.require_backward_grad_sync = self.is_last_micro_step

    def _communication_free(self) -> contextlib.AbstractContextManager[object]:
        if self.is_last_micro_step:
            return contextlib.nullcontext()
        if self._local:
            assert isinstance(self.inner, GradientAccumulator)
            return self.inner.no_sync()
        return contextlib.nullcontext()

    # ---- GradientAccumulator (pipeline schedules accumulate microbatches through it) ----------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """The inner optimizer's ``no_sync()`` (nothing when it has none)."""
        if isinstance(self.inner, GradientAccumulator):
            with self.inner.no_sync():
                yield
        else:
            yield

    @property
    def accumulating(self) -> bool:
        """Whether backwards now accumulate locally (inside the inner ``no_sync``)."""
        return isinstance(self.inner, GradientAccumulator) and bool(self.inner.accumulating)

    # ---- the micro-step ------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The inner optimizer's loss scale (1.0 without one)."""
        return float(getattr(self.inner, "loss_scale", 1.0))

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss / accumulate_size`` (without communication until the last)."""
        with self._communication_free():
            self.inner.backward(loss / self.accumulate_size, *args, **kwargs)

    def backward_by_grad(
        self, tensor: torch.Tensor, grad: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Back-propagate ``grad`` from ``tensor``; ``grad`` is not divided.

        Pipeline stages receive gradients of the last stage's loss, which :meth:`backward`
        divided already.
        """
        with self._communication_free():
            self.inner.backward_by_grad(tensor, grad, *args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Clear the gradients at the start of a cycle only."""
        self._set_ddp_sync()
        if self.accumulate_step == 0:
            self.inner.zero_grad(*args, **kwargs)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip on the last micro-step (the inner optimizer's); NaN (nothing done) before it."""
        if not self.is_last_micro_step:
            return math.nan
        return float(self.inner.clip_grad_by_norm(max_norm, norm_type))

    def step(self, *args: Any, **kwargs: Any) -> float | None:
        """End a micro-step; step the inner optimizer on the last one of the cycle."""
        self.accumulate_step += 1
        if self.accumulate_step < self.accumulate_size:
            self._set_ddp_sync()
            return None
        self.accumulate_step = 0
        self._set_ddp_sync()
        self.num_updates += 1
        result: float | None = self.inner.step(*args, **kwargs)
        return result

    # ---- everything else is the inner optimizer's ----------------------------------------------
    @property
    def param_names(self) -> tuple[tuple[str, ...], ...] | None:
        """The inner optimizer's parameter names."""
        return self.inner.param_names

    def set_param_names(self, param_names: Sequence[Sequence[str]]) -> None:
        """Name the inner optimizer's parameters."""
        self.inner.set_param_names(param_names)

    def get_grad_norm(self, norm_type: float = 2.0) -> float | None:
        """The inner optimizer's gradient norm."""
        return self.inner.get_grad_norm(norm_type)

    def state_dict(self) -> StateDict:
        """The inner optimizer's state dict."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore the inner optimizer's state."""
        self.inner.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        """The inner optimizer's attribute ``name`` (any attribute: whatever its type)."""
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"GradAccumOptimizer({self.inner!r}, accumulate_size={self.accumulate_size})"
