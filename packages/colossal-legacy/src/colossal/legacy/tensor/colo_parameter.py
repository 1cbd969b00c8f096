"""``ColoParameter``: a ColoTensor that is a ``torch.nn.Parameter``.

Like torch's parameters of tensor subclasses (FSDP2's DTensors), it is a leaf that requires
grad and carries ``_is_param``, so ``isinstance(p, nn.Parameter)`` holds, modules register it
and torch optimizers step it (its gradient is a DTensor laid out like it).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from colossal.legacy.tensor.colo_tensor import ColoTensor
from colossal.legacy.tensor.tensor_spec import ColoTensorSpec

__all__ = ["ColoParameter"]


class ColoParameter(ColoTensor):
    """A global parameter (see :class:`ColoTensor`); build with :meth:`from_torch_tensor`."""

    __slots__ = ()

    @staticmethod
    def from_torch_tensor(  # type: ignore[override]
        tensor: torch.Tensor, requires_grad: bool = True, spec: ColoTensorSpec | None = None
    ) -> ColoParameter:
        """A leaf ColoParameter whose payload is ``tensor`` (see ``ColoTensor.from_torch_tensor``).

        Raises:
            TypeError: ``tensor`` is a DTensor (pass its ``to_local()``).
        """
        if isinstance(tensor, DTensor):
            raise TypeError(
                "ColoParameter.from_torch_tensor takes a plain tensor, got a "
                f"{type(tensor).__name__}; pass its to_local() payload"
            )
        with torch.no_grad():
            colo = ColoTensor.from_torch_tensor(tensor.detach(), spec)
        colo.requires_grad_(requires_grad)
        param = ColoParameter._adopt(colo, colo.process_group, colo.compute_spec)
        param._is_param = True  # nn.Parameter's isinstance check reads this flag
        return param

    def __repr__(self) -> str:  # type: ignore[override]
        return "ColoParameter containing:\n" + super().__repr__()
