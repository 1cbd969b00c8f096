"""Packs parameters into chunks and gathers, releases and prefetches them.

Parameters are registered in the order of their first use. Each registration appends to the
open chunk of its *kind* — ``(group_key, dtype, requires_grad, keep_gathered)`` — and a full
chunk is closed and replaced, so frozen parameters never share a chunk with trainable ones
(they get no master or gradient) and every chunk holds one dtype. A parameter larger than
the chunk size gets a chunk of its own, of its size. A parameter registered again (a tied
weight: the same ``Parameter`` object under another name) keeps its first chunk.

Every rank must register the same parameters in the same order: the chunks, their order and
hence the order of their collectives are then identical everywhere.

With an ``extra_dp_group`` (ColossalAI's extra data parallelism) the chunks are sharded over
``group`` and the ranks of ``extra_dp_group`` hold replicas of the same shards: after the
gradients are reduce-scattered over ``group``, :meth:`ChunkManager.reduce_replica_grads`
all-reduces (averages) every gradient shard over ``extra_dp_group``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core.comm import all_reduce, fp8_all_reduce
from colossal.gemini.chunk.base import _group_geometry, _round_up
from colossal.gemini.chunk.chunk import Chunk
from colossal.gemini.chunk.storage import BudgetLike, Location, physical_device

logger = logging.getLogger(__name__)

__all__ = ["ChunkManager", "ChunkSpec"]

_Kind = tuple[str, torch.dtype, bool, bool]


class PlacementLike(Protocol):
    """Where one chunk lives: ``colossal.gemini.memory.ChunkPlacement`` or alike."""

    @property
    def keep_gathered(self) -> bool:
        """Keep the full payload on every rank (not sharded)."""
        ...

    @property
    def shard_location(self) -> Location:
        """Where this rank's parameter shard lives."""
        ...

    @property
    def master_location(self) -> Location:
        """Where the fp32 master shard, its gradient shard and the optimizer states live."""
        ...


@dataclass(frozen=True)
class ChunkSpec:
    """A chunk :meth:`ChunkManager.layout` plans (sizes in bytes; a placement's ChunkLike)."""

    chunk_id: int
    payload_bytes: int
    shard_bytes: int
    master_bytes: int
    keep_gathered: bool
    requires_grad: bool


