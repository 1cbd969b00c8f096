"""Gemini's parameters and optimizer states as :class:`colossal.core.ShardedTensor`.

A parameter managed by a chunk is held, on each rank, as the elements of its flattened local
tensor that fall into the rank's shard of the chunk. Its placements
(:func:`colossal.gemini.chunk.placements.piece_placements`) are the parameter's own (a
tensor-parallel block recorded with :func:`colossal.core.mark_sharded`), then that flat range
along ``"dp"``, then the replicas of extra data parallelism: so "a Gemini chunk piece of a
tensor-parallel block" is one description, gathered axis by axis. :class:`ChunkTensor` is
that view of a parameter (its fp32 master when the chunk keeps one, else its shard);
:class:`ChunkStateTensor` the same view of one optimizer state laid out like the parameter
(Adam's ``exp_avg``/``exp_avg_sq``). Their innermost gather goes through a
:class:`~colossal.gemini.checkpoint.ChunkGatherer`, so a save that asks for the tensors chunk
by chunk gathers each chunk once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import FlatRange, Placed, Placement, ShardedTensor
from colossal.core.comm import all_gather_object
from colossal.gemini.checkpoint.gatherer import ChunkGatherer
from colossal.gemini.chunk import Chunk
from colossal.gemini.chunk.placements import ChunkGroups, piece_placements, whole_shape

if TYPE_CHECKING:
    from colossal.gemini.ddp import GeminiDDP
    from colossal.gemini.optim import GeminiOptimizer

logger = logging.getLogger(__name__)

__all__ = ["ChunkStateTensor", "ChunkTensor", "model_shards", "optimizer_shards"]


def _this_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ChunkTensor(Placed):
    """One managed parameter as the piece of it this rank's chunk shard holds.

    ``shape`` is the whole parameter's (the tensor-parallel whole, when it is split);
    ``dtype`` the master's (fp32) when the chunk keeps a master, else the chunk's; ``local()``
    this rank's piece of the master (or of the shard). ``gather`` is collective over the
    ranks of its placements (the chunk is gathered once per ``gatherer``).

    Args:
        chunk: The ``colossal.gemini.Chunk`` holding ``param``.
        param: The parameter.
        gatherer: Shared by the tensors of one save (a new one when None).
        position: The chunk's index in its manager (orders a chunk-by-chunk save).
        manager: The chunks' manager (its groups place the piece; the chunk's group alone
            when None).
    """

    state = "param"

    def __init__(
        self,
        chunk: Chunk,
        param: nn.Parameter,
        gatherer: ChunkGatherer | None = None,
        position: int = 0,
        manager: ChunkGroups | None = None,
    ) -> None:
        self.chunk, self.param = chunk, param
        self.info = chunk.infos[param]
        self.gatherer = gatherer if gatherer is not None else ChunkGatherer()
        self.position = position
        self._placements = piece_placements(chunk, param, manager or _ChunkGroup(chunk))
        self._flat = next(p.part for p in reversed(self._placements)
                          if isinstance(p.part, FlatRange))

    @property
    def shape(self) -> torch.Size:
        """The whole parameter's shape."""
        return whole_shape(self.chunk, self.param)

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The parameter's placements, its flat range along ``"dp"``, its replicas."""
        return self._placements

    @property
    def flat(self) -> FlatRange:
        """The elements of the flattened local parameter this rank's shard holds."""
        return self._flat

    @property
    def dtype(self) -> torch.dtype:
        """fp32 with a master, else the chunk's dtype."""
        return self.chunk.master_dtype or self.chunk.dtype

    @property
    def order(self) -> tuple[int, str, int]:
        """Sort key of a chunk-by-chunk save: chunk, state, offset in the chunk."""
        return (self.position, self.state, self.info.offset)

    def local(self) -> torch.Tensor:
        """This rank's elements (1-D view of the master, or of the shard without one)."""
        return self.chunk.tensor_shard(self.param, source="master")[2]

    def _flat_shard(self) -> torch.Tensor:
        return self.chunk.optim_shard

    def gather_inner(self, leader: int | None) -> torch.Tensor | None:
        """The local parameter (CPU) on global rank ``leader`` (every rank when None).

        The first tensor of a chunk gathers the whole chunk to ``leader``; the others slice
        that buffer. Collective over the chunk's group.
        """
        buf = self.gatherer.buffer(self.chunk, self.state, self._flat_shard, leader)
        if buf is None or (leader is not None and leader != _this_rank()):
            return None
        return buf[self.info.offset : self.info.end].view(self.info.shape)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.info.name!r}, shape={tuple(self.shape)}, "
                f"placements={list(self._placements)}, chunk={self.chunk.chunk_id})")


