"""``ColoInitContext``: every parameter a module creates inside it becomes a ColoParameter."""

from __future__ import annotations

from types import TracebackType
from typing import cast

import torch
from torch import nn

from colossal.legacy.tensor.colo_parameter import ColoParameter
from colossal.legacy.tensor.distspec import ReplicaSpec, _DistSpec
from colossal.legacy.tensor.module_io import attach_colo_io
from colossal.legacy.tensor.process_group import ProcessGroup
from colossal.legacy.tensor.state import accept_plain_state
from colossal.legacy.tensor.tensor_spec import ColoTensorSpec

__all__ = ["ColoInitContext"]


class ColoInitContext:
    """Turn the parameters of modules built inside into ColoParameters on ``device``.

    The parameters of every module created inside are converted when the context exits, after
    the modules initialised them with torch's generator (so a model built with the same seed
    outside has equal values; DTensor's own random ops would draw differently). They are
    replicated over ``default_pg`` (default ``ProcessGroup()``) unless ``default_dist_spec``
    splits them. The modules built inside that are not part of another one built inside (the
    model, a loss) take and return plain tensors (:func:`~.module_io.attach_colo_io`): the
    operators inside run on DTensor's sharding propagation. Each module built inside takes a
    plain model's whole tensors in ``load_state_dict`` (:func:`~.state.accept_plain_state`).

    Args:
        device: Where the payloads live (default: CPU).
        dtype: Floating-point parameters are cast to it (default: keep).
        default_pg: The process group of the parameters.
        default_dist_spec: Their distributed spec (default ``ReplicaSpec()``).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        default_pg: ProcessGroup | None = None,
        default_dist_spec: _DistSpec | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.default_pg = default_pg
        self.default_dist_spec = default_dist_spec
        self._saved: object = None
        self._created: list[nn.Module] = []

    def _convert(self, value: nn.Parameter) -> ColoParameter:
        """A ColoParameter with ``value``'s data on this context's device."""
        if isinstance(value, ColoParameter):
            return value
        data = value.data.to(self.device)
        if self.dtype is not None and data.is_floating_point():
            data = data.to(self.dtype)
        pg = self.default_pg if self.default_pg is not None else ProcessGroup()
        param = ColoParameter.from_torch_tensor(
            data, value.requires_grad, ColoTensorSpec(pg, ReplicaSpec())
        )
        if self.default_dist_spec is not None:
            param.set_dist_spec(self.default_dist_spec)
        return param

    def __enter__(self) -> ColoInitContext:
        original = nn.Module.__init__
        self._saved = original
        self._created = []
        created = self._created

        def init(module: nn.Module, *args: object, **kwargs: object) -> None:
            original(module, *args, **kwargs)
            created.append(module)

        setattr(nn.Module, "__init__", init)  # noqa: B010 - restored by __exit__
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        setattr(nn.Module, "__init__", self._saved)  # noqa: B010
        if exc_type is not None:
            return
        done: dict[int, ColoParameter] = {}  # tied parameters stay one ColoParameter
        for module in self._created:
            for name, param in list(module._parameters.items()):
                if param is not None:
                    if id(param) not in done:
                        done[id(param)] = self._convert(param)
                    module._parameters[name] = cast(nn.Parameter, done[id(param)])
        inner = {id(sub) for m in self._created for sub in m.modules() if sub is not m}
        for module in self._created:
            accept_plain_state(module)  # load_state_dict on any of them takes whole tensors
            if id(module) not in inner:
                attach_colo_io(module)
