"""LazyInitContext: build a model on the meta device, materialize it later, equal to eager.

Inside the context every tensor factory makes a ``meta`` tensor (no memory) and every
in-place initializer on it (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ...) is recorded
together with the CPU random-number state it would have seen. Random initializers still
advance the CPU generator exactly as eager code would (they run once on a scratch tensor of
one parameter's size, freed at once), so code after the context sees the same random stream.
Materializing replays each tensor's recipe on its own, so a plugin can build one full tensor
at a time and keep only its shard (FSDP) — the weights equal eager init under the same seed.
A parameter cut from a lazy one by :func:`colossal.core.shard_parameter` (tensor parallel,
applied before materializing) is materialized as only its part the same way.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from colossal.core import mark_sharded, shard_source, shard_spec

logger = logging.getLogger(__name__)

__all__ = ["LazyInitContext", "is_lazy", "materialize_tensor"]

_ATTR = "_colossal_lazy"
_DETERMINISTIC_INPLACE = {
    "zero_", "fill_", "copy_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_",
    "clamp_max_", "erfinv_", "ones_", "zeros_", "constant_", "requires_grad_", "eye_",
    "dirac_", "fill_diagonal_", "masked_fill_", "sqrt_", "neg_", "abs_", "exp_", "log_",
}  # fmt: skip
_RANDOM_FACTORIES = {
    "rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like",
    "randint_like", "bernoulli", "multinomial",
}  # fmt: skip


@dataclass
class _Root:
    """How to build one real tensor: a recipe, then in-place ops (possibly on views)."""

    recipe: Callable[[], torch.Tensor]
    ops: list[tuple[list[Any], Any, tuple[Any, ...], dict[str, Any], torch.Tensor | None]] = field(
        default_factory=list
    )


@dataclass
class _Info:
    root: _Root
    chain: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]


def is_lazy(tensor: object) -> bool:
    """Whether ``tensor`` was created under a :class:`LazyInitContext` and not materialized."""
    return isinstance(tensor, torch.Tensor) and tensor.is_meta and hasattr(tensor, _ATTR)


def _apply_chain(real: torch.Tensor, chain: list[Any]) -> torch.Tensor:
    for func, args, kwargs in chain:
        real = func(real, *args, **kwargs)
    return real


def _with_rng(state: torch.Tensor | None, fn: Callable[[], Any]) -> Any:
    if state is None:
        return fn()
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return fn()
    finally:
        torch.set_rng_state(saved)


def _realize(root: _Root) -> torch.Tensor:
    real = root.recipe()
    with torch.no_grad():
        for chain, func, args, kwargs, state in root.ops:
            target = _apply_chain(real, chain)
            args = tree_map(_to_real, args)
            kwargs = tree_map(_to_real, kwargs)
            _with_rng(state, functools.partial(func, target, *args, **kwargs))
    return real


def _to_real(value: Any) -> Any:
    if is_lazy(value):
        return materialize_tensor(value)
    return value


def materialize_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor equal to what eager init would have produced for ``tensor``."""
    info: _Info = getattr(tensor, _ATTR)
    return _apply_chain(_realize(info.root), info.chain).clone()