class ChunkStateTensor(ChunkTensor):
    """One elementwise optimizer state of a managed parameter, laid out like the parameter.

    Args:
        chunk: The parameter's chunk.
        param: The parameter.
        state: The state's name (``"exp_avg"``, ...).
        dtype: The state's dtype (the same on every rank).
        pieces: This rank's pieces of ``state`` in the chunk: ``{(offset in the shard,
            length): values}`` of every parameter it holds a piece of (shared by the chunk's
            tensors).
        gatherer: Shared by the tensors of one save.
        position: The chunk's index in its manager.
        manager: The chunks' manager (see :class:`ChunkTensor`).
    """

    def __init__(
        self,
        chunk: Chunk,
        param: nn.Parameter,
        state: str,
        dtype: torch.dtype,
        pieces: dict[tuple[int, int], torch.Tensor],
        gatherer: ChunkGatherer | None = None,
        position: int = 0,
        manager: ChunkGroups | None = None,
    ) -> None:
        super().__init__(chunk, param, gatherer, position, manager)
        self.state, self._dtype, self._pieces = state, dtype, pieces

    @property
    def dtype(self) -> torch.dtype:
        """The state's dtype."""
        return self._dtype

    def local(self) -> torch.Tensor:
        """This rank's elements of the state (empty when it holds none of the parameter)."""
        at = self.info.offset + self._flat.start - self.chunk.shard_begin
        values = self._pieces.get((at, self._flat.numel))
        return values if values is not None else torch.empty(0, dtype=self._dtype)

    def _flat_shard(self) -> torch.Tensor:
        flat = torch.zeros(self.chunk.shard_size, dtype=self._dtype)
        for (offset, _), values in self._pieces.items():
            flat[offset : offset + values.numel()].copy_(values.reshape(-1))
        return flat


class _ChunkGroup:
    """A stand-in manager for a chunk built without one: its group, no replicas."""

    extra_dp_size = 1
    extra_dp_group = None

    def __init__(self, chunk: Chunk) -> None:
        group = getattr(chunk, "group", getattr(chunk, "_group", None))
        self.group: dist.ProcessGroup | None = group


def model_shards(
    module: GeminiDDP, gatherer: ChunkGatherer | None = None
) -> dict[str, ChunkTensor]:
    """Every managed parameter of a ``GeminiDDP`` as a :class:`ChunkTensor`, chunk by chunk.

    Each parameter appears once, under the name it was registered with (tied weights once).

    Args:
        module: The ``GeminiDDP`` model (anything with a ``chunk_manager``).
        gatherer: Shared by the tensors (a new one when None).
    """
    gatherer = gatherer if gatherer is not None else ChunkGatherer()
    out: dict[str, ChunkTensor] = {}
    for position, chunk in enumerate(module.chunk_manager.chunks):
        for p in chunk.params:
            out[chunk.infos[p].name] = ChunkTensor(chunk, p, gatherer, position,
                                                   module.chunk_manager)
    return out


def _summary(
    optimizer: GeminiOptimizer,
) -> tuple[dict[str, dict[str, tuple]], dict[tuple[int, str], dict[tuple[int, int], torch.Tensor]]]:
    """This rank's state kinds by parameter name, and its elementwise pieces per chunk."""
    kinds: dict[str, dict[str, tuple]] = {}
    pieces: dict[tuple[int, str], dict[tuple[int, int], torch.Tensor]] = {}
    for v in optimizer.master_views:
        chunk, info = v.chunk, v.chunk.infos[v.param]
        entry: dict[str, tuple] = {}
        for key, value in optimizer.optim.state.get(v.view, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == v.numel:
                entry[key] = ("elementwise", str(value.dtype).removeprefix("torch."))
                at = info.offset + v.start - chunk.shard_begin
                pieces.setdefault((id(chunk), key), {})[at, v.numel] = value.detach()
            elif isinstance(value, torch.Tensor) and value.numel() == 1:
                entry[key] = ("tensor", str(value.dtype).removeprefix("torch."), value.item())
            else:
                entry[key] = ("value", value)
        kinds[v.name] = entry
    return kinds, pieces


def optimizer_shards(
    optimizer: GeminiOptimizer, gatherer: ChunkGatherer | None = None
) -> dict[str, dict[str, object]]:
    """Each trainable parameter's optimizer states, by name, in chunk order.

    Elementwise states (shaped like this rank's piece of the parameter) become
    :class:`ChunkStateTensor`; one-element tensors (``step``) and other values are given as
    they are on the ranks holding them, on every rank. Collective over the chunks' group:
    ONE object all-gather of which states exist (a rank holds no piece of some parameters).

    Args:
        optimizer: The ``GeminiOptimizer`` (``master_views``, ``optim``, ``chunk_manager``).
        gatherer: Shared by the tensors (a new one when None).
    """
    gatherer = gatherer if gatherer is not None else ChunkGatherer()
    kinds, pieces = _summary(optimizer)
    manager = optimizer.chunk_manager
    if dist.is_initialized() and dist.get_world_size(manager.group) > 1:
        merged: dict[str, dict[str, tuple]] = {}
        for theirs in all_gather_object(kinds, manager.group):
            for name, entry in theirs.items():
                merged.setdefault(name, {}).update(entry)
        kinds = merged
    out: dict[str, dict[str, object]] = {}
    for position, chunk in enumerate(manager.chunks):
        if not chunk.requires_grad:
            continue
        for p in chunk.params:
            name = chunk.infos[p].name
            states: dict[str, object] = {}
            for key, kind in sorted(kinds.get(name, {}).items()):
                if kind[0] == "elementwise":
                    shared = pieces.setdefault((id(chunk), key), {})
                    states[key] = ChunkStateTensor(chunk, p, key, getattr(torch, kind[1]), shared,
                                                   gatherer, position, manager)
                elif kind[0] == "tensor":
                    states[key] = torch.tensor(kind[2], dtype=getattr(torch, kind[1]))
                else:
                    states[key] = kind[1]
            if states:
                out[name] = states
    return out


if TYPE_CHECKING:  # a type checker verifies that these implement the protocol

    def _implements(tensor: ChunkTensor | ChunkStateTensor) -> ShardedTensor:
        return tensor
