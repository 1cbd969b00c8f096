"""A ``DTensor`` (FSDP2, DTensor tensor parallelism) as placements and a sharded tensor.

Each mesh dimension is one axis: ``Shard(d)`` holds torch's even split of the block above
along ``d`` (``ceil(n / size)`` each, the last ranks fewer or none), ``Replicate()`` all of
it. Mesh dimensions apply in order, as torch lays out a tensor sharded twice along one dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from colossal.core.sharded.parts import Block
from colossal.core.sharded.placement import Placement, Replicate
from colossal.core.sharded.protocol import Placed, ShardedTensor

if TYPE_CHECKING:  # imported where used: torch.distributed.tensor loads on first use
    from torch.distributed.tensor import DTensor

__all__ = ["DTensorShard", "dtensor_placements"]


def dtensor_placements(tensor: DTensor, coordinate: tuple[int, ...] | None = None
                       ) -> tuple[Placement, ...]:
    """The placements of a ``DTensor`` (this rank's, or those of mesh ``coordinate``).

    Raises:
        NotImplementedError: A partial or strided placement (not a part of the tensor).
    """
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or tuple(f"mesh{i}" for i in range(mesh.ndim))
    # get_coordinate() is None only off the mesh, where no rank holds a part of the DTensor
    coords = coordinate if coordinate is not None else tuple(cast(list[int], mesh.get_coordinate()))
    above = tuple(tensor.shape)
    out: list[Placement] = []
    for dim, placement in enumerate(tensor.placements):
        group = mesh.get_group(dim)
        if isinstance(placement, TorchReplicate):
            out.append(Placement(names[dim], Replicate(), group))
            continue
        if type(placement) is not Shard or not above:
            raise NotImplementedError(
                f"a DTensor with placements {tuple(tensor.placements)} is not a part of its "
                "tensor; use Shard(dim) or Replicate() placements (redistribute partial sums)"
            )
        d = placement.dim % len(above)
        size = mesh.size(dim)
        chunk = -(-above[d] // size)
        lo = min(above[d], coords[dim] * chunk)
        block = Block.along(above, d, lo, min(above[d], lo + chunk))
        out.append(Placement(names[dim], block, group))
        above = tuple(block.sizes)
    return tuple(out)


class DTensorShard(Placed):
    """A ``DTensor`` as a sharded tensor: its mesh dimensions are its axes.

    Args:
        tensor: The DTensor (``shape`` and ``dtype`` are its global ones). Typed ``Any`` until
            the meta-package's ``checkpoint_io.sharded`` passes it as a ``DTensor`` (today an
            ``isinstance`` against a ``type`` narrows it to ``object`` only).

    Raises:
        NotImplementedError: Partial or strided placements.
    """

    def __init__(self, tensor: Any) -> None:
        self.tensor: DTensor = tensor
        self._placements = dtensor_placements(tensor)

    @property
    def shape(self) -> torch.Size:
        """The global shape."""
        return self.tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype."""
        return self.tensor.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dimension."""
        return self._placements

    def local(self) -> torch.Tensor:
        """This rank's local tensor (shares storage with the DTensor)."""
        return self.tensor.to_local()

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The full CPU tensor on global rank ``dst`` (every rank when None); collective."""
        if dst is None:
            return self.tensor.full_tensor().cpu()  # every rank joins the all-gather
        full = super().gather(dst)
        return full.cpu() if full is not None else None

    def wrap(self, local: torch.Tensor) -> DTensor:
        """A DTensor laid out like this one, holding ``local`` (this rank's part)."""
        from torch.distributed.tensor import DTensor

        mine = self.tensor.to_local()
        return DTensor.from_local(
            local.to(mine.device).reshape(mine.shape),
            self.tensor.device_mesh,
            self.tensor.placements,
            shape=self.tensor.shape,
            stride=self.tensor.stride(),
            run_check=False,
        )

    def __repr__(self) -> str:
        return f"DTensorShard(shape={tuple(self.shape)}, placements={list(self._placements)})"


if TYPE_CHECKING:  # a type checker verifies that these implement the protocol

    def _implements(tensor: DTensorShard) -> ShardedTensor:
        return tensor
