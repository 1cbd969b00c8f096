"""The 2D, 2.5D and 3D modes as the model integration sees them: one adapter per mode.

Each :class:`GridMode` wraps a :class:`~colossal.core.ParallelDims` with a grid ``tp_mode``
and answers, for that mode's layers (:mod:`colossal.shardformer.layer.tp2d`, ``tp2p5d``,
``tp3d``), what the integration needs: how the activation of a transformer block is split
(batch over :attr:`batch_parts` ranks, hidden over :attr:`q`), which grid axis holds the
hidden split and which the batch split (for the norms written here), the split/gather helpers,
and the mode's ``Linear``/``LayerNorm``/``Dropout`` built from a native module.

Roles of a linear layer in a block: ``"in"`` reads the block's hidden state (q/k/v, the MLP's
up projections), ``"out"`` writes back to it (the attention output, the MLP's down projection).
Only 3D cares: its ``Linear3D`` swaps the cube's input and output axes, so an ``"in"`` layer
takes the block's layout and returns the swapped one, where attention runs, and an ``"out"``
layer takes the swapped one back (:attr:`attention_swapped`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from colossal.core import ParallelDims

__all__ = ["GRID_MODES", "Grid2DMode", "Grid2p5DMode", "Grid3DMode", "GridMode", "grid_mode"]

LinearFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``fn(x, weight, bias)``: a mode's linear op with a layer's grid bound."""


