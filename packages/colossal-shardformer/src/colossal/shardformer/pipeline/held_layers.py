"""The layer stack of one pipeline stage: only its layers, under their original indices."""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

from torch import nn

__all__ = ["HeldLayers"]


class HeldLayers(nn.ModuleList):
    """An ``nn.ModuleList`` holding a slice of a model's layers under their global indices.

    ``_modules`` keys are the original indices, so ``state_dict`` names stay Hugging Face's
    (``model.layers.5.self_attn...``), while integer indexing, slicing, ``len`` and iteration
    see the held layers in order (``layers[0]`` is this stage's first layer), as the model's
    own ``for layer in self.layers`` expects.

    Args:
        layers: ``(global index, layer)`` pairs in order.
    """

    def __init__(self, layers: Iterable[tuple[int, nn.Module]] | None = None) -> None:
        nn.Module.__init__(self)
        for index, layer in layers or ():
            self.add_module(str(index), layer)

    @property
    def global_indices(self) -> list[int]:
        """The original indices of the held layers, in order."""
        return [int(k) for k in self._modules]

    @overload
    def __getitem__(self, idx: slice) -> nn.ModuleList: ...

    @overload
    def __getitem__(self, idx: int) -> nn.Module: ...

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return nn.ModuleList(values[idx])
        return values[idx]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        key = list(self._modules)[idx]
        self.add_module(key, module)

    def __delitem__(self, idx: int | slice) -> None:
        raise TypeError("a pipeline stage's held layers cannot be deleted")

    def append(self, module: nn.Module) -> HeldLayers:
        """Append after the last held layer (its index + 1)."""
        nxt = (self.global_indices[-1] + 1) if len(self) else 0
        self.add_module(str(nxt), module)
        return self

    def extra_repr(self) -> str:
        """The held global indices, for ``repr``."""
        idx = self.global_indices
        return f"global layers {idx[0]}..{idx[-1]}" if idx else "no layers"
