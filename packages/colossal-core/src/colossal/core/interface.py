"""Wrapper interfaces shared by plugins: a model wrapper and an optimizer wrapper.

Every plugin's boosted model and optimizer implement these, so user code and checkpoint IO
see one surface whatever parallelism sits underneath.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer


class ModelWrapper(nn.Module):
    """A module that wraps another; ``unwrap()`` returns the user's original module.

    Args:
        module: The wrapped module (possibly itself a wrapper such as DDP).
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self) -> nn.Module:
        """The innermost user module, through any number of wrappers."""
        inner: nn.Module = self.module
        while True:
            if isinstance(inner, ModelWrapper):
                inner = inner.unwrap()
            elif (
                hasattr(inner, "module")
                and isinstance(inner.module, nn.Module)
                and _is_torch_wrapper(inner)
            ):
                inner = inner.module
            else:
                return inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped module."""
        return self.module(*args, **kwargs)


def _is_torch_wrapper(module: nn.Module) -> bool:
    return type(module).__name__ in {"DistributedDataParallel", "DataParallel"}


class OptimizerWrapper:
    """Wraps a ``torch.optim.Optimizer`` with the methods every Colossal optimizer offers.

    The base class is the plain single-process behaviour; ZeRO, Gemini and mixed-precision
    optimizers override what they change.

    Args:
        optim: The wrapped optimizer.
    """

    def __init__(self, optim: Optimizer) -> None:
        if not isinstance(optim, Optimizer):
            raise TypeError(
                f"OptimizerWrapper needs a torch.optim.Optimizer, got {type(optim).__name__}"
            )
        self.optim = optim

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optim.defaults

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optim.state

    def _params(self) -> Iterable[torch.Tensor]:
        for group in self.optim.param_groups:
            yield from group["params"]

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss`` (scaled, where the optimizer scales)."""
        loss.backward(*args, **kwargs)

    def backward_by_grad(
        self, tensor: torch.Tensor, grad: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Back-propagate from ``tensor`` given its gradient ``grad`` (e.g. pipeline stages)."""
        torch.autograd.backward(tensor, grad, *args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Update the parameters."""
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Clear gradients."""
        self.optim.zero_grad(*args, **kwargs)

    def get_grad_norm(self, norm_type: float = 2.0) -> float:
        """Total norm of all gradients (as if concatenated into one vector)."""
        grads = [p.grad for p in self._params() if p.grad is not None]
        if not grads:
            return 0.0
        norms = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
        return float(torch.linalg.vector_norm(norms, norm_type))

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale gradients so their total norm is at most ``max_norm``; return the norm before."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        params = [p for p in self._params() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type))

    def clip_grad_by_value(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(
            [p for p in self._params() if p.grad is not None], clip_value
        )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped optimizer's state."""
        self.optim.load_state_dict(state_dict)

    def unwrap(self) -> Optimizer:
        """The user's original optimizer."""
        return self.optim

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"
