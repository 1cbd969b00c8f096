"""The 3D cube as one layer sees it: which grid axis plays input, weight and output.

``ParallelDims(tp=q**3, tp_mode="3d")`` arranges the tensor-parallel ranks in a q x q x q cube
with the axes ``tp_output`` (outermost), ``tp_weight`` and ``tp_input`` (innermost). A layer
of the 3D algorithm gives each axis a *role*: it all-gathers its input along the input axis,
its weight along the weight axis, and reduce-scatters its output along the output axis.

An activation of width ``h`` and ``n`` rows between 3D layers is laid out in the layer's
orientation: rows in ``q*q`` blocks indexed ``weight * q + input`` (the coordinates along the
weight and input axes), columns in ``q`` blocks indexed by the output-axis coordinate -- the
seed page's partitioning of ``x``. A :class:`~.linear.Linear3D` returns its output with the
input and output roles exchanged (its output columns are indexed by its input axis), so the
next linear layer uses the *swapped* orientation: ColossalAI's ``swap_in_out_group``, kept
here as an explicit ``swapped`` flag instead of a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims

__all__ = ["ROLES", "Cube3D", "check_part", "check_split"]

#: The roles of the cube's axes in one layer.
ROLES = ("input", "weight", "output")


@dataclass(frozen=True)
class Cube3D:
    """The 3D grid of ``dims`` in one orientation (which axis is input and which output).

    Attributes:
        dims: The job's parallel layout; ``tp_mode`` must be ``"3d"``.
        swapped: False: input ``tp_input``, output ``tp_output``; True: the two exchanged.
            The weight axis is always ``tp_weight``.

    Raises:
        ValueError: ``dims.tp_mode`` is not ``"3d"``.
    """

    dims: ParallelDims
    swapped: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims) or self.dims.tp_mode != "3d":
            mode = getattr(self.dims, "tp_mode", None)
            raise ValueError(
                f"3D tensor parallel layers need ParallelDims(tp=q**3, tp_mode='3d'), got "
                f"tp_mode={mode!r}; build the layout with tp_mode='3d'"
            )
        object.__setattr__(self, "swapped", bool(self.swapped))

    @property
    def depth(self) -> int:
        """``q``, the cube's side."""
        return self.dims.tp_grid_shape[0]

    def axis(self, role: str) -> str:
        """The :class:`ParallelDims` axis name playing ``role`` (``"input"``, ...)."""
        if role == "weight":
            return "tp_weight"
        if role == "input":
            return "tp_output" if self.swapped else "tp_input"
        if role == "output":
            return "tp_input" if self.swapped else "tp_output"
        raise ValueError(f"unknown role {role!r}; use one of {ROLES}")

    def group(self, *roles: str) -> ProcessGroup:
        """This rank's group along the axes of ``roles`` (collective on first request)."""
        return self.dims.group(tuple(self.axis(r) for r in roles))

    def coordinate(self, role: str) -> int:
        """This rank's index along the axis of ``role``."""
        return self.dims.coordinate(self.axis(role))

    @property
    def row_block(self) -> int:
        """Index of this rank's row block among ``q*q``: ``weight * q + input``."""
        return self.coordinate("weight") * self.depth + self.coordinate("input")

    def flipped(self) -> Cube3D:
        """The orientation of the next linear layer (input and output exchanged)."""
        return Cube3D(self.dims, not self.swapped)


def check_split(module: str, what: str, size: int, parts: int, cube: Cube3D, fix: str) -> None:
    """Raise ValueError unless ``size`` splits into ``parts`` equal blocks on ``cube``.

    Args:
        module: The layer being built, for the message.
        what: Name of the dimension (``"out_features"``).
        size: Its size.
        parts: How many blocks it is split into (``q`` or ``q*q``).
        cube: The cube (its side is named in the message).
        fix: What the caller can do about it.
    """
    if size % parts != 0:
        q = cube.depth
        how = "q" if parts == q else "q*q"
        raise ValueError(
            f"{module}: {what}={size} is not divisible by {how}={parts} (the 3D cube of "
            f"tp={cube.dims.tp} ranks has side q={q}); {fix}"
        )


def check_part(module: str, x: torch.Tensor, width: int, cube: Cube3D) -> None:
    """Raise ValueError unless ``x``'s last dim is this rank's ``width / q`` columns."""
    if x.dim() == 0 or x.shape[-1] != width // cube.depth:
        raise ValueError(
            f"{module}: the input's last dim is {tuple(x.shape)[-1:]}, but this rank holds "
            f"{width // cube.depth} of the {width} features (q={cube.depth}); pass this rank's "
            "part of the whole activation (split_input_3d(x, dims, swapped))"
        )
