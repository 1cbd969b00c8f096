"""ParallelDims: the validated sizes and order of the parallel axes, and the groups they imply.

Every plugin and package asks one :class:`ParallelDims` for its process groups instead of
building groups of its own, so a job has one layout of ranks: data parallel (``dp``, itself
split into ``dp_replicate`` x ``dp_shard`` for ZeRO/FSDP sharding over part of it), pipeline
(``pp``), sequence (``sp``) and tensor (``tp``) parallel. ``tp`` may itself be a grid
(``tp_mode`` ``"2d"``, ``"2.5d"`` or ``"3d"``) whose rows, columns and depth are groups too.
Mixture-of-experts jobs split dp once more into expert parallel (``ep``) x the experts' own
data parallel (``moe_dp = dp / ep``), as ColossalAI's MoeHybridParallelPlugin does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.core.group_lifetime import keep_alive
from colossal.core.mesh import ProcessGroupMesh

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_AXIS_ORDER",
    "EXPERT_AXES",
    "GROUP_NAMES",
    "TP_GRID_AXES",
    "TP_MODES",
    "ParallelDims",
]

#: The four axes of :attr:`ParallelDims.order`.
AXES = ("dp", "pp", "sp", "tp")
#: Default order, outermost first: ranks next to each other share ``tp`` (the most
#: communication-heavy axis, kept on the fastest links), then ``sp``, ``pp``, ``dp``.
DEFAULT_AXIS_ORDER = ("dp", "pp", "sp", "tp")
#: Layouts of the tensor-parallel ranks: ``None``/``"1d"`` a line, the others a grid.
TP_MODES = (None, "1d", "2d", "2.5d", "3d")
#: The grid axes ``tp`` splits into, outermost first, per grid mode. Each name is also the
#: group along that axis: ``tp_row`` holds one row of the 2D grid (its ranks differ in the
#: column index), ``tp_col`` one column, ``tp_dep`` one depth fibre of the 2.5D grid; the 3D
#: cube has an ``input``, ``weight`` and ``output`` axis.
TP_GRID_AXES: dict[str, tuple[str, ...]] = {
    "2d": ("tp_col", "tp_row"),
    "2.5d": ("tp_dep", "tp_col", "tp_row"),
    "3d": ("tp_output", "tp_weight", "tp_input"),
}
#: Names :meth:`ParallelDims.group` accepts (alone or several together); the grid axes only
#: when ``tp_mode`` has them.
GROUP_NAMES = (
    "dp",
    "dp_replicate",
    "dp_shard",
    "pp",
    "sp",
    "tp",
    *dict.fromkeys(a for axes in TP_GRID_AXES.values() for a in axes),
    "ep",
    "moe_dp",
)
#: The groups that split dp for experts; asked alone, never combined with other axes.
EXPERT_AXES = ("ep", "moe_dp")


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class ParallelDims:
    """Sizes and order of the parallel axes of a job; builds and hands out their groups.

    The ranks form a row-major grid whose axes follow :attr:`order` (outermost first). With
    the default ``("dp", "pp", "sp", "tp")``, consecutive ranks differ in ``tp``: at world 4,
    ``ParallelDims(dp=2, tp=2)`` puts ranks ``{0, 1}`` and ``{2, 3}`` in the tp groups and
    ``{0, 2}``, ``{1, 3}`` in the dp groups. ColossalAI's HybridParallelPlugin puts ``sp``
    inside ``tp``; ``order=("dp", "pp", "tp", "sp")`` reproduces that layout.

    The ``dp`` axis is itself ``dp_replicate`` (outer) x ``dp_shard`` (inner): ZeRO and FSDP
    shard over ``dp_shard`` and replicate across ``dp_replicate`` (ColossalAI's
    ``extra_dp_size``, torchtitan's HSDP). By default ``dp_shard == dp`` (shard over all of dp).

    Groups are created on first request (:meth:`group`), once, from one
    :class:`~colossal.core.ProcessGroupMesh`; a group spanning every rank is the default group
    (nothing new is created for plain data parallelism). Creating groups is collective: every
    rank must ask for the same groups in the same order.

    Args:
        dp: Data-parallel size; ``-1`` infers it as ``world_size / (pp * tp * sp)``.
        pp: Pipeline-parallel size.
        tp: Tensor-parallel size.
        sp: Sequence-parallel size.
        dp_shard: Size of the ZeRO/FSDP shard group inside dp (must divide dp); ``None``
            shards over all of dp.
        order: The four axes ``"dp"``, ``"pp"``, ``"sp"``, ``"tp"``, outermost first.
        tp_mode: How the ``tp`` ranks are arranged: ``None`` or ``"1d"`` (a line), ``"2d"``
            (a q x q grid: ``tp`` = q*q), ``"2.5d"`` (``tp_depth`` layers of a q x q grid:
            ``tp`` = depth*q*q) or ``"3d"`` (a q x q x q cube: ``tp`` = q**3). The grid's axes
            (:data:`TP_GRID_AXES`) are group names too.
        tp_depth: Layers of the 2.5D grid (``tp_mode="2.5d"`` only).
        world_size: Ranks described; the default group's size when ``None`` (then
            torch.distributed must be initialized), the size of ``dp_group`` when given.
        dp_group: An existing data-parallel group to use as the whole ``dp`` axis (what a
            plugin given ``dp_group=`` wraps). No mesh is built; ``pp``, ``tp`` and ``sp``
            must be 1, and only groups equal to it can be handed out.
        ep: Expert-parallel size: each group of ``ep`` data-parallel ranks holds one copy of
            all experts, ``E / ep`` each. Must divide dp; ``moe_dp = dp / ep`` ranks hold the
            same experts (the ZeRO group of expert parameters). Groups ``"ep"``, ``"moe_dp"``.
        moe_dp_outside: ColossalAI's default ``True``: the ``ep`` ranks of a group are
            consecutive in dp (ep inner, moe_dp outer); ``False`` puts moe_dp inner.

    Raises:
        ValueError: A size is not a positive int, the sizes do not multiply to the world
            size, ``dp_shard`` or ``ep`` does not divide ``dp``, or ``order`` is not the
            four axes.

    Example:
        >>> dims = ParallelDims(dp=2, tp=2)            # under a 4-rank job
        >>> tp_group = dims.group("tp")
        >>> zero_group = dims.group(("dp", "sp"))      # ZeRO over dp x sp
    """

    dp: int = -1
    pp: int = 1
    tp: int = 1
    sp: int = 1
    dp_shard: int | None = None
    order: tuple[str, ...] = DEFAULT_AXIS_ORDER
    world_size: int | None = None
    tp_mode: str | None = None
    tp_depth: int = 1
    dp_group: ProcessGroup | None = field(default=None, repr=False, compare=False)
    ep: int = 1
    moe_dp_outside: bool = True
    _mesh: ProcessGroupMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bad = [
            f"{name}={value!r}"
            for name, value in (("pp", self.pp), ("tp", self.tp), ("sp", self.sp))
            if not _is_size(value)
        ]
        if not (_is_size(self.dp) or self.dp == -1):
            bad.insert(0, f"dp={self.dp!r}")
        if self.dp_shard is not None and not _is_size(self.dp_shard):
            bad.append(f"dp_shard={self.dp_shard!r}")
        if not _is_size(self.ep):
            bad.append(f"ep={self.ep!r}")
        if self.world_size is not None and not _is_size(self.world_size):
            bad.append(f"world_size={self.world_size!r}")
        if bad:
            raise ValueError(
                f"parallel sizes must be positive ints (dp may be -1 to infer it), got "
                f"{', '.join(bad)}"
            )
        order = self.order
        if isinstance(order, Sequence) and not isinstance(order, str):
            order = tuple(order)
        if not isinstance(order, tuple) or len(order) != len(AXES) or set(order) != set(AXES):
            raise ValueError(
                f"order={self.order!r} must name each of the axes {AXES} once, outermost "
                f"first (default {DEFAULT_AXIS_ORDER})"
            )
        object.__setattr__(self, "order", order)
        self._check_tp_grid()
        world = self._resolve_world_size()
        object.__setattr__(self, "world_size", world)
        if self.dp_group is not None and (self.pp, self.tp, self.sp) != (1, 1, 1):
            raise ValueError(
                f"a ParallelDims wrapping an existing dp_group describes data parallelism "
                f"only, got pp={self.pp}, tp={self.tp}, sp={self.sp}; build "
                "ParallelDims(dp=..., pp=..., tp=..., sp=...) without dp_group instead"
            )
        others = self.pp * self.tp * self.sp
        dp = self.dp
        if dp == -1:
            if world % others:
                raise ValueError(
                    f"cannot infer dp: pp={self.pp} x tp={self.tp} x sp={self.sp} = {others} "
                    f"does not divide the world size {world}"
                )
            dp = world // others
            object.__setattr__(self, "dp", dp)
        if dp * others != world:
            raise ValueError(
                f"parallel sizes dp={dp}, pp={self.pp}, tp={self.tp}, sp={self.sp} multiply "
                f"to {dp * others}, but the world size is {world}; choose sizes whose "
                f"product is {world} (or dp=-1 to infer dp)"
            )
        shard = dp if self.dp_shard is None else self.dp_shard
        if dp % shard:
            raise ValueError(
                f"dp_shard={shard} must divide dp={dp} (ZeRO shards over dp_shard ranks and "
                f"replicates across dp / dp_shard of them)"
            )
        object.__setattr__(self, "dp_shard", shard)
        self._check_ep(dp)

    def _check_ep(self, dp: int) -> None:
        if dp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp={dp} (dp = world {self.world_size} / (pp={self.pp} "
                f"x tp={self.tp} x sp={self.sp})): each group of ep data-parallel ranks holds "
                f"all experts; choose ep among the divisors "
                f"{[d for d in range(1, dp + 1) if dp % d == 0]}"
            )
        if self.ep > 1 and self.dp_group is not None:
            raise ValueError(
                f"ep={self.ep} needs the whole job's layout; build ParallelDims(dp=..., ep=...) "
                "without dp_group"
            )

    def _check_tp_grid(self) -> None:
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"tp_mode={self.tp_mode!r} is not one of {TP_MODES}")
        if not _is_size(self.tp_depth):
            raise ValueError(f"tp_depth must be a positive int, got {self.tp_depth!r}")
        if self.tp_mode != "2.5d" and self.tp_depth != 1:
            raise ValueError(
                f"tp_depth={self.tp_depth} applies to tp_mode='2.5d' only (got "
                f"tp_mode={self.tp_mode!r}); leave tp_depth at 1"
            )
        if self.tp_mode == "2d":
            side = math.isqrt(self.tp)
            if side * side != self.tp:
                raise ValueError(
                    f"tp_mode='2d' arranges the tensor-parallel ranks in a q x q grid, but "
                    f"tp={self.tp} is not a square; use tp=4, 9, 16, ..."
                )
        elif self.tp_mode == "2.5d":
            layer, rest = divmod(self.tp, self.tp_depth)
            side = math.isqrt(layer)
            if rest or side * side != layer:
                raise ValueError(
                    f"tp_mode='2.5d' arranges the tensor-parallel ranks in depth x q x q, but "
                    f"tp={self.tp} is not tp_depth={self.tp_depth} times a square; use "
                    f"tp={self.tp_depth * 4}, {self.tp_depth * 9}, ... or another depth"
                )
        elif self.tp_mode == "3d":
            side = round(self.tp ** (1 / 3))
            if side**3 != self.tp:
                raise ValueError(
                    f"tp_mode='3d' arranges the tensor-parallel ranks in a q x q x q cube, but "
                    f"tp={self.tp} is not a cube; use tp=8, 27, 64, ..."
                )

    @property
    def tp_grid_shape(self) -> tuple[int, ...]:
        """Extents of the tensor-parallel grid axes (:data:`TP_GRID_AXES`); ``()`` if a line."""
        axes = TP_GRID_AXES.get(self.tp_mode or "")
        if axes is None:
            return ()
        if self.tp_mode == "2.5d":
            side = math.isqrt(self.tp // self.tp_depth)
            return (self.tp_depth, side, side)
        side = math.isqrt(self.tp) if self.tp_mode == "2d" else round(self.tp ** (1 / 3))
        return (side,) * len(axes)

    def _resolve_world_size(self) -> int:
        if self.dp_group is not None:
            if not dist.is_initialized():
                raise RuntimeError("ParallelDims(dp_group=...) needs torch.distributed initialized")
            size = dist.get_world_size(self.dp_group)
            if self.world_size is not None and self.world_size != size:
                raise ValueError(
                    f"world_size={self.world_size} differs from the size {size} of the given "
                    "dp_group; leave world_size unset when passing dp_group"
                )
            if self.dp not in (-1, size):
                raise ValueError(
                    f"dp={self.dp} differs from the size {size} of the given dp_group; use "
                    "dp=-1 (inferred) with dp_group"
                )
            return size
        if self.world_size is not None:
            return self.world_size
        if not dist.is_initialized():
            raise ValueError(
                "ParallelDims needs world_size=... when torch.distributed is not initialized"
            )
        return dist.get_world_size()

    # ---- construction helpers ------------------------------------------------------------
    @classmethod
    def data_parallel(
        cls, world_size: int | None = None, group: ProcessGroup | None = None
    ) -> ParallelDims:
        """Everything data parallel: over ``group`` when given, else over the whole job.

        Args:
            world_size: Ranks of the job (the default group's size when ``None``); not
                used with ``group``.
            group: An existing data-parallel group (e.g. a plugin's ``dp_group``).
        """
        if group is not None:
            return cls(dp=-1, dp_group=group)
        return cls(dp=-1, world_size=world_size)

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def dp_replicate(self) -> int:
        """Replicas of each ZeRO/FSDP shard group: ``dp // dp_shard``."""
        return self.dp // self.dp_shard  # type: ignore[operator]

    @property
    def dp_enabled(self) -> bool:
        """Whether data parallelism is used (``dp > 1``)."""
        return self.dp > 1

    @property
    def dp_shard_enabled(self) -> bool:
        """Whether ZeRO/FSDP shard over more than one rank (``dp_shard > 1``)."""
        return self.dp_shard > 1  # type: ignore[operator]

    @property
    def dp_replicate_enabled(self) -> bool:
        """Whether shard groups are replicated (``dp_shard < dp``)."""
        return self.dp_replicate > 1

    @property
    def pp_enabled(self) -> bool:
        """Whether pipeline parallelism is used (``pp > 1``)."""
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether tensor parallelism is used (``tp > 1``)."""
        return self.tp > 1

    @property
    def sp_enabled(self) -> bool:
        """Whether sequence parallelism is used (``sp > 1``)."""
        return self.sp > 1

    @property
    def moe_dp(self) -> int:
        """Ranks holding the same experts (the experts' data-parallel size): ``dp // ep``."""
        return self.dp // self.ep

    @property
    def ep_enabled(self) -> bool:
        """Whether expert parallelism is used (``ep > 1``)."""
        return self.ep > 1

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Axis names of the mesh, outermost first (dp as ``dp_replicate``, ``dp_shard``)."""
        return tuple(name for axis in self.order for name in self._expand(axis))

    def _expand(self, name: str) -> tuple[str, ...]:
        """The mesh axes behind a group name (dp: replicas, shards; a grid-mode tp: its axes)."""
        if name == "dp":
            return ("dp_replicate", "dp_shard")
        if name == "tp":
            return TP_GRID_AXES.get(self.tp_mode or "", ("tp",))
        return (name,)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Extent of each of :attr:`mesh_axes`."""
        return tuple(self._extent(name) for name in self.mesh_axes)

    def _extent(self, name: str) -> int:
        if name == "dp_replicate":
            return self.dp_replicate
        grid = TP_GRID_AXES.get(self.tp_mode or "", ())
        if name in grid:
            return self.tp_grid_shape[grid.index(name)]
        return int(getattr(self, name))

    def _axes(self, names: str | Sequence[str]) -> tuple[str, ...]:
        """Mesh axes of ``names`` (dp expanded), validated, in mesh order."""
        wanted = (names,) if isinstance(names, str) else tuple(names)
        unknown = [n for n in wanted if n not in GROUP_NAMES]
        if not wanted or unknown:
            raise ValueError(
                f"unknown parallel axis name(s) {unknown or wanted!r}; use one or more of "
                f"{GROUP_NAMES}"
            )
        if any(n in EXPERT_AXES for n in wanted):
            raise ValueError(
                f"{wanted!r}: the expert groups {EXPERT_AXES} are asked alone, not combined "
                "with other axes (they split dp)"
            )
        expanded = [m for n in wanted for m in self._expand(n)]
        missing = [m for m in expanded if m not in self.mesh_axes]
        if missing:
            modes = [mode for mode, axes in TP_GRID_AXES.items() if missing[0] in axes]
            raise ValueError(
                f"group {missing[0]!r} exists only with tp_mode in {modes} (this job has "
                f"tp_mode={self.tp_mode!r}, tp={self.tp})"
            )
        if len(set(expanded)) != len(expanded):
            raise ValueError(
                f"axes {wanted} name an axis twice (dp includes dp_shard, tp its grid axes)"
            )
        return tuple(a for a in self.mesh_axes if a in expanded)

    def size(self, names: str | Sequence[str]) -> int:
        """Number of ranks in a group along ``names`` (one axis name or several)."""
        if names in EXPERT_AXES:
            return self.ep if names == "ep" else self.moe_dp
        return math.prod(self._extent(a) for a in self._axes(names))

    # ---- ranks ---------------------------------------------------------------------------
    def _members(self) -> list[int]:
        """Global ranks described, in grid order."""
        if self.dp_group is not None:
            return list(dist.get_process_group_ranks(self.dp_group))
        return list(range(self.world_size))  # type: ignore[arg-type]

    def _default_rank(self, rank: int | None) -> int:
        if rank is not None:
            return rank
        if not dist.is_initialized():
            raise ValueError("pass rank=... when torch.distributed is not initialized")
        return dist.get_rank()

    def ranks(self, names: str | Sequence[str], rank: int | None = None) -> list[int]:
        """Global ranks of the group along ``names`` that holds ``rank`` (this rank's).

        Pure arithmetic: creates no group.

        Raises:
            ValueError: ``rank`` is not one of the ranks described.
        """
        if names in EXPERT_AXES:
            return self._expert_ranks(str(names), self.ranks("dp", rank), rank)
        axes = self._axes(names)
        members = self._members()
        rank = self._default_rank(rank)
        if rank not in members:
            raise ValueError(f"rank {rank} is not among the ranks {members} of {self}")
        shape = self.mesh_shape
        coord = list(ProcessGroupMesh.unravel(members.index(rank), shape))
        idx = [self.mesh_axes.index(a) for a in axes]
        found = []
        for flat in range(math.prod(shape[i] for i in idx)):
            sub = ProcessGroupMesh.unravel(flat, [shape[i] for i in idx])
            for i, value in zip(idx, sub, strict=True):
                coord[i] = value
            found.append(members[ProcessGroupMesh.ravel(coord, shape)])
        return sorted(found)

    def _expert_ranks(self, name: str, dp_ranks: list[int], rank: int | None) -> list[int]:
        """The ``ep`` or ``moe_dp`` ranks inside one dp group (``rank`` among ``dp_ranks``)."""
        index = dp_ranks.index(self._default_rank(rank))
        inner = self.ep if self.moe_dp_outside else self.moe_dp
        inner_name = "ep" if self.moe_dp_outside else "moe_dp"
        if name == inner_name:  # consecutive ranks of dp
            start = index // inner * inner
            return dp_ranks[start : start + inner]
        return dp_ranks[index % inner :: inner]  # strided

    def expert_rank_groups(self, name: str) -> list[list[int]]:
        """Every ``ep`` (or ``moe_dp``) group of the job, in a deterministic order."""
        if name not in EXPERT_AXES:
            raise ValueError(f"name={name!r} must be one of {EXPERT_AXES}")
        out: list[list[int]] = []
        for member in self._members():
            ranks = self._expert_ranks(name, self.ranks("dp", member), member)
            if ranks not in out:
                out.append(ranks)
        return out

    def coordinate(self, names: str | Sequence[str], rank: int | None = None) -> int:
        """Index of ``rank`` (this rank by default) in its group along ``names``.

        It equals ``torch.distributed.get_rank(self.group(names))`` on that rank.
        """
        rank = self._default_rank(rank)
        return self.ranks(names, rank).index(rank)

    # ---- groups --------------------------------------------------------------------------
    def build_mesh(self) -> ProcessGroupMesh:
        """The :class:`ProcessGroupMesh` over :attr:`mesh_axes` (built once, then reused).

        Raises:
            ValueError: This ParallelDims wraps a given ``dp_group`` (it has no mesh).
            RuntimeError: torch.distributed is not initialized.
        """
        if self.dp_group is not None:
            raise ValueError(
                "a ParallelDims wrapping a given dp_group builds no mesh; describe the whole "
                "job with ParallelDims(dp=..., pp=..., tp=..., sp=...) to get a mesh"
            )
        if self._mesh is None:
            mesh = ProcessGroupMesh(*self.mesh_shape, axis_names=self.mesh_axes)
            object.__setattr__(self, "_mesh", mesh)
            logger.debug("built %r for %r", mesh, self)
        return self._mesh  # type: ignore[return-value]

    def group(self, names: str | Sequence[str]) -> ProcessGroup:
        """This rank's process group along ``names`` (e.g. ``"tp"`` or ``("dp", "sp")``).

        A group spanning every rank is the default group. Otherwise the group comes from the
        mesh, created on first request (collective: every rank asks in the same order).

        Raises:
            ValueError: An unknown name, or a group other than the wrapped ``dp_group``
                asked of a ParallelDims built from one.
        """
        size = self.size(names)
        if names in EXPERT_AXES and self.dp_group is None and size < (self.world_size or 1):
            return self._expert_group(str(names))
        if self.dp_group is not None:
            if size == self.dp:
                return keep_alive(self.dp_group)  # see group_lifetime
            raise ValueError(
                f"this ParallelDims wraps a given dp_group of {self.dp} ranks and can only "
                f"hand out that group, not {names!r} ({size} ranks); describe the whole job "
                "with ParallelDims(dp=..., ...) to get sub-groups"
            )
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.group needs torch.distributed initialized")
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"{self} describes {self.world_size} ranks but the job has "
                f"{dist.get_world_size()}; leave world_size unset to use the job's size"
            )
        if size == self.world_size:
            return keep_alive(dist.group.WORLD)  # type: ignore[return-value]
        return self.build_mesh().get_group_along_axis(self._axes(names))

    def _expert_group(self, name: str) -> ProcessGroup:
        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.group needs torch.distributed initialized")
        mesh = self.build_mesh()
        mine = self.ranks(name)
        for ranks in self.expert_rank_groups(name):  # collective: every rank, same order
            group = mesh.get_group(ranks)
            if ranks == mine:
                found = group
        return found  # this rank is in exactly one of the groups

    def destroy(self) -> None:
        """Destroy the groups this ParallelDims created (never the default or a given one)."""
        if self._mesh is not None:
            self._mesh.destroy()
            object.__setattr__(self, "_mesh", None)