class GridMode(ABC):
    """One grid mode bound to a layout.

    Args:
        dims: The job's layout; its ``tp_mode`` is this mode's.
    """

    name: str = ""
    batch_how: str = ""
    hidden_axis: str = ""
    batch_axes: tuple[str, ...] = ()

    def __init__(self, dims: ParallelDims) -> None:
        if dims.tp_mode != self.name:
            raise ValueError(
                f"{type(self).__name__} needs ParallelDims(tp_mode={self.name!r}), got "
                f"tp_mode={dims.tp_mode!r}"
            )
        self.dims = dims

    @property
    def q(self) -> int:
        """Parts the hidden dim (and the attention heads) are split into."""
        return self.dims.tp_grid_shape[-1]

    @property
    def batch_parts(self) -> int:
        """Parts the batch dim is split into."""
        return self.dims.tp // self.q

    @property
    def width_parts(self) -> tuple[int, str]:
        """What the hidden and MLP widths must divide by (the mode's norms and biases)."""
        return self.q * self.q, "q*q"

    def describe(self) -> str:
        """The grid in words, for messages."""
        shape = " x ".join(str(s) for s in self.dims.tp_grid_shape)
        return f"a {shape} grid of tp={self.dims.tp} ranks, q={self.q}"

    # ---- activations -------------------------------------------------------------------------
    @abstractmethod
    def split_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part ``(B/batch_parts, ..., H/q)`` of a whole hidden state."""

    @abstractmethod
    def gather_hidden(self, y: torch.Tensor) -> torch.Tensor:
        """The whole hidden state from every rank's part (inverse of :meth:`split_hidden`)."""

    @abstractmethod
    def split_attention_batch(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows (dim 0) of a whole per-sample tensor, in attention's layout."""

    # ---- layers ------------------------------------------------------------------------------
    @abstractmethod
    def linear(self, native: nn.Linear, role: str) -> nn.Module:
        """The mode's linear layer holding this rank's part of ``native``."""

    @abstractmethod
    def linear_fn(self, layer: nn.Module) -> LinearFn:
        """``fn(x, weight, bias)`` of the mode's linear op with ``layer``'s grid."""

    @abstractmethod
    def layer_norm(self, native: nn.LayerNorm) -> nn.Module:
        """The mode's LayerNorm holding this rank's part of ``native``."""

    @abstractmethod
    def dropout(self, p: float, inplace: bool) -> nn.Module:
        """Dropout of a partitioned activation (a seed per rank)."""


class Grid2DMode(GridMode):
    """2D (SUMMA): activation ``[B/q, S, H/q]``, rows along ``tp_col``, hidden along ``tp_row``."""

    name = "2d"
    batch_how = "q"
    hidden_axis = "tp_row"
    batch_axes = ("tp_col",)

    def split_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.split_hidden`."""
        from colossal.shardformer.layer.tp2d import split_input_2d

        return split_input_2d(x, self.dims)

    def gather_hidden(self, y: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.gather_hidden`."""
        from colossal.shardformer.layer.tp2d import gather_output_2d

        return gather_output_2d(y, self.dims)

    def split_attention_batch(self, t: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.split_attention_batch`."""
        from colossal.shardformer.layer.tp2d import split_batch_2d

        return split_batch_2d(t, self.dims)

    def linear(self, native: nn.Linear, role: str) -> nn.Module:
        """See :meth:`GridMode.linear`."""
        from colossal.shardformer.layer.tp2d import Linear2D

        return Linear2D.from_native_module(native, self.dims)

    def linear_fn(self, layer: nn.Module) -> LinearFn:
        """See :meth:`GridMode.linear_fn`."""
        from colossal.shardformer.layer.tp2d import Linear2D, linear_2d

        assert isinstance(layer, Linear2D), type(layer)
        grid = layer.grid
        return lambda x, w, b: linear_2d(x, w, b, grid)

    def layer_norm(self, native: nn.LayerNorm) -> nn.Module:
        """See :meth:`GridMode.layer_norm`."""
        from colossal.shardformer.layer.tp2d import LayerNorm2D

        return LayerNorm2D.from_native_module(native, self.dims)

    def dropout(self, p: float, inplace: bool) -> nn.Module:
        """See :meth:`GridMode.dropout`."""
        from colossal.shardformer.layer.tp2d import Dropout2D

        return Dropout2D(p, inplace, dims=self.dims)


class Grid2p5DMode(GridMode):
    """2.5D (Tesseract): ``[B/(d q), S, H/q]``, rows along ``tp_dep`` x ``tp_col``."""

    name = "2.5d"
    batch_how = "d*q"
    hidden_axis = "tp_row"
    batch_axes = ("tp_dep", "tp_col")

    @property
    def width_parts(self) -> tuple[int, str]:
        """Linear outputs, biases and norms split ``q`` ways."""
        return self.q, "q"

    def split_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.split_hidden`."""
        from colossal.shardformer.layer.tp2p5d import split_input_2p5d

        return split_input_2p5d(x, self.dims)

    def gather_hidden(self, y: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.gather_hidden`."""
        from colossal.shardformer.layer.tp2p5d import gather_output_2p5d

        return gather_output_2p5d(y, self.dims)

    def split_attention_batch(self, t: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.split_attention_batch`."""
        from colossal.shardformer.layer.tp2p5d import split_batch_2p5d

        return split_batch_2p5d(t, self.dims)

    def linear(self, native: nn.Linear, role: str) -> nn.Module:
        """See :meth:`GridMode.linear`."""
        from colossal.shardformer.layer.tp2p5d import Linear2p5D

        return Linear2p5D.from_native_module(native, self.dims)

    def linear_fn(self, layer: nn.Module) -> LinearFn:
        """See :meth:`GridMode.linear_fn`."""
        from colossal.shardformer.layer.tp2p5d import Linear2p5D, linear_2p5d

        assert isinstance(layer, Linear2p5D), type(layer)
        grid = layer.grid
        return lambda x, w, b: linear_2p5d(x, w, b, grid)

    def layer_norm(self, native: nn.LayerNorm) -> nn.Module:
        """See :meth:`GridMode.layer_norm`."""
        from colossal.shardformer.layer.tp2p5d import LayerNorm2p5D

        return LayerNorm2p5D.from_native_module(native, self.dims)

    def dropout(self, p: float, inplace: bool) -> nn.Module:
        """See :meth:`GridMode.dropout`."""
        from colossal.shardformer.layer.tp2p5d import Dropout2p5D

        return Dropout2p5D(p, inplace, dims=self.dims)


class Grid3DMode(GridMode):
    """3D: ``[B/q^2, S, H/q]``.

    The block's layout is the cube's unswapped orientation (hidden along ``tp_output``, rows
    along ``tp_weight`` x ``tp_input``); attention runs in the swapped one (the ``"in"``
    projections' output).
    """

    name = "3d"
    batch_how = "q*q"
    hidden_axis = "tp_output"
    batch_axes = ("tp_weight", "tp_input")
    attention_swapped = True

    def split_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.split_hidden`."""
        from colossal.shardformer.layer.tp3d import split_input_3d

        return split_input_3d(x, self.dims, swapped=False)

    def gather_hidden(self, y: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.gather_hidden`."""
        from colossal.shardformer.layer.tp3d import gather_output_3d

        return gather_output_3d(y, self.dims, swapped=False)

    def split_attention_batch(self, t: torch.Tensor) -> torch.Tensor:
        """See :meth:`GridMode.split_attention_batch` (the swapped orientation's rows)."""
        from colossal.shardformer.layer.tp3d import split_batch_3d

        return split_batch_3d(t, self.dims, swapped=self.attention_swapped)

    def linear(self, native: nn.Linear, role: str) -> nn.Module:
        """See :meth:`GridMode.linear` (``"out"`` layers read the swapped orientation)."""
        from colossal.shardformer.layer.tp3d import Linear3D

        return Linear3D.from_native_module(native, self.dims, swapped=role == "out")

    def linear_fn(self, layer: nn.Module) -> LinearFn:
        """See :meth:`GridMode.linear_fn`."""
        from colossal.shardformer.layer.tp3d import Linear3D
        from colossal.shardformer.layer.tp3d.functional import linear_3d

        assert isinstance(layer, Linear3D), type(layer)
        cube = layer.cube
        return lambda x, w, b: linear_3d(x, w, b, cube)

    def layer_norm(self, native: nn.LayerNorm) -> nn.Module:
        """See :meth:`GridMode.layer_norm`."""
        from colossal.shardformer.layer.tp3d import LayerNorm3D

        return LayerNorm3D.from_native_module(native, self.dims, swapped=False)

    def dropout(self, p: float, inplace: bool) -> nn.Module:
        """See :meth:`GridMode.dropout`."""
        from colossal.shardformer.layer.tp3d import Dropout3D

        return Dropout3D(p, inplace, dims=self.dims)


GRID_MODES: dict[str, type[GridMode]] = {"2d": Grid2DMode, "2.5d": Grid2p5DMode, "3d": Grid3DMode}
"""``tensor_parallel_mode`` -> its adapter."""


def grid_mode(dims: ParallelDims) -> GridMode:
    """The adapter of ``dims.tp_mode``.

    Raises:
        ValueError: ``dims`` has no grid ``tp_mode``.
    """
    cls = GRID_MODES.get(dims.tp_mode or "")
    if cls is None:
        raise ValueError(
            f"tp_mode={dims.tp_mode!r} is not a grid mode; use one of {sorted(GRID_MODES)}"
        )
    return cls(dims)