class _LazyMode(TorchFunctionMode):
    _busy = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._busy:  # inside a recorded op: run it plainly
            return func(*args, **kwargs)
        if not args and isinstance(kwargs.get("tensor"), torch.Tensor):  # torch.nn.init.*
            kwargs = dict(kwargs)
            args = (kwargs.pop("tensor"),)
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if (
            isinstance(first, torch.Tensor)
            and hasattr(first, _ATTR)
            and name.endswith("_")
            and (not name.startswith("__"))
        ):
            return self._inplace(func, name, first, args[1:], kwargs)
        if _is_factory(func, name, args, kwargs):
            return self._factory(func, name, args, kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_meta and not hasattr(out, _ATTR):
            if (
                isinstance(first, torch.Tensor)
                and hasattr(first, _ATTR)
                and (out._is_view() or name in ("__get__", "detach"))
            ):
                parent: _Info = getattr(first, _ATTR)
                chain = parent.chain + ([(func, args[1:], kwargs)] if out._is_view() else [])
                setattr(out, _ATTR, _Info(parent.root, chain))
            else:
                real_args = args
                recipe = lambda f=func, a=real_args, k=kwargs: f(  # noqa: E731
                    *tree_map(_to_real, a), **tree_map(_to_real, k)
                )
                setattr(out, _ATTR, _Info(_Root(recipe), []))
        return out

    def _inplace(
        self, func: Any, name: str, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        info: _Info = getattr(tensor, _ATTR)
        self._busy = True
        try:
            state = self._consume_rng(func, name, tensor, args, kwargs)
            info.root.ops.append((info.chain, func, args, kwargs, state))
            return func(tensor, *args, **kwargs)
        finally:
            self._busy = False

    @staticmethod
    def _consume_rng(
        func: Any, name: str, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: Any
    ) -> torch.Tensor | None:
        state = None
        if name not in _DETERMINISTIC_INPLACE:  # maybe random (init.kaiming_uniform_, ...)
            state = torch.get_rng_state()
            scratch = torch.empty(tensor.shape, dtype=tensor.dtype)
            with torch.no_grad():
                func(scratch, *tree_map(_to_real, args), **tree_map(_to_real, kwargs))
            del scratch  # consumed the random numbers eager init would have
            if torch.equal(state, torch.get_rng_state()):
                state = None  # it was deterministic after all
        return state

    def _factory(self, func: Any, name: str, args: tuple[Any, ...], kwargs: Any) -> Any:
        state = torch.get_rng_state() if name in _RANDOM_FACTORIES else None
        real_kwargs = {**kwargs, "device": "cpu"}
        if state is not None:
            func(*args, **real_kwargs)  # advance the generator as eager would
        out = func(*args, **{**kwargs, "device": "meta"})
        recipe = lambda: _with_rng(state, lambda: func(*args, **real_kwargs))  # noqa: E731
        setattr(out, _ATTR, _Info(_Root(recipe), []))
        return out


def _is_factory(func: Any, name: str, args: tuple[Any, ...], kwargs: Any) -> bool:
    if getattr(func, "__module__", None) not in ("torch", "torch._C._VariableFunctions", None):
        return False
    if name not in _FACTORIES:
        return False
    device = kwargs.get("device")
    return device is None or torch.device(device).type in ("cpu", "meta")


_FACTORIES = {
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange",
    "linspace", "logspace", "eye", "empty_strided", "normal",
}  # fmt: skip
"""Factories made lazy. ``torch.tensor(data)`` stays real: its data is already in memory (and
libraries probe the default device with ``torch.tensor([]).device``)."""


class LazyInitContext:
    """Build models without allocating their weights; materialize them later.

    Example:
        >>> with LazyInitContext():
        ...     model = GPT2LMHeadModel(config)   # no weight memory allocated
        >>> LazyInitContext.materialize(model)    # or let a Booster plugin do it

    A Booster plugin materializes a lazy model in ``boost``; ``TorchFSDPPlugin`` builds one
    full tensor at a time and keeps only this rank's shard.

    Args:
        default_device: Ignored placeholder for ColossalAI compatibility (tensors are meta
            inside the context, CPU when materialized).
    """

    def __init__(self, default_device: str | torch.device | None = None) -> None:
        self.default_device = default_device
        self._mode: _LazyMode | None = None
        self._saved_new: Any = None

    def __enter__(self) -> LazyInitContext:
        self._mode = _LazyMode()
        self._saved_new = nn.Parameter.__new__
        saved_new = self._saved_new

        def parameter_new(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
            param = saved_new(cls, data, requires_grad)
            if data is not None and hasattr(data, _ATTR):
                setattr(param, _ATTR, getattr(data, _ATTR))
            return param

        nn.Parameter.__new__ = parameter_new  # type: ignore[method-assign]
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._mode is not None
        self._mode.__exit__(exc_type, exc, tb)
        nn.Parameter.__new__ = self._saved_new  # type: ignore[method-assign]
        self._mode = None

    @staticmethod
    def materialize(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
        """Replace every lazy parameter and buffer of ``module`` by its real tensor, in place.

        A parameter :func:`colossal.core.shard_parameter` cut from a lazy tensor (a
        tensor-parallel layer built from a lazy module) becomes only its part: the whole
        tensor is built from its recipe, the part copied out (zero padding after it, as
        ``shard_parameter`` does) and the whole freed before the next one, so at most one
        whole tensor exists at a time. The result keeps its sharding mark. Tied tensors stay
        tied. Returns ``module``.
        """
        done: dict[int, torch.Tensor] = {}
        for sub in module.modules():
            for kind in ("_parameters", "_buffers"):
                table = getattr(sub, kind)
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    source = shard_source(tensor) if tensor.is_meta else None
                    if source is not None and is_lazy(source):
                        if id(tensor) not in done:
                            done[id(tensor)] = _materialize_part(tensor, source, device)
                        table[name] = done[id(tensor)]
                        continue
                    if not is_lazy(tensor):
                        continue
                    if id(tensor) not in done:
                        real = materialize_tensor(tensor).to(device)
                        if isinstance(tensor, nn.Parameter):
                            real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                        done[id(tensor)] = real
                    table[name] = done[id(tensor)]
        return module


def _materialize_part(
    param: torch.Tensor, source: torch.Tensor, device: str | torch.device
) -> torch.Tensor:
    """The real local tensor of ``param``, a shard of the lazy ``source`` (one whole at a time)."""
    spec = shard_spec(param)
    if spec is None:
        raise ValueError(
            f"parameter of shape {tuple(param.shape)} remembers a shard source but carries no "
            "sharding mark; build it with colossal.core.shard_parameter"
        )
    part = spec.part
    full = materialize_tensor(source)
    local = torch.zeros(param.shape, dtype=param.dtype, device=device)
    with torch.no_grad():
        real = part.real(local)
        real.copy_(part.take(full).reshape(real.shape))
    del full
    if isinstance(param, nn.Parameter):
        local = nn.Parameter(local, requires_grad=param.requires_grad)
    return mark_sharded(local, spec.placements, spec.shape)
