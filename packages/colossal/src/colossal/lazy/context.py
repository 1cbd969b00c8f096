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

Moving or casting a lazy tensor (``.to(...)``, ``.cuda()``, ``.cpu()``, ``.half()``...) is
recorded, not run, as ColossalAI's LazyTensor does: materializing builds the tensor and then
moves or casts it. That holds for a whole lazy model too: after the first context,
``nn.Module._apply`` (behind ``Module.to/cuda/cpu/half/float/...``) records the conversion of
a model's lazy tensors instead of failing with "Cannot copy out of meta tensor"; models
without lazy tensors take the unchanged path.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from colossal.core import mark_sharded, shard_source, shard_spec

logger = logging.getLogger(__name__)

__all__ = ["LazyInitContext", "is_lazy", "lazy_to", "materialize_tensor"]

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


@dataclass(frozen=True)
class _Ref:
    """A lazy argument of a recorded op, frozen to the recipe it had when the op ran.

    Holding the recipe rather than the tensor matters when a tensor's recipe is replaced
    later (a parameter moved by ``Module.to`` keeps its object and gets a new recipe that
    reads the old one): the recorded op must not read the new recipe, or it would loop.
    """

    info: _Info


def _freeze(value: Any) -> Any:
    return _Ref(getattr(value, _ATTR)) if is_lazy(value) else value


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
    if isinstance(value, _Ref):
        return _materialize_info(value.info)
    if is_lazy(value):
        return materialize_tensor(value)
    return value


def _materialize_info(info: _Info) -> torch.Tensor:
    return _apply_chain(_realize(info.root), info.chain).clone()


def materialize_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A real tensor equal to what eager init would have produced for ``tensor``.

    On the CPU unless a recorded move (``.to(device)``, ``.cuda()``) put it elsewhere.
    """
    return _materialize_info(getattr(tensor, _ATTR))


_MOVES = {"to", "cuda", "cpu"}


def _is_device(value: object) -> bool:
    return isinstance(value, (str, torch.device)) or (
        isinstance(value, int) and not isinstance(value, bool)
    )


def _record_move(func: Any, name: str, first: torch.Tensor, args: tuple, kwargs: dict) -> Any:
    """``first.to(...)`` / ``.cuda()`` / ``.cpu()`` on a lazy tensor, recorded for later.

    The result is a meta tensor of the target dtype whose recipe materializes ``first`` and
    then runs the move; a ``to`` that changes nothing returns ``first`` as torch does.
    """
    moved = name != "to"  # cuda() and cpu() always name a device

    def meta(value: object) -> object:
        nonlocal moved
        if _is_device(value):
            moved = True
            return torch.device("meta")
        if isinstance(value, torch.Tensor):  # to(other): other's dtype and device
            moved = True
            return torch.empty(0, dtype=value.dtype, device="meta")
        return value

    if name == "to":
        meta_args = [meta(a) for a in args]
        meta_kwargs = {k: meta(v) if k in ("device", "other") else v for k, v in kwargs.items()}
        out = func(first, *meta_args, **meta_kwargs)
    else:
        out = first
    if out is first:
        if not moved:
            return first
        out = first.clone()
    source = _Ref(getattr(first, _ATTR))
    frozen_args, frozen_kwargs = tree_map(_freeze, args), tree_map(_freeze, kwargs)
    recipe = lambda: func(  # noqa: E731
        _to_real(source), *tree_map(_to_real, frozen_args), **tree_map(_to_real, frozen_kwargs)
    )
    setattr(out, _ATTR, _Info(_Root(recipe), []))
    return out


class _LazyMode(TorchFunctionMode):
    _busy = False

    def __init__(self, factories: bool = True) -> None:
        super().__init__()
        self._factories = factories

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
        if name in _MOVES and is_lazy(first):
            assert isinstance(first, torch.Tensor)
            self._busy = True
            try:
                return _record_move(func, name, first, args[1:], kwargs)
            finally:
                self._busy = False
        if self._factories and _is_factory(func, name, args, kwargs):
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
                real_args, real_kwargs = tree_map(_freeze, args), tree_map(_freeze, kwargs)
                recipe = lambda f=func, a=real_args, k=real_kwargs: f(  # noqa: E731
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
            frozen = (tree_map(_freeze, args), tree_map(_freeze, kwargs))
            info.root.ops.append((info.chain, func, *frozen, state))
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
    full tensor at a time and keeps only this rank's shard. ``model.to(...)``,
    ``model.cuda()``, ``model.half()``... before ``boost`` are recorded and replayed when the
    model is materialized (as in ColossalAI).

    Args:
        default_device: Ignored placeholder for ColossalAI compatibility (tensors are meta
            inside the context, CPU when materialized).
    """

    def __init__(self, default_device: str | torch.device | None = None) -> None:
        self.default_device = default_device
        self._mode: _LazyMode | None = None
        self._saved_new: Any = None
        self._factories = True

    def __enter__(self) -> LazyInitContext:
        _install_apply_hook()
        self._mode = _LazyMode(self._factories)
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
    def materialize(
        module: nn.Module, device: str | torch.device | None = None, verbose: bool = False
    ) -> nn.Module:
        """Replace every lazy parameter and buffer of ``module`` by its real tensor, in place.

        ``device``: where the real tensors go; None (default) leaves them where their
        recorded moves put them (the CPU unless ``.to(device)``/``.cuda()`` was called).
        ``verbose`` (ColossalAI's argument) prints, on rank 0, how many parameters and
        buffers were lazy and the size of the tensors that were real already.

        A parameter :func:`colossal.core.shard_parameter` cut from a lazy tensor (a
        tensor-parallel layer built from a lazy module) becomes only its part: the whole
        tensor is built from its recipe, the part copied out (zero padding after it, as
        ``shard_parameter`` does) and the whole freed before the next one, so at most one
        whole tensor exists at a time. The result keeps its sharding mark. Tied tensors stay
        tied. Returns ``module``.
        """
        if verbose:
            _report(module)
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
                        real = materialize_tensor(tensor)
                        real = real.to(device) if device is not None else real
                        if isinstance(tensor, nn.Parameter):
                            real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                        done[id(tensor)] = real
                    table[name] = done[id(tensor)]
        return module


