"""Wrapper interfaces shared by plugins: a model wrapper and an optimizer wrapper.

Every plugin's boosted model and optimizer implement these, so user code and checkpoint IO
see one surface whatever parallelism sits underneath.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from colossal.core.grad_norm import clip_grad_norm_, grad_norm


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

    Checkpoints store optimizer states by parameter name, so a wrapper made for a model
    carries the model name of every parameter (``param_names``).

    Args:
        optim: The wrapped optimizer.
        param_names: The model name of each parameter, one sequence per param group in the
            optimizer's order (as ``[[n for p in g["params"]] for g in param_groups]``); None
            leaves the optimizer unnamed (see :meth:`set_param_names`).

    Raises:
        TypeError: ``optim`` is not a torch optimizer.
        ValueError: ``param_names`` does not match the param groups (see
            :meth:`set_param_names`).
    """

    def __init__(
        self, optim: Optimizer, param_names: Sequence[Sequence[str]] | None = None
    ) -> None:
        if not isinstance(optim, Optimizer):
            raise TypeError(
                f"OptimizerWrapper needs a torch.optim.Optimizer, got {type(optim).__name__}"
            )
        self.optim = optim
        # Counted now: subclasses (ZeRO) may replace the groups' parameters afterwards.
        self._param_counts = tuple(len(g["params"]) for g in optim.param_groups)
        self._param_names: tuple[tuple[str, ...], ...] | None = None
        if param_names is not None:
            self.set_param_names(param_names)

    @property
    def param_names(self) -> tuple[tuple[str, ...], ...] | None:
        """The model name of each parameter, per param group (None when not named)."""
        return self._param_names

    def set_param_names(self, param_names: Sequence[Sequence[str]]) -> None:
        """Name the parameters: one sequence of names per param group, in the groups' order.

        Raises:
            TypeError: ``param_names`` is not a sequence of sequences of strings.
            ValueError: The number of groups or of names in a group differs from the
                optimizer's, or a name is empty or repeated.
        """
        if isinstance(param_names, str | bytes) or not isinstance(param_names, Sequence):
            raise TypeError(
                "param_names must be one sequence of names per param group, got "
                f"{type(param_names).__name__}"
            )
        groups = []
        for g, names in enumerate(param_names):
            if isinstance(names, str | bytes) or not isinstance(names, Sequence):
                raise TypeError(
                    f"param_names[{g}] must be a sequence of names, got {type(names).__name__}"
                )
            bad = [n for n in names if not isinstance(n, str) or not n]
            if bad:
                raise TypeError(f"param_names[{g}] holds {bad[:3]}; names are non-empty strings")
            groups.append(tuple(names))
        counts = tuple(len(names) for names in groups)
        if counts != self._param_counts:
            raise ValueError(
                f"param_names has {counts} names per group but the optimizer's param groups "
                f"hold {self._param_counts} parameters; give one name per parameter"
            )
        counts_by_name = Counter(n for names in groups for n in names)
        repeated = sorted(n for n, k in counts_by_name.items() if k > 1)
        if repeated:
            raise ValueError(
                f"param_names repeats {repeated[:5]}; each parameter needs its own name"
            )
        self._param_names = tuple(groups)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optim.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optim.defaults

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        """The wrapped optimizer's per-parameter state (a dict of named states per param)."""
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

    def step(self, *args: Any, **kwargs: Any) -> float | None:
        """Update the parameters; the closure's loss when one is given, else None."""
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """Clear gradients."""
        self.optim.zero_grad(*args, **kwargs)

    def get_grad_norm(self, norm_type: float = 2.0) -> float | None:
        """Total norm of all gradients (as if concatenated into one vector).

        It is :func:`colossal.core.grad_norm`: with parameters that carry placements
        (tensor parallel, FSDP2's DTensors) the global norm, collective over the job.
        Wrappers that keep the norm of their last step (ZeRO, Gemini) return None before
        their first step.
        """
        return float(grad_norm(list(self._params()), norm_type))

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Scale gradients so their total norm is at most ``max_norm``; return the norm before."""
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        return float(clip_grad_norm_(list(self._params()), max_norm, norm_type))

    def clip_grad_by_value(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``."""
        torch.nn.utils.clip_grad_value_(
            [p for p in self._params() if p.grad is not None], clip_value
        )

    def state_dict(self) -> StateDict:
        """The wrapped optimizer's state dict."""
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore the wrapped optimizer's state."""
        self.optim.load_state_dict(state_dict)

    def unwrap(self) -> Optimizer:
        """The user's original optimizer."""
        return self.optim

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"
