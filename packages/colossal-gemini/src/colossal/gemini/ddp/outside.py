"""Managed parameters used outside the forward of the module that owns them.

The module hooks (``hooks.py``) gather a chunk only around calls of modules that directly own
its parameters. A parameter used anywhere else in the forward (a tied LM head written as
``F.linear(x, self.wte.weight)`` or ``x @ self.wte.weight.t()`` in the root forward, a
sibling's weight read by another module) would then be a released, empty tensor.

:class:`OutsideUseMode` is a ``TorchFunctionMode`` active only during the root forward of
:class:`~colossal.gemini.GeminiDDP`. For each torch operator it looks, cheaply, for an
argument that is either a managed parameter not currently in ``COMPUTE`` (not inside a call of
its own module) or a tensor *derived* from a payload by such an operator (a view such as
``weight.t()``, which keeps using the payload's storage). When it finds one, the runtime
treats the operator as one call, exactly as a module call: gather, record, ``COMPUTE``, run,
``HOLD``, and a multi-grad hook on the outputs so the backward walk gathers the chunk again
before the operator's backward runs (see ``ChunkRuntime.outside_call``).

A chunk whose payload an output aliases stays gathered until the root forward ends (the view
may be read again before then); other chunks follow the module hooks' release rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from torch.overrides import TorchFunctionMode

from colossal.core import METADATA_GETTERS
from colossal.gemini.chunk import TensorState

if TYPE_CHECKING:
    from colossal.gemini.ddp.hooks import ChunkRuntime

logger = logging.getLogger(__name__)

__all__ = ["DERIVED", "METADATA_GETTERS", "OutsideUseMode"]

_COMPUTE = TensorState.COMPUTE


class _Derived:
    """The watch entry of a derived tensor: never in ``COMPUTE`` (always a use)."""

    state = TensorState.HOLD


DERIVED = _Derived()


class OutsideUseMode(TorchFunctionMode):
    """Routes operators on managed parameters used outside their module to the runtime.

    Args:
        runtime: The chunk runtime; its ``watch`` maps ``id(tensor)`` to an object with a
            ``state`` (a parameter's ``TensorInfo`` or :data:`DERIVED`), its ``busy`` flag is
            set while its own hooks run (their operators are never uses).
    """

    def __init__(self, runtime: ChunkRuntime) -> None:
        super().__init__()
        self._rt = runtime

    def __torch_function__(self, func: Callable[..., object], types: Collection[type],
                           args: Sequence[object] = (),
                           kwargs: Mapping[str, object] | None = None) -> object:
        if kwargs is None:
            kwargs = {}
        rt = self._rt
        if not rt.busy:
            watch = rt.watch
            for a in args:
                e = watch.get(id(a))
                if e is not None:
                    if e.state is not _COMPUTE:
                        return rt.outside_call(func, args, kwargs)
                elif type(a) is list or type(a) is tuple:
                    for b in a:
                        e = watch.get(id(b))
                        if e is not None and e.state is not _COMPUTE:
                            return rt.outside_call(func, args, kwargs)
            if kwargs:
                for a in kwargs.values():
                    e = watch.get(id(a))
                    if e is not None and e.state is not _COMPUTE:
                        return rt.outside_call(func, args, kwargs)
        return func(*args, **kwargs)