def _materialize_part(
    param: torch.Tensor, source: torch.Tensor, device: str | torch.device | None
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


def lazy_to(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """``tensor.to(*args, **kwargs)`` that keeps a lazy tensor lazy (the move is recorded).

    A real tensor is converted at once. Example: casting a lazy model's buffers to bf16
    before a plugin shards it, without materializing them.
    """
    if not is_lazy(tensor):
        return tensor.to(*args, **kwargs)  # type: ignore[call-overload]
    return _record_move(torch.Tensor.to, "to", tensor, args, kwargs)


def _report(module: nn.Module) -> None:
    """ColossalAI's ``materialize(verbose=True)`` lines, printed on rank 0."""
    params, buffers = list(module.parameters()), list(module.buffers())
    lazy_params = sum(is_lazy(p) for p in params)
    lazy_buffers = sum(is_lazy(b) for b in buffers)
    real = [t for t in [*params, *buffers] if not is_lazy(t)]
    numel = sum(t.numel() for t in real)
    size_mb = sum(t.numel() * t.element_size() for t in real) / 1024**2
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"Param lazy rate: {lazy_params}/{len(params)}")
        print(f"Buffer lazy rate: {lazy_buffers}/{len(buffers)}")
        print(f"Non-lazy numel: {numel} ({size_mb:.3f} MB)")


_ORIGINAL_APPLY: Callable[..., nn.Module] | None = None
_APPLYING = threading.local()


def _has_lazy(module: nn.Module) -> bool:
    return any(is_lazy(t) for t in [*module.parameters(), *module.buffers()])


def _install_apply_hook() -> None:
    """Make ``nn.Module._apply`` (``to``, ``cuda``, ``half``...) record on lazy models.

    Installed once, by the first ``LazyInitContext``; a model without lazy tensors costs one
    scan of its tensors per top-level call and takes the original path.
    """
    global _ORIGINAL_APPLY
    if _ORIGINAL_APPLY is not None:
        return
    original = nn.Module._apply
    _ORIGINAL_APPLY = original

    @functools.wraps(original)
    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any,
               **kwargs: Any) -> nn.Module:  # fmt: skip
        if getattr(_APPLYING, "active", False) or not _has_lazy(self):
            return original(self, fn, *args, **kwargs)
        return _apply_recording(self, original, fn, args, kwargs)

    nn.Module._apply = _apply  # type: ignore[method-assign]


def _apply_recording(
    module: nn.Module,
    original: Callable[..., nn.Module],
    fn: Callable[[torch.Tensor], torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> nn.Module:
    """Run ``module._apply(fn)`` with ``fn``'s ops on lazy tensors recorded, not run."""
    replaced: list[tuple[torch.Tensor, _Info]] = []

    def recording_fn(tensor: torch.Tensor) -> torch.Tensor:
        out = fn(tensor)
        if is_lazy(tensor) and out is not tensor and is_lazy(out):
            replaced.append((tensor, getattr(out, _ATTR)))
        return out

    context = LazyInitContext()
    context._factories = False  # only ops on lazy tensors are recorded here
    _APPLYING.active = True
    try:
        with context:
            result = original(module, recording_fn, *args, **kwargs)
    finally:
        _APPLYING.active = False
    for tensor, info in replaced:  # a parameter kept by `param.data = moved` takes its recipe
        if tensor.is_meta:
            setattr(tensor, _ATTR, info)
    return result
