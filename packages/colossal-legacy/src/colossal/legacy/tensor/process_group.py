"""``ProcessGroup``: the seeds' tp x dp process layout as a 2-D torch ``DeviceMesh``.

Tensor parallelism takes the inner, consecutive ranks and data parallelism the outer ones (the
seeds' rule): with ``ranks`` r and ``tp_degree`` t, rank ``r[d * t + k]`` is tp rank ``k`` of dp
group ``d``. The mesh has the dimension names ``("dp", "tp")``; every rank of the world must
construct a ``ProcessGroup`` (its groups are created collectively, like ``new_group``). Meshes
are cached per layout, so building the same ``ProcessGroup`` twice creates no new groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from colossal.core import keep_alive

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ProcessGroup"]

_MESHES: dict[tuple[tuple[int, ...], int], DeviceMesh] = {}


def _degrees(world: int, tp: int | None, dp: int | None) -> tuple[int, int]:
    """``(tp, dp)`` completed from the given ones; ValueError when they do not fit ``world``."""
    for name, value in (("tp_degree", tp), ("dp_degree", dp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if tp is None and dp is None:
        tp, dp = 1, world
    elif tp is None:
        assert dp is not None
        tp = world // dp
    elif dp is None:
        dp = world // tp
    if tp * dp != world:
        raise ValueError(
            f"tp_degree ({tp}) x dp_degree ({dp}) = {tp * dp} must equal the number of ranks "
            f"({world}); choose degrees whose product is {world} (or give only one of them)"
        )
    return tp, dp


def _mesh(ranks: tuple[int, ...], tp: int) -> DeviceMesh:
    """The cached ``("dp", "tp")`` mesh over ``ranks``."""
    key = (ranks, tp)
    if key not in _MESHES:
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        from colossal.core.accelerator import get_accelerator

        layout = torch.tensor(ranks, dtype=torch.int).reshape(len(ranks) // tp, tp)
        device = get_accelerator().get_current_device().type
        mesh = DeviceMesh(device, layout, mesh_dim_names=("dp", "tp"))
        for dim in range(mesh.ndim):
            keep_alive(mesh.get_group(dim))
        _MESHES[key] = mesh
    return _MESHES[key]


class ProcessGroup:
    """How ranks form tensor-parallel and data-parallel groups (the seeds' ``ProcessGroup``).

    Args:
        rank: This process's global rank (default: ``dist.get_rank()``).
        ranks: The global ranks of the group (default: every rank of the world).
        tp_degree: Tensor-parallel size (default: ``len(ranks) // dp_degree``, or 1).
        dp_degree: Data-parallel size (default: ``len(ranks) // tp_degree``).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
        ValueError: ``tp_degree * dp_degree != len(ranks)``, ``rank`` not in ``ranks``, or
            ``ranks`` not a permutation of the world (part of the world is not supported).
    """

    def __init__(
        self,
        rank: int | None = None,
        ranks: list[int] | None = None,
        tp_degree: int | None = None,
        dp_degree: int | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroup needs torch.distributed: call colossalai.launch (or "
                "colossal.core.launch / torch.distributed.init_process_group) first"
            )
        self._rank = dist.get_rank() if rank is None else rank
        self._ranks = tuple(range(dist.get_world_size())) if ranks is None else tuple(ranks)
        if self._rank not in self._ranks:
            raise ValueError(
                f"rank {self._rank} is not in ranks {list(self._ranks)}; pass ranks "
                "that contain this process's rank"
            )
        if sorted(self._ranks) != list(range(dist.get_world_size())):
            raise ValueError(
                f"ranks {list(self._ranks)} must be every rank of the world once "
                f"(0..{dist.get_world_size() - 1}): a ProcessGroup over part of the world is not "
                "supported (its device mesh is created by every rank); leave ranks=None"
            )
        self._tp, self._dp = _degrees(len(self._ranks), tp_degree, dp_degree)
        self.mesh: DeviceMesh = _mesh(self._ranks, self._tp)
        index = self._ranks.index(self._rank)
        self._dp_rank, self._tp_rank = divmod(index, self._tp)

    def rank(self) -> int:
        """This process's global rank."""
        return self._rank

    def ranks_in_group(self) -> list[int]:
        """The global ranks of the whole group."""
        return list(self._ranks)

    def world_size(self) -> int:
        """The number of ranks of the whole group."""
        return len(self._ranks)

    def tp_world_size(self) -> int:
        """The tensor-parallel degree."""
        return self._tp

    def dp_world_size(self) -> int:
        """The data-parallel degree."""
        return self._dp

    def tp_local_rank(self) -> int:
        """This rank's index in its tensor-parallel group."""
        return self._tp_rank

    def dp_local_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self._dp_rank

    def tp_rank_list(self) -> list[int]:
        """The global ranks of this rank's tensor-parallel group (consecutive)."""
        start = self._dp_rank * self._tp
        return list(self._ranks[start : start + self._tp])

    def dp_rank_list(self) -> list[int]:
        """The global ranks of this rank's data-parallel group (stride ``tp_degree``)."""
        return list(self._ranks[self._tp_rank :: self._tp])

    def tp_process_group(self) -> dist.ProcessGroup:
        """The torch group of this rank's tensor-parallel ranks."""
        return self.mesh.get_group("tp")

    def dp_process_group(self) -> dist.ProcessGroup:
        """The torch group of this rank's data-parallel ranks."""
        return self.mesh.get_group("dp")

    def has_cpu_groups(self) -> bool:
        """Whether the groups run on CPU tensors (gloo); the seeds' CUDA groups need nccl."""
        return self.mesh.device_type == "cpu"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProcessGroup):
            return NotImplemented
        return self._ranks == other._ranks and self._tp == other._tp

    def __hash__(self) -> int:
        return hash((self._ranks, self._tp))

    def __repr__(self) -> str:
        return (
            f"ProcessGroup(ranks={list(self._ranks)}, tp_degree={self._tp}, dp_degree={self._dp})"
        )