class ChunkManager:
    """Owns every chunk of a model and moves them between released and gathered.

    Args:
        chunk_size: Capacity of a chunk in elements (e.g. from
            :func:`~colossal.gemini.search_chunk_configuration`).
        group: Process group the chunks are sharded over.
        budget: Receives every chunk's allocations (``DeviceMemoryBudget`` or alike).
        master_dtype: dtype of trainable chunks' master shards (``None``: none).
        pin_memory: Pin host-located chunk tensors (when CUDA is available).
        max_prefetch: How many chunks :meth:`prefetch` may gather ahead (0: none).
        accumulate_grads: Passed to every trainable chunk (see :class:`Chunk`).
        grad_dtype: dtype of trainable chunks' reduced gradient shards (``None``: the chunk
            dtype; see :class:`Chunk`).
        extra_dp_group: Ranks holding replicas of this rank's shards (``None``: none); the
            gradient shards are averaged over it by :meth:`reduce_replica_grads`.
        fp8_communication: Every chunk gathers and reduces as float8 (see :class:`Chunk`),
            and the replicas' gradient shards are averaged as float8.

    Raises:
        ValueError: ``chunk_size`` is not a positive int or ``max_prefetch`` is negative.
    """

    def __init__(
        self,
        chunk_size: int,
        group: ProcessGroup | None,
        *,
        budget: BudgetLike | None = None,
        master_dtype: torch.dtype | None = torch.float32,
        pin_memory: bool = False,
        max_prefetch: int = 0,
        accumulate_grads: bool = False,
        grad_dtype: torch.dtype | None = None,
        extra_dp_group: ProcessGroup | None = None,
        fp8_communication: bool = False,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (elements), got {chunk_size!r}")
        if isinstance(max_prefetch, bool) or not isinstance(max_prefetch, int) or max_prefetch < 0:
            raise ValueError(f"max_prefetch must be an int >= 0, got {max_prefetch!r}")
        self.chunk_size = chunk_size
        self.group = group
        self.budget = budget
        self.master_dtype = master_dtype
        self.pin_memory = pin_memory
        self.max_prefetch = max_prefetch
        self.accumulate_grads = accumulate_grads
        self.grad_dtype = grad_dtype
        self.extra_dp_group = extra_dp_group
        self.fp8_communication = fp8_communication
        self.extra_dp_size = dist.get_world_size(extra_dp_group) \
            if extra_dp_group is not None and dist.is_initialized() else 1
        self._replicas_pending = False  # gradient shards not yet averaged over extra_dp_group
        self._plan: list[PlacementLike] | None = None  # placements for the chunks still to be built
        self.chunks: list[Chunk] = []
        self._open: dict[_Kind, Chunk] = {}
        self._chunk_of: dict[nn.Parameter, Chunk] = {}
        self._names: dict[nn.Parameter, str] = {}
        self._by_name: dict[str, nn.Parameter] = {}
        self._accessed: set[int] = set()  # ids of chunks gathered through access()
        self._prefetched: dict[int, Chunk] = {}

    # ----------------------------------------------------------------- registration
    def _new_chunk(self, size: int, dtype: torch.dtype, requires_grad: bool,
                   keep_gathered: bool) -> Chunk:
        chunk_id = len(self.chunks)
        where: dict[str, Any] = {}
        if self._plan is not None and chunk_id < len(self._plan):
            place = self._plan[chunk_id]
            keep_gathered = keep_gathered or place.keep_gathered
            where = {"shard_location": "device" if keep_gathered else place.shard_location,
                     "master_location": place.master_location}
        chunk = Chunk(
            size,
            self.group,
            dtype,
            keep_gathered=keep_gathered,
            requires_grad=requires_grad,
            master_dtype=self.master_dtype if requires_grad else None,
            budget=self.budget,
            pin_memory=self.pin_memory,
            chunk_id=chunk_id,
            accumulate_grads=self.accumulate_grads,
            grad_dtype=self.grad_dtype,
            **where,
        )
        chunk.fp8_communication = self.fp8_communication
        self.chunks.append(chunk)
        return chunk

    def register(
        self,
        name: str,
        param: nn.Parameter,
        *,
        dtype: torch.dtype,
        keep_gathered: bool = False,
        group_key: str = "default",
    ) -> Chunk:
        """Put ``param`` into a chunk and return that chunk.

        Args:
            name: The parameter's name.
            param: The parameter (its ``.data`` becomes a view of the chunk).
            dtype: Storage dtype of the chunk (e.g. ``torch.bfloat16``).
            keep_gathered: Put it in a chunk that stays gathered.
            group_key: Parameters of different keys never share a chunk (e.g. param groups).

        Raises:
            ValueError: Another parameter was registered under ``name``, or the manager is
                closed for this kind of parameter.
            TypeError: ``param`` is not a floating-point tensor.
        """
        if param in self._chunk_of:
            logger.debug("%s is tied to %s; it stays in chunk %d", name, self._names[param],
                         self._chunk_of[param].chunk_id)
            return self._chunk_of[param]
        if name in self._by_name:
            raise ValueError(f"another parameter is already registered as {name!r}; "
                             "parameter names must be unique")
        if not isinstance(param, torch.Tensor) or not param.is_floating_point():
            raise TypeError(f"{name!r} must be a floating-point tensor parameter, got "
                            f"{type(param).__name__} {getattr(param, 'dtype', '')}")
        requires_grad = bool(param.requires_grad)
        numel = param.numel()
        chunk: Chunk | None
        if numel > self.chunk_size:
            chunk = self._new_chunk(numel, dtype, requires_grad, keep_gathered)
            chunk.append(name, param)
            chunk.close()
        else:
            kind: _Kind = (group_key, dtype, requires_grad, bool(keep_gathered))
            chunk = self._open.get(kind)
            if chunk is None or not chunk.can_fit(numel):
                if chunk is not None:
                    chunk.close()
                chunk = self._new_chunk(self.chunk_size, dtype, requires_grad, keep_gathered)
                self._open[kind] = chunk
            chunk.append(name, param)
        self._chunk_of[param] = chunk
        self._names[param] = name
        self._by_name[name] = param
        return chunk

    def layout(
        self,
        params: Sequence[tuple[str, nn.Parameter]],
        *,
        dtype: torch.dtype,
        keep_gathered: bool = False,
    ) -> list[ChunkSpec]:
        """The chunks :meth:`register` + :meth:`close_all` would build, without building them.

        Follows the same packing rules (tied parameters once, one open chunk per kind, a
        parameter larger than the chunk size in its own chunk), so a placement policy can
        plan every chunk before any storage is allocated (see :meth:`set_plan`). Only for a
        manager that has no chunks yet.

        Args:
            params: ``(name, parameter)`` in registration order.
            dtype: Storage dtype of the chunks.
            keep_gathered: As for :meth:`register`.

        Returns:
            One :class:`ChunkSpec` per chunk, in chunk order.
        """
        if self.chunks:
            raise RuntimeError("layout() plans an empty manager; it already has chunks")
        world, _ = _group_geometry(self.group)
        numels: list[int] = []
        trainable: list[bool] = []
        open_: dict[bool, int] = {}  # requires_grad -> index of the open chunk
        seen: set[int] = set()
        for _, p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            n, rg = p.numel(), bool(p.requires_grad)
            if n > self.chunk_size:
                numels.append(n)
                trainable.append(rg)
                continue
            i = open_.get(rg)
            if i is None or numels[i] + n > _round_up(self.chunk_size, world):
                open_[rg] = i = len(numels)
                numels.append(0)
                trainable.append(rg)
            numels[i] += n
        specs = []
        for i, (n, rg) in enumerate(zip(numels, trainable, strict=True)):
            cap = _round_up(max(n, 1), world)
            has_master = rg and self.master_dtype is not None and self.master_dtype != dtype
            specs.append(ChunkSpec(
                chunk_id=i,
                payload_bytes=cap * dtype.itemsize,
                shard_bytes=cap // world * dtype.itemsize,
                master_bytes=(cap // world * self.master_dtype.itemsize
                              if has_master and self.master_dtype is not None else 0),
                keep_gathered=bool(keep_gathered),
                requires_grad=rg,
            ))
        return specs

    def set_plan(self, placements: Sequence[PlacementLike] | None) -> None:
        """Build the coming chunks where ``placements`` (one per chunk, by chunk id) says.

        Each new chunk is created kept gathered or sharded with its shard and optimizer side
        allocated directly on the planned locations (``ChunkPlacement`` or alike), so
        building never holds more than the plan on the device. ``None`` clears the plan.
        """
        self._plan = None if placements is None else list(placements)

    def close_all(self) -> None:
        """Close every open chunk (no more registrations into them)."""
        for chunk in self._open.values():
            chunk.close()
        self._open.clear()

    # ----------------------------------------------------------------- replicas
    def mark_replica_grads_pending(self) -> None:
        """Note that a backward reduced new gradients over ``group`` (not yet over replicas)."""
        self._replicas_pending = self.extra_dp_size > 1

    def reduce_replica_grads(self) -> None:
        """Average every gradient shard over ``extra_dp_group`` (once per pending backward).

        Collective over ``extra_dp_group`` (every rank of it joins, chunk by chunk in the same
        order); a no-op without replicas or when nothing is pending. The shards of replicas
        are then identical, so norms and overflow checks count each one over ``group`` only.
        Under gradient accumulation it runs once, on the accumulated shards, before they are
        read (the sum is linear).
        """
        if not self._replicas_pending:
            return
        self._replicas_pending = False
        device = physical_device("device")
        for chunk in self.chunks:
            if not chunk.requires_grad:
                continue
            chunk.finish_reduce()
            shard = chunk.grad_shard
            if shard is None:  # no gradient reduced into it: alike on every replica
                continue
            buf = shard if shard.device == device else shard.to(device)
            (fp8_all_reduce if self.fp8_communication else all_reduce)(
                buf, group=self.extra_dp_group
            )
            buf.div_(self.extra_dp_size)
            if buf is not shard:
                shard.copy_(buf)

    # ----------------------------------------------------------------- lookup
    def chunk_of(self, param: nn.Parameter) -> Chunk:
        """The chunk holding ``param``.

        Raises:
            KeyError: ``param`` is not managed here.
        """
        chunk = self._chunk_of.get(param)
        if chunk is None:
            raise KeyError(
                f"parameter of shape {tuple(param.shape)} and dtype {param.dtype} is not "
                "managed by this ChunkManager; register() it first"
            )
        return chunk

    def name_of(self, param: nn.Parameter) -> str:
        """The name ``param`` was first registered under (KeyError if unmanaged)."""
        self.chunk_of(param)
        return self._names[param]

    def param(self, name: str) -> nn.Parameter:
        """The parameter registered as ``name`` (KeyError naming it if unknown)."""
        if name not in self._by_name:
            raise KeyError(f"no parameter registered as {name!r}")
        return self._by_name[name]

    # ----------------------------------------------------------------- gather / release
    def access(self, chunk: Chunk) -> None:
        """Make ``chunk``'s payload available (waits for its prefetch, else gathers)."""
        self._prefetched.pop(chunk.chunk_id, None)
        chunk.gather()
        chunk.wait()
        self._accessed.add(chunk.chunk_id)

    def release(self, chunk: Chunk) -> None:
        """Release ``chunk``'s payload (a no-op for ``keep_gathered`` chunks)."""
        self._prefetched.pop(chunk.chunk_id, None)
        chunk.release()
        self._accessed.discard(chunk.chunk_id)

    @property
    def accessed(self) -> list[Chunk]:
        """Chunks gathered through :meth:`access` and not released since, in chunk order."""
        return [c for c in self.chunks if c.chunk_id in self._accessed]

    def prefetch(self, chunks: Sequence[Chunk]) -> None:
        """Start gathering up to ``max_prefetch`` of ``chunks`` (in the given order).

        The gathers are asynchronous; their handles are kept in the chunks and completed by
        :meth:`access` (or any other use of the chunk). Chunks already gathered, or kept
        gathered, are skipped without counting. Every rank must prefetch the same chunks in
        the same order (they are collectives).
        """
        room = self.max_prefetch - len(self._prefetched)
        for chunk in chunks:
            if room <= 0:
                break
            if chunk.is_gathered or chunk.keep_gathered:
                continue
            chunk.gather(async_op=True)
            self._prefetched[chunk.chunk_id] = chunk
            room -= 1

    @property
    def in_flight(self) -> list[Chunk]:
        """Chunks prefetched and not accessed yet."""
        return list(self._prefetched.values())

    def apply_placement(self, placements: Sequence[PlacementLike]) -> None:
        """Apply one placement per chunk (``colossal.gemini.memory.ChunkPlacement`` or alike).

        For each chunk, in order: switch ``keep_gathered`` (see
        :meth:`Chunk.set_keep_gathered`; a chunk that becomes sharded is released unless it
        is accessed), move the parameter shard to ``shard_location`` and the optimizer side
        to ``master_location``. Every rank must apply the same plan (gathers are collectives).

        Raises:
            ValueError: The plan's length differs from the number of chunks, or it puts the
                shard of a kept-gathered chunk on the host.
        """
        placements = list(placements)
        if len(placements) != len(self.chunks):
            raise ValueError(f"placement plan has {len(placements)} entries for "
                             f"{len(self.chunks)} chunks; plan every chunk of this manager")
        for chunk, place in zip(self.chunks, placements, strict=True):
            if place.keep_gathered and place.shard_location != "device":
                raise ValueError(f"placement for chunk {chunk.chunk_id} keeps it gathered "
                                 f"but puts its shard on {place.shard_location!r}; a kept-"
                                 "gathered chunk lives on the device")
        for chunk, place in zip(self.chunks, placements, strict=True):
            was_kept = chunk.keep_gathered
            chunk.set_keep_gathered(place.keep_gathered)
            if was_kept and not chunk.keep_gathered and chunk.chunk_id not in self._accessed:
                chunk.release()
            if not chunk.keep_gathered:
                chunk.move_shard(place.shard_location)
            chunk.move_master(place.master_location)

    # ----------------------------------------------------------------- memory
    def memory_by_kind(self) -> dict[str, dict[Location, int]]:
        """Model-data bytes of every chunk by kind and location (:meth:`Chunk.memory_by_kind`)."""
        out: dict[str, dict[Location, int]] = {}
        for chunk in self.chunks:
            for kind, where in chunk.memory_by_kind().items():
                slot = out.setdefault(kind, {"device": 0, "host": 0})
                for loc, n in where.items():
                    slot[loc] += n
        return out

    def memory(self) -> dict[Location, int]:
        """Model-data bytes of every chunk, by logical location."""
        out: dict[Location, int] = {"device": 0, "host": 0}
        for chunk in self.chunks:
            for loc, n in chunk.memory().items():
                out[loc] += n
        return out

    def __repr__(self) -> str:
        return (f"ChunkManager(chunks={len(self.chunks)}, chunk_size={self.chunk_size}, "
                f"open={len(self._open)})")
