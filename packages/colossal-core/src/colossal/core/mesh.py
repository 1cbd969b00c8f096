"""A named N-dimensional grid of ranks with one process group per line along each axis."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from datetime import timedelta
from typing import overload

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.core.group_lifetime import keep_alive
from colossal.core.launch import default_timeout

Axis = int | str


class ProcessGroupMesh:
    """Ranks laid out row-major on a grid of ``sizes``; groups along any axis or axes.

    ``ProcessGroupMesh(2, 2, axis_names=("dp", "tp"))`` on 4 ranks puts rank ``r`` at
    coordinate ``(r // 2, r % 2)``. ``get_group_along_axis("tp")`` returns the group of ranks
    that differ only in their ``tp`` coordinate. Creating a group is collective, so every rank
    creates every group along the requested axes, in the same order, and caches them; each
    rank must therefore ask for the same axes in the same order.

    Args:
        *sizes: Extent of each axis; their product must equal the world size.
        axis_names: Optional unique name per axis.
        backend: Backend for the new groups (the default group's when ``None``).
        timeout: Timeout for the new groups (the default group's when ``None``).

    Raises:
        ValueError: Non-positive sizes, a product that is not the world size, or names that
            do not match the axes.
    """

    def __init__(
        self,
        *sizes: int,
        axis_names: Sequence[str] | None = None,
        backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupMesh needs torch.distributed initialized; call launch first"
            )
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"mesh sizes must be positive ints, got {sizes}")
        world = dist.get_world_size()
        if math.prod(sizes) != world:
            raise ValueError(
                f"mesh sizes {tuple(sizes)} multiply to {math.prod(sizes)}, but the world size "
                f"is {world}; choose sizes whose product is {world}"
            )
        if axis_names is not None:
            axis_names = tuple(axis_names)
            if len(axis_names) != len(sizes) or len(set(axis_names)) != len(axis_names):
                raise ValueError(
                    f"axis_names {axis_names} must be {len(sizes)} unique names, "
                    f"one per axis of {sizes}"
                )
        self._shape = tuple(sizes)
        self._names = axis_names
        self._rank = dist.get_rank()
        self._coord = self.unravel(self._rank, self._shape)
        self._backend = backend
        self._timeout = timeout or default_timeout()
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}

    # ---- geometry ---------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """Extent of each axis."""
        return self._shape

    @property
    def axis_names(self) -> tuple[str, ...] | None:
        """Names of the axes, if given."""
        return self._names

    @property
    def rank(self) -> int:
        """Global rank of this process."""
        return self._rank

    def axis_index(self, axis: Axis) -> int:
        """Index of ``axis`` given by index or name.

        Raises:
            ValueError: Unknown name or out-of-range index.
        """
        if isinstance(axis, str):
            if self._names is None or axis not in self._names:
                raise ValueError(
                    f"unknown mesh axis {axis!r}; the axes are {self._names or 'unnamed'}"
                )
            return self._names.index(axis)
        if not isinstance(axis, int) or not -len(self._shape) <= axis < len(self._shape):
            raise ValueError(f"mesh axis {axis!r} out of range for a {len(self._shape)}-d mesh")
        return axis % len(self._shape)

    @overload
    def size(self, axis: None = None) -> tuple[int, ...]: ...
    @overload
    def size(self, axis: Axis) -> int: ...
    def size(self, axis: Axis | None = None) -> int | tuple[int, ...]:
        """Extent of ``axis``, or the whole shape when ``None``."""
        return self._shape if axis is None else self._shape[self.axis_index(axis)]

    @overload
    def coordinate(self, axis: None = None) -> tuple[int, ...]: ...
    @overload
    def coordinate(self, axis: Axis) -> int: ...
    def coordinate(self, axis: Axis | None = None) -> int | tuple[int, ...]:
        """This rank's coordinate along ``axis``, or all of them when ``None``."""
        return self._coord if axis is None else self._coord[self.axis_index(axis)]

    @staticmethod
    def unravel(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """Coordinate of ``rank`` in a row-major grid of ``shape`` (inverse of :meth:`ravel`).

        Raises:
            ValueError: ``rank`` is outside ``[0, prod(shape))``.
        """
        if not 0 <= rank < math.prod(shape):
            raise ValueError(f"rank {rank} is outside a grid of shape {tuple(shape)}")
        coord = []
        for extent in reversed(shape):
            coord.append(rank % extent)
            rank //= extent
        return tuple(reversed(coord))

    @staticmethod
    def ravel(coord: Sequence[int], shape: Sequence[int], mode: str = "raise") -> int:
        """Rank at ``coord`` in a row-major grid of ``shape`` (ColossalAI's signature).

        Args:
            coord: One index per axis.
            shape: Extent of each axis.
            mode: What an index outside its axis does, as ``numpy.ravel_multi_index``:
                ``"raise"`` (a ValueError), ``"wrap"`` (modulo the extent) or ``"clip"``
                (to the nearest end).

        Raises:
            ValueError: ``coord`` and ``shape`` differ in length, an unknown ``mode``, or an
                index out of range with ``mode="raise"``.
        """
        if mode not in ("raise", "wrap", "clip"):
            raise ValueError(f"ravel: mode={mode!r} must be 'raise', 'wrap' or 'clip'")
        if len(coord) != len(shape):
            raise ValueError(
                f"ravel: coordinate {tuple(coord)} does not match shape {tuple(shape)}"
            )
        rank = 0
        for c, extent in zip(coord, shape, strict=True):
            if not 0 <= c < extent:
                if mode == "raise":
                    raise ValueError(
                        f"ravel: coordinate {tuple(coord)} is outside shape {tuple(shape)}; "
                        "pass mode='wrap' or 'clip' to fold it in"
                    )
                c = c % extent if mode == "wrap" else min(max(c, 0), extent - 1)
            rank = rank * extent + c
        return rank

    @staticmethod
    def get_coords_along_axis(
        base_coord: Sequence[int],
        axis: int | Sequence[int],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]],
    ) -> list[tuple[int, ...]]:
        """``base_coord`` with its index on ``axis`` replaced by each of ``indices_at_axis``.

        Several axes take one index list each (their product, the first axis outermost).
        """
        axes = [axis] if isinstance(axis, int) else list(axis)
        lists = _index_lists(axes, indices_at_axis)
        coords = [tuple(base_coord)]
        for ax, indices in zip(axes, lists, strict=True):
            coords = [c[:ax] + (i,) + c[ax + 1 :] for c in coords for i in indices]
        return coords

    def _axes(self, axis: Axis | Sequence[Axis]) -> tuple[int, ...]:
        axes = (axis,) if isinstance(axis, (int, str)) else tuple(axis)
        idx = tuple(self.axis_index(a) for a in axes)
        if len(set(idx)) != len(idx):
            raise ValueError(f"axes {axes} repeat an axis")
        return idx

    def ranks_along_axis(
        self, axis: Axis | Sequence[Axis], coord: Sequence[int] | None = None
    ) -> list[int]:
        """Ranks sharing ``coord`` (this rank's by default) on every axis except ``axis``."""
        axes = self._axes(axis)
        base = list(self._coord if coord is None else coord)
        ranks = []
        for values in itertools.product(*(range(self._shape[a]) for a in axes)):
            for a, v in zip(axes, values, strict=True):
                base[a] = v
            ranks.append(self.ravel(base, self._shape))
        return sorted(ranks)

    def all_groups_along_axis(self, axis: Axis | Sequence[Axis]) -> list[list[int]]:
        """Every group of ranks along ``axis``, in a deterministic order."""
        axes = self._axes(axis)
        others = [a for a in range(len(self._shape)) if a not in axes]
        groups = []
        for values in itertools.product(*(range(self._shape[a]) for a in others)):
            coord = [0] * len(self._shape)
            for a, v in zip(others, values, strict=True):
                coord[a] = v
            groups.append(self.ranks_along_axis(axes, coord))
        return groups

    # ---- groups -------------------------------------------------------------------------
    def get_group(self, ranks: Sequence[int], backend: str | None = None) -> ProcessGroup:
        """The cached group of ``ranks``, created collectively if new (all ranks must call).

        A rank outside ``ranks`` gets torch's non-member marker. ``backend`` overrides the
        mesh's backend for a new group.
        """
        key = tuple(sorted(ranks))
        if key not in self._groups:
            group = dist.new_group(
                list(key), backend=backend or self._backend, timeout=self._timeout
            )
            self._groups[key] = keep_alive(group)  # never freed mid-run: see group_lifetime
        return self._groups[key]

    def create_group_along_axis(
        self,
        axis: Axis | Sequence[Axis],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
    ) -> ProcessGroup | None:
        """Create every group along ``axis`` and return this rank's (ColossalAI's method).

        Args:
            axis: An axis (index or name) or several.
            indices_at_axis: Only these indices on the axis (one list per axis when several),
                e.g. ``[0, pp - 1]`` for the first and last stage; all of them when None.
            backend: Backend of the new groups (the mesh's by default).

        Returns:
            The group holding this rank, or None when this rank's index on ``axis`` is not
            among ``indices_at_axis``.

        Raises:
            ValueError: An unknown axis, or an index outside its axis.
        """
        axes = self._axes(axis)
        lists = _index_lists(axes, indices_at_axis, self._shape)
        others = [a for a in range(len(self._shape)) if a not in axes]
        mine: ProcessGroup | None = None
        for values in itertools.product(*(range(self._shape[a]) for a in others)):
            base = [0] * len(self._shape)
            for a, v in zip(others, values, strict=True):
                base[a] = v
            coords = self.get_coords_along_axis(base, list(axes), lists)
            ranks = [self.ravel(c, self._shape) for c in coords]
            group = self.get_group(ranks, backend)
            if self._rank in ranks:
                mine = group
        return mine

    def get_group_along_axis(
        self,
        axis: Axis | Sequence[Axis],
        indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None = None,
        backend: str | None = None,
    ) -> ProcessGroup:
        """This rank's group along ``axis`` (a name, an index, or several of them).

        Every rank must call this for the same axes in the same order, because it creates
        (once, then caches) every group along those axes.

        Args:
            axis: An axis (index or name) or several.
            indices_at_axis: ColossalAI's argument: the group of the ranks on this rank's line
                along ``axis`` whose index is one of these (torch's non-member marker when
                this rank's own index is not among them). All indices when None.
            backend: Backend of new groups (the mesh's by default).
        """
        if indices_at_axis is None:
            mine = self.create_group_along_axis(axis, None, backend)
            assert mine is not None
            return mine
        axes = self._axes(axis)
        lists = _index_lists(axes, indices_at_axis, self._shape)
        coords = self.get_coords_along_axis(self._coord, list(axes), lists)
        key = tuple(sorted(self.ravel(c, self._shape) for c in coords))
        if key not in self._groups:
            self.create_group_along_axis(axes, lists, backend)
        return self._groups[key]

    def get_ranks_in_group(self, group: ProcessGroup) -> list[int]:
        """Global ranks of ``group``."""
        return dist.get_process_group_ranks(group)

    def destroy(self) -> None:
        """Destroy the groups this mesh created."""
        for group in self._groups.values():
            if group not in (None, dist.GroupMember.NON_GROUP_MEMBER):
                dist.destroy_process_group(group)
        self._groups.clear()

    def destroy_mesh_process_groups(self) -> None:
        """ColossalAI's name of :meth:`destroy`."""
        self.destroy()

    def __repr__(self) -> str:
        names = f", axis_names={self._names}" if self._names else ""
        return f"ProcessGroupMesh({', '.join(map(str, self._shape))}{names})"


def _index_lists(
    axes: Sequence[int],
    indices_at_axis: Sequence[int] | Sequence[Sequence[int]] | None,
    shape: Sequence[int] | None = None,
) -> list[list[int]]:
    """One index list per axis (all indices when None), checked against ``shape``."""
    if indices_at_axis is None:
        if shape is None:
            raise ValueError("indices_at_axis is required without a mesh shape")
        return [list(range(shape[a])) for a in axes]
    items: list[int | Sequence[int]] = list(indices_at_axis)
    flat = [i for i in items if isinstance(i, int)]
    if items and len(flat) == len(items):
        lists = [flat]
    else:
        lists = [[int(j) for j in i] if not isinstance(i, int) else [i] for i in items]
    if len(lists) != len(axes) or any(not ix for ix in lists):
        raise ValueError(
            f"indices_at_axis={indices_at_axis!r} must give a non-empty index list for each "
            f"of the {len(axes)} axes {tuple(axes)} (a flat list for one axis)"
        )
    if shape is not None:
        for a, ix in zip(axes, lists, strict=True):
            bad = [i for i in ix if not 0 <= i < shape[a]]
            if bad:
                raise ValueError(f"indices_at_axis: {bad} outside axis {a} of extent {shape[a]}")
    return lists
