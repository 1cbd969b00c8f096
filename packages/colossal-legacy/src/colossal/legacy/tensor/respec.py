"""Changing a DTensor's placements in place, recorded by autograd.

``set_dist_spec`` keeps the tensor object (the seeds change a ColoTensor in place). A leaf
(a parameter) is re-laid out without a graph, as the seeds do, and keeps its gradient laid out
like itself; a tensor inside a graph is changed by :class:`_InPlaceRedistribute`, whose backward
runs the reverse redistribution (DTensor's ``redistribute``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["relayout_"]


def _moved(t: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> DTensor:
    """``t`` on ``mesh`` with ``placements`` (a new mesh needs ``t`` replicated everywhere).

    Raises:
        TypeError: ``t`` is not a DTensor (a plain gradient reached a ColoTensor).
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        raise TypeError(
            f"expected a DTensor to lay out as {placements}, got a {type(t).__name__}: mix "
            "ColoTensors only with ColoTensors/DTensors (ColoTensor.from_torch_tensor)"
        )

    if t.device_mesh is mesh:
        return t.redistribute(mesh, placements)
    whole = t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()
    everywhere = [Replicate()] * mesh.ndim
    return DTensor.from_local(whole, mesh, everywhere, run_check=False).redistribute(
        mesh, placements
    )


def _swap(t: DTensor, new: DTensor) -> None:
    """Make ``t`` hold ``new``'s local tensor and layout (same global shape)."""
    t._local_tensor = new._local_tensor
    t._spec = new._spec


class _InPlaceRedistribute(torch.autograd.Function):
    """Forward: relayout in place; backward: the gradient back to the old layout."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        t: DTensor,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
    ) -> DTensor:
        ctx.old = (t.device_mesh, tuple(t.placements))  # type: ignore[attr-defined]
        _swap(t, _moved(t.detach(), mesh, placements))
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: DTensor
    ) -> tuple[DTensor, None, None]:
        mesh, placements = ctx.old  # type: ignore[attr-defined]
        return _moved(grad, mesh, placements), None, None


def relayout_(t: DTensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> None:
    """Lay ``t`` out as ``placements`` on ``mesh``, in place (see the module docstring)."""
    if t.device_mesh is mesh and tuple(t.placements) == tuple(placements):
        return
    if t.requires_grad and t.grad_fn is not None:
        _InPlaceRedistribute.apply(t, mesh, placements)
        return
    with torch.no_grad():
        _swap(t, _moved(t.detach(), mesh, placements))
        if t.grad is not None:
            t.grad = _moved(t.grad, mesh, placements)
