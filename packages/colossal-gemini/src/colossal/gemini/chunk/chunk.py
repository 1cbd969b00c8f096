"""One flat buffer holding several parameters of one dtype, sharded evenly over a group.

Life of a chunk:

1. ``append`` copies parameters (cast to the chunk dtype) into the *payload*, a flat device
   buffer; each parameter's ``.data`` becomes a view of it, for good.
2. ``close`` trims the capacity to the used elements rounded up to the group size (so the
   only waste is that padding), keeps this rank's equal *shard* ``[rank * shard_size,
   (rank + 1) * shard_size)`` (and an fp32 *master* copy of it, taken from the original
   parameter values, not from their low-precision cast) and, unless ``keep_gathered``,
   releases the payload.
3. ``gather`` all-gathers the shards into the payload; ``release`` frees it again. Released
   payloads keep their tensor and views but their storage is resized to 0 bytes (as PyTorch
   FSDP2 does): parameters keep their shapes, using one while released fails loudly, and
   tensors that autograd saved see the re-gathered values.
4. ``copy_grad`` puts gradients into a gradient buffer (chunk dtype, payload size);
   ``reduce`` reduce-scatters it (all-reduces for ``keep_gathered`` chunks) into this rank's
   *gradient shard* (fp32 when there is an fp32 master), divided by the group size when
   averaging.
5. After the optimizer updated the master, ``update_shard_from_master`` casts it into the
   shard and refreshes (``keep_gathered``) or releases the payload.

Every allocation, free and move is reported to the budget (by logical location), so the
budget's numbers are the chunk's real model-data footprint. At world size 1 no collective is
issued.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core.comm import all_gather, all_reduce, reduce_scatter
from colossal.gemini.chunk.states import IllegalStateTransition, TensorState, check_transition
from colossal.gemini.chunk.storage import (
    Allocator,
    BudgetLike,
    Location,
    check_location,
    nbytes,
    physical_device,
)

logger = logging.getLogger(__name__)

__all__ = ["Chunk", "TensorInfo"]


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


class Chunk:
    """A flat, evenly sharded buffer of parameters of one dtype.

    Args:
        chunk_size: Capacity in elements, rounded up to a multiple of the group size.
        group: Process group the chunk is sharded over (``None``: the default group, or a
            single process when torch.distributed is not initialized).
        dtype: Floating dtype of the parameter storage (e.g. ``torch.float16``).
        keep_gathered: Keep the payload materialized (small chunks): no all-gather before
            use; gradients are all-reduced.
        requires_grad: Whether the chunk holds trainable parameters (frozen chunks get no
            master, gradient buffer or gradient shard).
        master_dtype: dtype of the master shard the optimizer updates; ``None`` or equal to
            ``dtype``: no separate master, the optimizer updates :attr:`shard` itself.
        budget: Receives every allocation/free/move (``DeviceMemoryBudget`` or alike).
        pin_memory: Pin host-located tensors (when CUDA is available).
        chunk_id: Identifier used in messages and by the manager.
        accumulate_grads: Allow a second :meth:`copy_grad` for a tensor whose gradient is
            already in the buffer (added to it; ``READY_FOR_REDUCE -> READY_FOR_REDUCE``).

    Raises:
        ValueError: ``chunk_size`` is not a positive int.
        TypeError: ``dtype`` or ``master_dtype`` is not a floating dtype.
    """

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
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int (elements), got {chunk_size!r}")
        for what, dt in (("dtype", dtype), ("master_dtype", master_dtype)):
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
        self._grad_dtype = (master_dtype or dtype) if requires_grad else None
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
        self._pending = None  # an in-flight asynchronous gather
        self._payload: torch.Tensor | None = None
        self._shard: torch.Tensor | None = None
        self._master: torch.Tensor | None = None
        self._grad_buffer: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self._shard_loc: Location = "device"
        self._master_loc: Location = "device"

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
        """The dtype of the separate master shard (``None`` when there is none)."""
        return self._master_dtype

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
    def payload(self) -> torch.Tensor | None:
        """The flat payload while gathered (else ``None``)."""
        self._sync()
        return self._payload if self._gathered else None

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
        return 0 if dtype is None else torch.empty((), dtype=dtype).element_size()

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

    # ----------------------------------------------------------------- building
    def can_fit(self, numel: int) -> bool:
        """Whether ``numel`` more elements fit before the chunk is closed."""
        return not self._closed and self._numel + numel <= self._capacity

    def append(self, name: str, param: nn.Parameter) -> None:
        """Copy ``param`` into the chunk; its ``.data`` becomes a view of the payload.

        Args:
            name: The parameter's name (used in messages and states).
            param: A floating-point parameter.

        Raises:
            TypeError: ``param`` is not a floating-point tensor.
            ValueError: The chunk is closed, already holds ``param``, has no room for it, or
                ``param.requires_grad`` differs from the chunk's ``requires_grad``.
        """
        if not isinstance(param, torch.Tensor) or not param.is_floating_point():
            raise TypeError(f"chunk {self._chunk_id}: {name!r} must be a floating-point "
                            f"tensor, got {type(param).__name__} {getattr(param, 'dtype', '')}")
        if self._closed:
            raise ValueError(f"chunk {self._chunk_id} is closed; cannot append {name!r}")
        if param in self._infos:
            raise ValueError(f"chunk {self._chunk_id}: {name!r} is already in it as "
                             f"{self._infos[param].name!r}; append each parameter once")
        if param.requires_grad != self._requires_grad:
            raise ValueError(
                f"chunk {self._chunk_id}: {name!r} has requires_grad={param.requires_grad} but "
                f"the chunk holds requires_grad={self._requires_grad} parameters; frozen and "
                "trainable parameters go to separate chunks"
            )
        n = param.numel()
        if not self.can_fit(n):
            raise ValueError(
                f"chunk {self._chunk_id}: {name!r} ({n} elements) does not fit: "
                f"{self._numel} of {self._capacity} used; start a new chunk"
            )
        if self._payload is None:
            self._payload = self._alloc.empty("device", self._capacity, self._dtype, "payload")
            self._gathered = True
        view = self._payload[self._numel : self._numel + n]
        with torch.no_grad():
            view.copy_(param.detach().reshape(-1))
        if self._has_master:
            self._originals.append(param.detach().reshape(-1))
        param.data = view.view(param.shape)
        self._infos[param] = TensorInfo(name, self._numel, n, param.shape, TensorState.HOLD)
        self._params.append(param)
        self._numel += n

    def close(self) -> None:
        """Stop appending: trim, pad, keep this rank's shard (and master), release if sharded.

        A second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        new_cap = _round_up(max(self._numel, 1), self._world)
        old = self._payload
        if old is None or new_cap != self._capacity:
            payload = self._alloc.empty("device", new_cap, self._dtype, "payload")
            if old is not None:
                payload[: self._numel].copy_(old[: self._numel])
                self._alloc.free(old, "device")
            self._payload, self._capacity = payload, new_cap
            for p, info in self._infos.items():
                p.data = payload[info.offset : info.end].view(info.shape)
        self._gathered = True
        assert self._payload is not None
        self._payload[self._numel :].zero_()
        lo, hi = self.shard_begin, self.shard_end
        if self._keep_gathered:
            self._shard = self._payload[lo:hi]
        else:
            self._shard = self._alloc.copy_of(self._payload[lo:hi], "device", self._dtype, "shard")
        if not self._keep_gathered:
            self.release()  # before the master is allocated: a lower peak
        if self._has_master:
            self._master = self._alloc.zeros("device", self.shard_size, self._master_dtype,
                                             "master")
            for p, original in zip(self._params, self._originals, strict=True):
                start, stop, view = self._range(p, self._master)
                view.copy_(original[start:stop])
        self._originals.clear()

    # ----------------------------------------------------------------- gather / release
    def _require_closed(self, what: str) -> None:
        if not self._closed:
            raise RuntimeError(f"chunk {self._chunk_id}: close() it before {what}")

    def gather(self, *, async_op: bool = False) -> object | None:
        """All-gather the shards into the payload; every tensor ``FREE -> HOLD``.

        A no-op when already gathered. With ``async_op`` the collective's handle is returned
        and kept: :meth:`wait` (or any other use of the chunk) completes it.
        """
        self._require_closed("gather()")
        if self.is_gathered:
            return None
        assert self._payload is not None and self._shard is not None
        if self._alloc.budget is not None:
            self._alloc.budget.allocate(
                "device", self.payload_bytes, f"chunk {self._chunk_id} payload"
            )
        self._payload.untyped_storage().resize_(self.payload_bytes)
        src = self._shard.to(self._device)
        if self._world == 1:
            self._payload.copy_(src)
            self._finish_gather()
            return None
        work = all_gather(self._payload, src, group=self._group, async_op=async_op)
        if async_op:
            self._pending = work
            return work
        self._finish_gather()
        return None

    def wait(self) -> None:
        """Complete an in-flight asynchronous gather (no-op when there is none)."""
        self._sync()

    def _sync(self) -> None:
        if self._pending is not None:
            work, self._pending = self._pending, None
            work.wait()
            self._finish_gather()

    def _finish_gather(self) -> None:
        self._gathered = True
        for info in self._infos.values():
            check_transition(info.name, info.state, TensorState.HOLD)
            info.state = TensorState.HOLD

    def release(self) -> None:
        """Drop the payload (keep_gathered chunks: no-op); every tensor ``HOLD -> FREE``.

        Raises:
            IllegalStateTransition: A tensor is not ``HOLD`` (in use or holding a gradient).
        """
        self._sync()
        if self._keep_gathered or not self._gathered:
            return
        for info in self._infos.values():
            if info.state is not TensorState.HOLD:
                raise IllegalStateTransition(
                    info.name, info.state, TensorState.FREE,
                    f"chunk {self._chunk_id} is released only when every tensor is HOLD",
                )
        assert self._payload is not None
        self._payload.untyped_storage().resize_(0)
        if self._alloc.budget is not None:
            self._alloc.budget.free("device", self.payload_bytes)
        self._gathered = False
        for info in self._infos.values():
            info.state = TensorState.FREE

    # ----------------------------------------------------------------- states
    def _info(self, param: nn.Parameter) -> TensorInfo:
        info = self._infos.get(param)
        if info is None:
            raise KeyError(f"chunk {self._chunk_id} does not hold this parameter "
                           f"(shape {tuple(param.shape)})")
        return info

    def set_state(self, param: nn.Parameter, state: TensorState) -> None:
        """Move one tensor to ``state``, validated against the legal transitions.

        ``FREE`` is entered only through :meth:`release`, and no other state while the
        payload is released (gather first).

        Raises:
            KeyError: ``param`` is not in this chunk.
            IllegalStateTransition: The transition is illegal.
        """
        self._sync()
        info = self._info(param)
        if state is TensorState.FREE and info.state is not TensorState.FREE:
            raise IllegalStateTransition(info.name, info.state, state,
                                         "release() frees the whole chunk")
        if state is not TensorState.FREE and not self._gathered:
            raise IllegalStateTransition(info.name, info.state, state,
                                         f"chunk {self._chunk_id} is not gathered; gather() first")
        check_transition(info.name, info.state, state, accumulate=self.accumulate_grads)
        info.state = state

    def states(self) -> dict[TensorState, int]:
        """How many tensors are in each state (every state listed)."""
        self._sync()
        out = dict.fromkeys(TensorState, 0)
        for info in self._infos.values():
            out[info.state] += 1
        return out

    # ----------------------------------------------------------------- gradients
    def copy_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Write ``grad`` into the gradient buffer at ``param``'s offset; state -> READY_FOR_REDUCE.

        The buffer (chunk dtype, payload size, on the device, zero-filled) is allocated on the
        first gradient and counted in the budget. With ``accumulate_grads`` a second gradient
        for the same tensor is added.

        Raises:
            ValueError: The chunk is frozen, or ``grad`` has the wrong number of elements.
            IllegalStateTransition: The tensor cannot become ``READY_FOR_REDUCE`` now.
        """
        info = self._info(param)
        if not self._requires_grad:
            raise ValueError(f"chunk {self._chunk_id} holds frozen parameters; {info.name!r} "
                             "takes no gradient")
        if grad.numel() != info.numel:
            raise ValueError(f"gradient of {info.name!r} has {grad.numel()} elements, the "
                             f"parameter {info.numel}")
        again = info.state is TensorState.READY_FOR_REDUCE
        self.set_state(param, TensorState.READY_FOR_REDUCE)
        if self._grad_buffer is None:
            self._grad_buffer = self._alloc.zeros("device", self._capacity, self._dtype,
                                                  "gradient buffer")
        view = self._grad_buffer[info.offset : info.end]
        src = grad.detach().reshape(-1)
        view.add_(src) if again else view.copy_(src)

    def all_grads_ready(self) -> bool:
        """Whether every tensor is ``READY_FOR_REDUCE`` (always False for a frozen chunk)."""
        self._sync()
        return self._requires_grad and all(
            i.state is TensorState.READY_FOR_REDUCE for i in self._infos.values()
        )

    def reduce(self, *, average: bool = True, accumulate: bool = False) -> None:
        """Reduce the gradient buffer over the group into this rank's gradient shard.

        One reduce-scatter (``keep_gathered``: one all-reduce, then this rank's slice);
        tensors without a gradient on this rank contribute zeros, so every rank joins the
        same collective. The sum is cast to the gradient dtype (the master dtype, else the
        chunk dtype) and divided by the group size when ``average``. ``accumulate`` adds it
        to an existing gradient shard (gradient accumulation) instead of replacing it. The
        buffer is freed; every tensor goes to ``HOLD`` (``FREE`` when released).

        Raises:
            ValueError: The chunk is frozen.
        """
        self._require_closed("reduce()")
        self._sync()
        if not self._requires_grad:
            raise ValueError(f"chunk {self._chunk_id} holds frozen parameters; nothing to reduce")
        if self._grad_buffer is None:
            self._grad_buffer = self._alloc.zeros("device", self._capacity, self._dtype,
                                                  "gradient buffer")
        buf, lo, hi = self._grad_buffer, self.shard_begin, self.shard_end
        scratch = None
        if self._world == 1:
            summed = buf
        elif self._keep_gathered:
            all_reduce(buf, group=self._group)
            summed = buf[lo:hi]
        else:
            scratch = self._alloc.empty("device", self.shard_size, self._dtype, "reduced grad")
            reduce_scatter(scratch, buf, group=self._group)
            summed = scratch
        assert self._grad_dtype is not None
        reduced = summed.to(device=physical_device(self._master_loc), dtype=self._grad_dtype,
                            copy=True)
        self._alloc.free(scratch, "device")
        if average and self._world > 1:
            reduced.div_(self._world)
        if self.grad_shard is None:
            self.grad_shard = self._alloc.empty(self._master_loc, self.shard_size,
                                                self._grad_dtype, "gradient shard")
            accumulate = False
        if accumulate:
            self.grad_shard.add_(reduced)
        else:
            self.grad_shard.copy_(reduced)
        self._alloc.free(self._grad_buffer, "device")
        self._grad_buffer = None
        after = TensorState.HOLD if self._gathered else TensorState.FREE
        for info in self._infos.values():
            info.state = after

    def free_grad_shard(self) -> None:
        """Drop the gradient shard (after the optimizer step)."""
        self._alloc.free(self.grad_shard, self._master_loc)
        self.grad_shard = None

    # ----------------------------------------------------------------- optimizer side
    def update_shard_from_master(self) -> None:
        """Cast the master into the shard after an optimizer step.

        A ``keep_gathered`` payload is refreshed with one all-gather (the shard is a view
        of it); a gathered sharded payload is released (the next use gathers fresh values).

        Raises:
            IllegalStateTransition: The payload must be released but a tensor is in use.
        """
        self._require_closed("update_shard_from_master()")
        self._sync()
        if self._master is not None:
            self.shard.copy_(self._master)
        if self._keep_gathered:
            if self._world > 1:
                assert self._payload is not None
                all_gather(self._payload, self.shard, group=self._group)
        else:
            self.release()

    def move_shard(self, location: Location) -> None:
        """Move the parameter shard to ``location`` (``"device"`` or ``"host"``).

        Raises:
            ValueError: Unknown location, or a ``keep_gathered`` chunk (its shard is a view
                of the device payload).
        """
        location = check_location(location)
        self._require_closed("move_shard()")
        if location == self._shard_loc:
            return
        if self._keep_gathered:
            raise ValueError(f"chunk {self._chunk_id} is keep_gathered: its shard is part of "
                             "the device payload and cannot move; shard the chunk to offload it")
        self._shard = self._alloc.move(self.shard, self._shard_loc, location, "shard")
        self._shard_loc = location

    def move_master(self, location: Location) -> None:
        """Move the optimizer side (master, gradient shard) to ``location``.

        The optimizer keeps its states wherever :attr:`master_location` says.
        """
        location = check_location(location)
        self._require_closed("move_master()")
        if location == self._master_loc:
            return
        if self._master is not None:
            self._master = self._alloc.move(self._master, self._master_loc, location, "master")
        if self.grad_shard is not None:
            self.grad_shard = self._alloc.move(self.grad_shard, self._master_loc, location,
                                               "gradient shard")
        self._master_loc = location

    # ----------------------------------------------------------------- views
    def _range(self, param: nn.Parameter, flat: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        info = self._info(param)
        lo, hi = self.shard_begin, self.shard_end
        start = min(max(lo, info.offset), info.end) - info.offset
        stop = max(start, min(hi, info.end) - info.offset)
        first = info.offset + start - lo
        return start, stop, flat[first : first + stop - start]

    def tensor_shard(
        self, param: nn.Parameter, source: Literal["shard", "master", "grad"] = "shard"
    ) -> tuple[int, int, torch.Tensor]:
        """The part of ``param`` this rank holds.

        Args:
            param: A parameter of this chunk.
            source: Which shard to view: the parameter ``"shard"``, the ``"master"``
                (:attr:`optim_shard`) or the reduced ``"grad"`` shard.

        Returns:
            ``(start, stop, view)``: elements ``[start, stop)`` of the flattened parameter
            (``start == stop`` when this rank holds none of it) and the view of the shard
            holding them.

        Raises:
            KeyError: ``param`` is not in this chunk.
            ValueError: Unknown ``source``, or ``"grad"`` with no gradient shard.
        """
        self._require_closed("tensor_shard()")
        if source == "shard":
            flat = self.shard
        elif source == "master":
            flat = self.optim_shard
        elif source == "grad":
            if self.grad_shard is None:
                raise ValueError(f"chunk {self._chunk_id} has no gradient shard; reduce() first")
            flat = self.grad_shard
        else:
            raise ValueError(f"source must be 'shard', 'master' or 'grad', got {source!r}")
        return self._range(param, flat)

    def memory(self) -> dict[Location, int]:
        """Bytes this chunk holds now, by logical location."""
        self._sync()
        out: dict[Location, int] = {"device": 0, "host": 0}
        if self._gathered:
            out["device"] += self.payload_bytes
        if not self._keep_gathered and self._shard is not None:
            out[self._shard_loc] += nbytes(self._shard)
        out[self._master_loc] += nbytes(self._master) + nbytes(self.grad_shard)
        out["device"] += nbytes(self._grad_buffer)
        return out

    def __repr__(self) -> str:
        return (
            f"Chunk(id={self._chunk_id}, dtype={self._dtype}, size={self._capacity}, "
            f"used={self._numel}, tensors={len(self._params)}, world={self._world}, "
            f"gathered={self.is_gathered}, keep_gathered={self._keep_gathered})"
        )
