"""Geometry, storage fields and read-only views of a chunk (behaviour: ``chunk.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.gemini.chunk.states import TensorState
from colossal.gemini.chunk.storage import (
    Allocator,
    BudgetLike,
    Location,
    check_location,
    physical_device,
)

__all__ = ["ChunkBase", "TensorInfo"]


@dataclass
class TensorInfo:
    """One tensor's place and state in its chunk.

    Attributes:
        name: The parameter's name.
        offset: First element in the chunk payload.
        numel: Number of elements.
        shape: The parameter's shape.
        state: Its current :class:`TensorState`.
    """

    name: str
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState

    @property
    def end(self) -> int:
        """One past the last element in the payload."""
        return self.offset + self.numel


def _group_geometry(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None and not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class ChunkBase:
    """What a chunk is: its geometry, its tensors and their views; see :class:`Chunk`."""

    def __init__(
        self,
        chunk_size: int,
        group: ProcessGroup | None,
        dtype: torch.dtype,
        *,
        keep_gathered: bool = False,
        requires_grad: bool = True,
        master_dtype: torch.dtype | None = torch.float32,
        budget: BudgetLike | None = None,
        pin_memory: bool = False,
        chunk_id: int = 0,
        accumulate_grads: bool = False,
        grad_dtype: torch.dtype | None = None,
        shard_location: Location = "device",
        master_location: Location = "device",
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (elements), got {chunk_size!r}")
        for what, dt in (("dtype", dtype), ("master_dtype", master_dtype),
                         ("grad_dtype", grad_dtype)):
            if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
                raise TypeError(f"{what} must be a floating torch.dtype, got {dt!r}")
        self._group = group
        self._world, self._rank = _group_geometry(group)
        self._capacity = _round_up(chunk_size, self._world)
        self._dtype = dtype
        self._keep_gathered = bool(keep_gathered)
        self._requires_grad = bool(requires_grad)
        self._has_master = requires_grad and master_dtype is not None and master_dtype != dtype
        self._master_dtype = master_dtype if self._has_master else None
        # The reduced gradient shard keeps the chunk dtype (the reduce-scatter already ran in
        # it): 2 bytes per element in fp16/bf16, upcast only where the optimizer reads it.
        self._grad_dtype = (grad_dtype or dtype) if requires_grad else None
        self._chunk_id = int(chunk_id)
        self.accumulate_grads = bool(accumulate_grads)
        self._alloc = Allocator(budget, pin_memory, f"chunk {chunk_id}")
        self._device = physical_device("device")

        self._infos: dict[nn.Parameter, TensorInfo] = {}
        self._params: list[nn.Parameter] = []
        self._originals: list[torch.Tensor] = []  # pre-cast values, until close()
        self._numel = 0
        self._closed = False
        self._gathered = False
        self._pending: tuple[Any, torch.Tensor] | None = None  # in-flight gather, its source
        self._payload: torch.Tensor | None = None
        self._shard: torch.Tensor | None = None
        self._master: torch.Tensor | None = None
        self._grad_buffer: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._reducing: tuple[Any, ...] | None = None  # launched reduction (see finish_reduce)
        self._shard_loc: Location = check_location(shard_location)
        self._master_loc: Location = check_location(master_location)
        self._master_is_copy = False  # a host copy of the shard made by move_master (no
        #                               separate master dtype): dropped when moved back

    # ----------------------------------------------------------------- properties
    @property
    def chunk_id(self) -> int:
        """Identifier of the chunk."""
        return self._chunk_id

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the parameter storage."""
        return self._dtype

    @property
    def master_dtype(self) -> torch.dtype | None:
        """The dtype of the separate master shard (``None`` when there is none).

        A chunk without one whose optimizer side was moved to the host has a host copy of
        its shard as master: its dtype is the chunk dtype then.
        """
        return self._master_dtype

    @property
    def grad_dtype(self) -> torch.dtype | None:
        """The dtype of the reduced gradient shard (``None`` for a frozen chunk)."""
        return self._grad_dtype

    @property
    def chunk_size(self) -> int:
        """Capacity in elements (a multiple of the group size; trimmed by ``close``)."""
        return self._capacity

    @property
    def shard_size(self) -> int:
        """Elements of each rank's shard."""
        return self._capacity // self._world

    @property
    def numel(self) -> int:
        """Elements used by parameters (the rest is padding)."""
        return self._numel

    @property
    def world_size(self) -> int:
        """Size of the process group."""
        return self._world

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def group(self) -> ProcessGroup | None:
        """The process group."""
        return self._group

    @property
    def shard_begin(self) -> int:
        """First payload element of this rank's shard."""
        return self._rank * self.shard_size

    @property
    def shard_end(self) -> int:
        """One past the last payload element of this rank's shard."""
        return (self._rank + 1) * self.shard_size

    @property
    def keep_gathered(self) -> bool:
        """Whether the payload stays materialized."""
        return self._keep_gathered

    @property
    def requires_grad(self) -> bool:
        """Whether the chunk holds trainable parameters."""
        return self._requires_grad

    @property
    def is_closed(self) -> bool:
        """Whether ``close`` has run."""
        return self._closed

    @property
    def is_gathered(self) -> bool:
        """Whether the full payload is materialized here (an in-flight gather counts)."""
        return self._gathered or self._pending is not None

    @property
    def params(self) -> list[nn.Parameter]:
        """The parameters, in payload order."""
        return list(self._params)

    @property
    def infos(self) -> dict[nn.Parameter, TensorInfo]:
        """Each parameter's :class:`TensorInfo`, keyed by the parameter (identity)."""
        return self._infos

    @property
    def shard(self) -> torch.Tensor:
        """This rank's low-precision parameter elements (a payload view if keep_gathered)."""
        if self._shard is None:
            raise RuntimeError(f"chunk {self._chunk_id} has no shard before close()")
        return self._shard

    @property
    def master(self) -> torch.Tensor | None:
        """The separate master shard; ``None`` when the optimizer updates :attr:`shard`."""
        return self._master

    @property
    def optim_shard(self) -> torch.Tensor:
        """The tensor the optimizer updates: :attr:`master`, or :attr:`shard` without one."""
        return self._master if self._master is not None else self.shard

    @property
    def shard_location(self) -> Location:
        """Logical location of the parameter shard."""
        return self._shard_loc

    @property
    def master_location(self) -> Location:
        """Logical location of the master, the gradient shard and the optimizer states."""
        return self._master_loc

    def _elsize(self, dtype: torch.dtype | None) -> int:
        return 0 if dtype is None else dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        """Bytes of the payload when gathered."""
        return self._capacity * self._elsize(self._dtype)

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's parameter shard."""
        return self.shard_size * self._elsize(self._dtype)

    @property
    def master_bytes(self) -> int:
        """Bytes of the separate master shard (0 without one)."""
        return self.shard_size * self._elsize(self._master_dtype)

    def _require_closed(self, what: str) -> None:
        if not self._closed:
            raise RuntimeError(f"chunk {self._chunk_id}: close() it before {what}")

    def _info(self, param: nn.Parameter) -> TensorInfo:
        info = self._infos.get(param)
        if info is None:
            raise KeyError(f"chunk {self._chunk_id} does not hold this parameter "
                           f"(shape {tuple(param.shape)})")
        return info

    def shard_range(self, param: nn.Parameter) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the flattened ``param`` this rank's shard holds.

        ``start == stop`` when it holds none of them. As :meth:`tensor_shard` without a view.

        Raises:
            KeyError: ``param`` is not in this chunk.
            RuntimeError: The chunk is not closed yet.
        """
        self._require_closed("shard_range()")
        return self._span(self._info(param))

    def _span(self, info: TensorInfo) -> tuple[int, int]:
        lo, hi = self.shard_begin, self.shard_end
        start = min(max(lo, info.offset), info.end) - info.offset
        return start, max(start, min(hi, info.end) - info.offset)

    def _range(self, param: nn.Parameter, flat: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        info = self._info(param)
        start, stop = self._span(info)
        first = info.offset + start - self.shard_begin
        return start, stop, flat[first : first + stop - start]
