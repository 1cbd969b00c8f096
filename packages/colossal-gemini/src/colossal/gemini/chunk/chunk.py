"""One flat buffer holding several parameters of one dtype, sharded evenly over a group.

Life of a chunk:

1. ``append`` copies parameters (cast to the chunk dtype) into the *payload*, a flat device
   buffer; each parameter's ``.data`` becomes a view of it, for good.
2. ``close`` trims the capacity to the used elements rounded up to the group size (so the
   only waste is that padding), keeps this rank's equal *shard* ``[rank * shard_size,
   (rank + 1) * shard_size)`` (and an fp32 *master* copy of it, taken from the original
   parameter values, not from their low-precision cast) and, unless ``keep_gathered``,
   releases the payload.
3. ``gather`` all-gathers the shards into the payload and points the parameters' ``.data``
   at views of it; ``release`` frees it again: the payload's storage is resized to 0 bytes
   (as PyTorch FSDP2 does, so views of it that autograd saved see the re-gathered values,
   and hold no memory meanwhile) and each parameter's ``.data`` becomes an empty tensor of
   its dtype (so using a released parameter is a loud shape error, never a read of freed
   memory).
4. ``copy_grad`` puts gradients into a gradient buffer (chunk dtype, payload size);
   ``reduce`` reduce-scatters it (all-reduces for ``keep_gathered`` chunks) into this rank's
   *gradient shard* (in the chunk dtype, or ``grad_dtype`` when given, e.g. fp32 for
   gradient accumulation), divided by the group size when averaging.
5. After the optimizer updated the master, ``update_shard_from_master`` casts it into the
   shard and refreshes (``keep_gathered``) or releases the payload.

Every allocation, free and move is reported to the budget (by logical location), so the
budget's numbers are the chunk's real model-data footprint. At world size 1 no collective is
issued.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core.comm import (
    CommWork,
    all_gather,
    all_reduce,
    fp8_all_gather,
    fp8_all_reduce,
    fp8_reduce_scatter,
    reduce_scatter,
)
from colossal.gemini.chunk.base import ChunkBase, TensorInfo, _round_up
from colossal.gemini.chunk.states import IllegalStateTransition, TensorState, check_transition
from colossal.gemini.chunk.storage import Location, check_location, nbytes, physical_device

logger = logging.getLogger(__name__)

__all__ = ["Chunk", "TensorInfo"]

_KINDS = ("param_shards", "gathered_params", "grad_buffers", "grad_shards", "masters")


class Chunk(ChunkBase):
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
        grad_dtype: dtype of the reduced gradient shard (``None``: the chunk dtype, since
            the reduce-scatter runs in it; fp32 when backwards accumulate into it).
        shard_location: Where :meth:`close` puts the parameter shard (``"device"`` or
            ``"host"``; a ``keep_gathered`` chunk's shard is part of the device payload).
        master_location: Where :meth:`close` puts the optimizer side (master, gradient
            shard); see :meth:`move_master`.

    Raises:
        ValueError: ``chunk_size`` is not a positive int.
        TypeError: ``dtype`` or ``master_dtype`` is not a floating dtype.

    Attributes:
        fp8_communication: Gather and reduce as float8 (:mod:`colossal.core.comm.fp8`),
            synchronously; this rank's own part of the payload stays exact. Set by the
            :class:`~colossal.gemini.chunk.manager.ChunkManager`.
    """

    fp8_communication: bool = False

    @property
    def payload(self) -> torch.Tensor | None:
        """The flat payload while gathered (else ``None``)."""
        self._sync()
        return self._payload if self._gathered else None

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
            self._shard, self._shard_loc = self._payload[lo:hi], "device"
        else:
            self._shard = self._alloc.copy_of(self._payload[lo:hi], self._shard_loc,
                                              self._dtype, "shard")
        if not self._keep_gathered:
            self.release()  # before the master is allocated: a lower peak
        if self._has_master:
            assert self._master_dtype is not None  # a master copy has its own dtype
            self._master = self._alloc.zeros(self._master_loc, self.shard_size,
                                             self._master_dtype, "master")
            for p, original in zip(self._params, self._originals, strict=True):
                start, stop, view = self._range(p, self._master)
                view.copy_(original[start:stop])
        elif self._requires_grad and self._master_loc == "host":
            self._copy_master_to_host()
        self._originals.clear()

    # ----------------------------------------------------------------- gather / release
    def gather(self, *, async_op: bool = False) -> CommWork | None:
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
        if self.fp8_communication:
            self._fp8_gather(src)
            self._finish_gather()
            return None
        work = all_gather(self._payload, src, group=self._group, async_op=async_op)
        if async_op:
            self._pending = (work, src)  # the source stays alive until the gather is done
            return work
        self._finish_gather()
        return None

    def _fp8_gather(self, src: torch.Tensor) -> None:
        """All-gather the shards as float8; this rank's own part is then rewritten exactly."""
        assert self._payload is not None
        fp8_all_gather(self._payload, src, group=self._group)
        self._payload[self.shard_begin : self.shard_end].copy_(src)

    def wait(self) -> None:
        """Complete an in-flight asynchronous gather (no-op when there is none)."""
        self._sync()

    def _sync(self) -> None:
        if self._pending is not None:
            (work, _src), self._pending = self._pending, None
            work.wait()
            self._finish_gather()

    def _finish_gather(self) -> None:
        self._gathered = True
        assert self._payload is not None
        for p, info in self._infos.items():
            p.data = self._payload[info.offset : info.end].view(info.shape)
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
        for p, info in self._infos.items():
            p.data = torch.empty(0, dtype=self._dtype, device=self._device)
            info.state = TensorState.FREE

    # ----------------------------------------------------------------- states
    def set_state(self, param: nn.Parameter, state: TensorState) -> None:
        """Move one tensor to ``state``, validated against the legal transitions.

        ``FREE`` is entered only through :meth:`release`, and no other state while the
        payload is released (gather first).

        Raises:
            KeyError: ``param`` is not in this chunk.
            IllegalStateTransition: The transition is illegal.
        """
        self._require_closed("set_state()")
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
        self._require_closed("copy_grad()")
        self.finish_reduce()
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

    def reduce(
        self,
        *,
        average: bool = True,
        accumulate: bool = False,
        group: ProcessGroup | None = None,
        async_op: bool = False,
    ) -> CommWork | None:
        """Reduce the gradient buffer over the group into this rank's gradient shard.

        One reduce-scatter (``keep_gathered``: one all-reduce, then this rank's slice);
        tensors without a gradient on this rank contribute zeros, so every rank joins the
        same collective. The sum is cast to the gradient dtype (``grad_dtype``, else the
        chunk dtype: no cast) and divided by the group size when ``average``. ``accumulate`` adds it
        to an existing gradient shard (gradient accumulation) instead of replacing it. The
        buffer is freed; every tensor goes to ``HOLD`` (``FREE`` when released) as soon as
        the collective is launched.

        Args:
            average: Divide the sum by the group size.
            accumulate: Add to the existing gradient shard.
            group: Run the collective on this group instead of the chunk's (it must hold the
                same ranks in the same order, e.g. a separate group for reductions).
            async_op: Return the collective's handle; :meth:`finish_reduce` (called by any
                later ``reduce``/``copy_grad``) waits for it and writes the gradient shard.

        Raises:
            ValueError: The chunk is frozen.
        """
        self._require_closed("reduce()")
        self._sync()
        self.finish_reduce()
        if not self._requires_grad:
            raise ValueError(f"chunk {self._chunk_id} holds frozen parameters; nothing to reduce")
        if self._grad_buffer is None:
            self._grad_buffer = self._alloc.zeros("device", self._capacity, self._dtype,
                                                  "gradient buffer")
        group = self._group if group is None else group
        buf, lo, hi = self._grad_buffer, self.shard_begin, self.shard_end
        scratch, work = None, None
        if self._world == 1:
            summed = buf
        elif self._keep_gathered:
            if self.fp8_communication:
                fp8_all_reduce(buf, group=group)
            else:
                work = all_reduce(buf, group=group, async_op=async_op)
            summed = buf[lo:hi]
        else:
            scratch = self._alloc.empty("device", self.shard_size, self._dtype, "reduced grad")
            if self.fp8_communication:
                fp8_reduce_scatter(scratch, buf, group=group)
            else:
                work = reduce_scatter(scratch, buf, group=group, async_op=async_op)
            summed = scratch
        self._reducing = (work, summed, scratch, average, accumulate)
        after = TensorState.HOLD if self._gathered else TensorState.FREE
        for info in self._infos.values():
            info.state = after
        if async_op:
            return work
        self.finish_reduce()
        return None

    @property
    def reducing(self) -> bool:
        """Whether an asynchronous reduction is launched and not finished."""
        return self._reducing is not None

    def finish_reduce(self) -> None:
        """Wait for a launched reduction and write the gradient shard (no-op if none)."""
        if self._reducing is None:
            return
        (work, summed, scratch, average, accumulate), self._reducing = self._reducing, None
        if work is not None:
            work.wait()
        assert self._grad_dtype is not None
        if (scratch is not None and self.grad_shard is None and self._master_loc == "device"
                and self._grad_dtype == self._dtype):
            # The reduce-scatter's output already is a device shard of the right dtype (and
            # is accounted as device bytes): it becomes the gradient shard, no copy.
            if average:
                scratch.div_(self._world)
            self.grad_shard = scratch
            self._alloc.free(self._grad_buffer, "device")
            self._grad_buffer = None
            return
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
            if self._world > 1 and self.fp8_communication:
                self._fp8_gather(self.shard)
            elif self._world > 1:
                assert self._payload is not None
                all_gather(self._payload, self.shard, group=self._group)
        else:
            self.release()

    def set_keep_gathered(self, keep: bool) -> None:
        """Switch the chunk between sharded and kept gathered (e.g. to apply a placement plan).

        Keeping it gathered gathers the payload (one all-gather if released; every rank must
        switch the same chunks in the same order) and makes the shard a view of it, freeing
        the separate shard wherever it was. Sharding it again copies this rank's shard out of
        the payload, which stays gathered until released.

        Raises:
            RuntimeError: A tensor is in use or holds a gradient (only ``HOLD``/``FREE``
                tensors and no gradient buffer allow the switch).
        """
        self._require_closed("set_keep_gathered()")
        self._sync()
        keep = bool(keep)
        if keep == self._keep_gathered:
            return
        busy = [f"{i.name} ({i.state.name})" for i in self._infos.values()
                if i.state not in (TensorState.HOLD, TensorState.FREE)]
        if busy or self._grad_buffer is not None:
            raise RuntimeError(
                f"chunk {self._chunk_id}: keep_gathered can only change between steps; "
                f"tensors in use: {busy or 'none'}, pending gradient buffer: "
                f"{self._grad_buffer is not None}"
            )
        lo, hi = self.shard_begin, self.shard_end
        if keep:
            self.gather()
            assert self._payload is not None
            old, old_loc = self._shard, self._shard_loc
            self._shard, self._shard_loc = self._payload[lo:hi], "device"
            self._alloc.free(old, old_loc)
        else:
            assert self._payload is not None
            self._shard = self._alloc.copy_of(self._payload[lo:hi], "device", self._dtype,
                                              "shard")
        self._keep_gathered = keep

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

        The optimizer keeps its states wherever :attr:`master_location` says. A trainable
        chunk without a separate master (fp32 chunks, or ``master_weights=False``) is
        optimized on its shard; moving its optimizer side to the host gives it a host copy
        of the shard as master (the optimizer updates the copy, the step casts it back into
        the shard), and moving it back drops the copy.
        """
        location = check_location(location)
        self._require_closed("move_master()")
        if location == self._master_loc:
            return
        if self._master_is_copy and location == "device":
            self._alloc.free(self._master, self._master_loc)
            self._master, self._master_dtype, self._master_is_copy = None, None, False
        elif self._master is not None:
            self._master = self._alloc.move(self._master, self._master_loc, location, "master")
        if self.grad_shard is not None:
            self.grad_shard = self._alloc.move(self.grad_shard, self._master_loc, location,
                                               "gradient shard")
        self._master_loc = location
        if self._master is None and self._requires_grad and location == "host":
            self._copy_master_to_host()

    def _copy_master_to_host(self) -> None:
        self._master = self._alloc.copy_of(self.shard, "host", self._dtype, "master (host copy)")
        self._master_dtype, self._master_is_copy = self._dtype, True

    # ----------------------------------------------------------------- views
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

    def memory_by_kind(self) -> dict[str, dict[Location, int]]:
        """Bytes this chunk holds now, by kind and logical location.

        Kinds: ``"param_shards"`` (the separate parameter shard), ``"gathered_params"`` (the
        materialized payload: a gathered or kept-gathered chunk), ``"grad_buffers"`` (the
        unreduced gradient buffer), ``"grad_shards"`` (the reduced gradient shard) and
        ``"masters"`` (the separate master shard).
        """
        self._sync()
        out: dict[str, dict[Location, int]] = {
            k: {"device": 0, "host": 0} for k in _KINDS
        }
        if self._gathered:
            out["gathered_params"]["device"] += self.payload_bytes
        if not self._keep_gathered and self._shard is not None:
            out["param_shards"][self._shard_loc] += nbytes(self._shard)
        out["grad_buffers"]["device"] += nbytes(self._grad_buffer)
        out["grad_shards"][self._master_loc] += nbytes(self.grad_shard)
        out["masters"][self._master_loc] += nbytes(self._master)
        return out

    def __repr__(self) -> str:
        return (
            f"Chunk(id={self._chunk_id}, dtype={self._dtype}, size={self._capacity}, "
            f"used={self._numel}, tensors={len(self._params)}, world={self._world}, "
            f"gathered={self.is_gathered}, keep_gathered={self._keep_gathered})"
        )
