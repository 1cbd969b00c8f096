"""Run one stage's part of a schedule IR: forwards, (split) backwards and transfers."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from colossal.core import GradientAccumulator, OptimizerWrapper
from colossal.pipeline.ir import RECVS, Action, ActionType, ScheduleIR, TimelineEvent
from colossal.pipeline.microbatch import merge_outputs
from colossal.pipeline.p2p import PendingRecv, PipelineP2P
from colossal.pipeline.stage_manager import PipelineStageManager
from colossal.pipeline.tree import flatten, is_differentiable, unflatten

Key = tuple[int, int]  # (microbatch, chunk)
RECV_LOOKAHEAD = 4
"""Default of :class:`StageExecutor`'s ``recv_lookahead``."""


def call_chunk(chunk: nn.Module, inputs: object) -> Any:
    """Call a model chunk: a dict is passed as keywords, a list/tuple as positional args."""
    if isinstance(inputs, Mapping):
        return chunk(**inputs)
    if isinstance(inputs, (list, tuple)):
        return chunk(*inputs)
    return chunk(inputs)


def _as_stage_input(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Detach every tensor of ``obj``; floating ones become leaves that collect gradients."""
    tensors, spec = flatten(obj)
    leaves, diff = [], []
    for t in tensors:
        t = t.detach()
        if is_differentiable(t):
            t.requires_grad_(True)
            diff.append(t)
        leaves.append(t)
    return unflatten(leaves, spec), diff


class StageExecutor:
    """Runs this stage's actions of ``ir`` for one training step.

    Args:
        ir: The validated schedule.
        stage_manager: This rank's stage manager (gives the stage and peers' ranks).
        chunks: This stage's model chunks, in chunk order.
        p2p: The transfer helper (its metadata cache persists across steps).
        microbatches: The step's microbatches (every stage gets them; the first and the loss
            slice use them).
        criterion: ``criterion(outputs, microbatch) -> scalar loss`` on the last slice.
        optimizer: Optional optimizer wrapper providing ``backward`` / ``backward_by_grad``.
            If it also has ``no_sync()`` (data-parallel gradient reduction, e.g. ZeRO stage 1),
            every backward but the stage's last weight-gradient one runs under it, so the
            gradients are reduced once per step, after the last microbatch.
        return_outputs: Keep the last slice's outputs.
        record_timeline: Record the start and end of every compute action.
        recv_lookahead: Post each receive this many compute actions before the one that uses
            it (with the transfers before an earlier compute), so its data arrives while the
            stage computes; 0 posts it where the IR has it, right before its use. A receive is
            still waited for only at its use.
        forward_only: Run without autograd and keep nothing for a backward (an IR of
            forwards only, for evaluation).
    """

    def __init__(
        self,
        ir: ScheduleIR,
        stage_manager: PipelineStageManager,
        chunks: Sequence[nn.Module],
        p2p: PipelineP2P,
        microbatches: Sequence[object],
        criterion: Callable[[Any, Any], torch.Tensor],
        optimizer: OptimizerWrapper | None = None,
        return_outputs: bool = False,
        record_timeline: bool = False,
        recv_lookahead: int = RECV_LOOKAHEAD,
        forward_only: bool = False,
    ) -> None:
        self.ir = ir
        self.forward_only = forward_only
        self.sm = stage_manager
        self.stage = stage_manager.stage
        self.chunks = list(chunks)
        self.p2p = p2p
        self.microbatches = list(microbatches)
        self.criterion = criterion
        self.optimizer = optimizer
        self.return_outputs = return_outputs
        self.record_timeline = record_timeline
        if not isinstance(recv_lookahead, int) or recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be an int >= 0, got {recv_lookahead!r}")
        self.recv_lookahead = recv_lookahead
        self.layout = ir.layout
        self.last_slice = ir.layout.num_slices - 1
        self.params = [[p for p in c.parameters() if p.requires_grad] for c in self.chunks]
        self._no_sync = _local_accumulation(optimizer)
        self._compute = -1  # index of the running compute action
        self._sync_compute = -1  # the last compute action that accumulates weight gradients
        self.inputs: dict[Key, Any] = {}
        self.saved: dict[Key, tuple[list[torch.Tensor], Any]] = {}
        self.out_grads: dict[Key, Any] = {}
        self.to_send: dict[Key, list[torch.Tensor]] = {}
        self.split_grads: dict[Key, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}
        self.timeline: list[TimelineEvent] = []
        self.comm_timeline: list[TimelineEvent] = []
        self.wait_timeline: list[TimelineEvent] = []
        # every receive with the index of the compute action that uses it, in IR order
        self._recvs: list[tuple[int, Action]] = []
        self._next_recv = 0
        self._post_time: dict[Action, float] = {}
        computes = 0
        for a in ir.actions[self.stage]:
            if a.type.is_compute:
                if a.type == ActionType.BACKWARD or (
                    a.type == ActionType.BACKWARD_WEIGHT and self.params[a.chunk]
                ):
                    self._sync_compute = computes
                computes += 1
            elif a.type in RECVS:
                self._recvs.append((computes, a))

    # ---- helpers -----------------------------------------------------------------------
    def _slice(self, chunk: int) -> int:
        return self.layout.slice_of(self.stage, chunk)

    def _local(self, slice_index: int) -> int | None:
        """The local chunk holding ``slice_index``, if it is on this stage."""
        if not 0 <= slice_index <= self.last_slice:
            return None
        stage, chunk = self.layout.locate(slice_index)
        return chunk if stage == self.stage else None

    def _peer_rank(self, action: Action) -> int:
        """Global rank of the stage on the other side of the transfer ``action``."""
        stage = self.ir.peer(self.stage, action)
        assert stage is not None, action  # only compute actions have no peer
        return self.sm.get_rank(stage)

    def _backward(
        self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None, **kw: Any
    ) -> None:
        if not tensors:
            return
        if self.optimizer is None:
            torch.autograd.backward(tensors, grads, **kw)
            return
        local = self._no_sync is not None and self._compute != self._sync_compute
        with self._no_sync() if local else contextlib.nullcontext():  # type: ignore[misc]
            if grads is None:  # the loss
                self.optimizer.backward(tensors[0], **kw)
            else:
                # torch.autograd.backward takes the lists; the wrappers pass them through
                self.optimizer.backward_by_grad(tensors, grads, **kw)  # type: ignore[arg-type]

    def _wait_grads(self, key: Key) -> list[torch.Tensor] | None:
        """The gradients of a chunk's outputs (``None`` for the loss), waiting if in flight."""
        if self._slice(key[1]) == self.last_slice:
            return None
        return self._resolve(Action(ActionType.RECV_BACKWARD, *key), self.out_grads.pop(key))

    def _grad_targets(
        self, key: Key, out: Any, grads: list[torch.Tensor] | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The tensors to back-propagate from and their gradients (``None`` for the loss)."""
        if grads is None:
            return [out], None
        outs = [t for t in flatten(out)[0] if is_differentiable(t)]
        if len(grads) != len(outs):
            raise RuntimeError(
                f"stage {self.stage}: got {len(grads)} gradients for {len(outs)} floating outputs "
                f"of microbatch {key[0]} chunk {key[1]}"
            )
        pairs = [(t, g) for t, g in zip(outs, grads, strict=True) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _route_input_grads(self, key: Key, diff_inputs: list[torch.Tensor]) -> None:
        mb, chunk = key
        v = self._slice(chunk)
        if v == 0:
            return
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in diff_inputs]
        prev = self._local(v - 1)
        if prev is not None:
            self.out_grads[(mb, prev)] = grads
        else:
            self.to_send[key] = grads

    # ---- compute -----------------------------------------------------------------------
    def _forward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        v = self._slice(chunk)
        received = None
        if v > 0:
            received = self._resolve(Action(ActionType.RECV_FORWARD, *key), self.inputs.pop(key))
        start = time.perf_counter()  # timed from here: input preparation is part of the forward
        diff: list[torch.Tensor]
        if v == 0:
            args, diff = self.microbatches[mb], []
        else:
            args, diff = _as_stage_input(received)
        with self.sm.switch_model_chunk_id(chunk):
            out = call_chunk(self.chunks[chunk], args)
        if v == self.last_slice:
            loss = self.criterion(out, self.microbatches[mb])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(f"criterion must return a scalar tensor, got {loss!r}")
            if self.return_outputs:
                self.outputs[mb] = unflatten(*_detached(out))
            out = loss.reshape(()) / len(self.microbatches)
            self.losses.append(out.detach())
        # Forward-only: no graph is kept; the output waits here only for its send.
        self.saved[key] = ([], out) if self.forward_only else (diff, out)
        nxt = self._local(v + 1)
        if nxt is not None:
            self.inputs[(mb, nxt)] = out
        self._record(Action(ActionType.FORWARD, mb, chunk), start)

    def _full_backward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        diff, out = self.saved.pop(key)
        received = self._wait_grads(key)
        start = time.perf_counter()
        tensors, grads = self._grad_targets(key, out, received)
        self._backward(tensors, grads)
        self._route_input_grads(key, diff)
        self._record(Action(ActionType.BACKWARD, mb, chunk), start)

    def _input_backward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        diff, out = self.saved[key]
        received = self._wait_grads(key)
        start = time.perf_counter()
        tensors, grads = self._grad_targets(key, out, received)
        self.split_grads[key] = (tensors, grads)
        if diff:
            self._backward(tensors, grads, inputs=diff, retain_graph=True)
        self._route_input_grads(key, diff)
        self._record(Action(ActionType.BACKWARD_INPUT, mb, chunk), start)

    def _weight_backward(self, mb: int, chunk: int) -> None:
        key = (mb, chunk)
        self.saved.pop(key)
        tensors, grads = self.split_grads.pop(key)
        start = time.perf_counter()
        if self.params[chunk]:
            self._backward(tensors, grads, inputs=self.params[chunk])
        self._record(Action(ActionType.BACKWARD_WEIGHT, mb, chunk), start)

    def _record(self, action: Action, start: float) -> None:
        if self.record_timeline:
            self.timeline.append(TimelineEvent(self.stage, action, start, time.perf_counter()))

    def _resolve(self, action: Action, value: Any) -> Any:
        """Wait for a received value; record the wait (receives are timed when used)."""
        if not isinstance(value, PendingRecv):
            return value
        start = time.perf_counter()
        out = value.wait()
        if self.record_timeline:
            self.wait_timeline.append(TimelineEvent(self.stage, action, start, time.perf_counter()))
        return out

    # ---- transfers ---------------------------------------------------------------------
    def _transfer(self, batch: Sequence[Action], compute_index: int) -> None:
        """Post ``batch``'s sends and every receive used up to compute ``compute_index + k``.

        ``batch`` holds the IR's transfers right before compute action ``compute_index``;
        ``k`` is :attr:`recv_lookahead`. Receives of ``batch`` were usually posted earlier.
        """
        start = time.perf_counter()
        sends, posted = [], []
        for a in batch:
            if a.type in RECVS:
                continue
            key = (a.microbatch, a.chunk)
            peer = self._peer_rank(a)
            tag = self.ir.channel(self.stage, a)
            if a.type == ActionType.SEND_FORWARD:
                out = self.saved.pop(key)[1] if self.forward_only else self.saved[key][1]
                sends.append((out, peer, tag))
            else:
                sends.append((self.to_send.pop(key), peer, tag))
            posted.append(a)
        recvs = []
        upto = compute_index + self.recv_lookahead
        while self._next_recv < len(self._recvs) and self._recvs[self._next_recv][0] <= upto:
            a = self._recvs[self._next_recv][1]
            self._next_recv += 1
            peer = self._peer_rank(a)
            recvs.append((peer, self.ir.channel(self.stage, a)))
            posted.append(a)
        if posted:
            received = self.p2p.exchange(sends, recvs)
            for a, pending in zip(posted[len(sends) :], received, strict=True):
                box = self.inputs if a.type == ActionType.RECV_FORWARD else self.out_grads
                box[(a.microbatch, a.chunk)] = pending
        if self.record_timeline:
            self._record_comm(batch, posted, start)

    def _record_comm(self, batch: Sequence[Action], posted: list[Action], start: float) -> None:
        """Record ``batch``'s transfers, each with its share of the time spent posting.

        A call's posting time is shared evenly by the transfers it posted; a receive posted
        ahead keeps its share until its place in the IR, where it is recorded.
        """
        if posted:
            share = (time.perf_counter() - start) / len(posted)
            for a in posted:
                self._post_time[a] = share
        t = start
        for a in batch:
            d = self._post_time.pop(a, 0.0)
            self.comm_timeline.append(TimelineEvent(self.stage, a, t, t + d))
            t += d

    # ---- main loop ---------------------------------------------------------------------
    def run(self) -> tuple[torch.Tensor | None, Any]:
        """Run every action; return the summed loss and the merged outputs (last slice only)."""
        compute = {
            ActionType.FORWARD: self._forward,
            ActionType.BACKWARD: self._full_backward,
            ActionType.BACKWARD_INPUT: self._input_backward,
            ActionType.BACKWARD_WEIGHT: self._weight_backward,
        }
        acts = self.ir.actions[self.stage]
        i = k = 0
        self.p2p.begin_step()
        try:
            with torch.set_grad_enabled(not self.forward_only):
                while i < len(acts):
                    j = i
                    while j < len(acts) and acts[j].type.is_comm:
                        j += 1
                    self._transfer(acts[i:j], k)  # the transfers before compute action k
                    if j < len(acts):
                        a = acts[j]
                        self._compute = k
                        compute[a.type](a.microbatch, a.chunk)
                        k += 1
                    i = j + 1
        except BaseException:
            self.p2p.end_step(wait=False)
            raise
        self.p2p.end_step()
        loss = torch.stack(self.losses).sum() if self.losses else None
        outputs = (
            merge_outputs([self.outputs[k] for k in sorted(self.outputs)]) if self.outputs else None
        )
        return loss, outputs


def _local_accumulation(optimizer: Any) -> Callable[[], Any] | None:
    """``optimizer.no_sync`` of a gradient accumulator (checked to work), else ``None``.

    The optimizer must implement :class:`colossal.core.GradientAccumulator`.

    Raises:
        ValueError: the optimizer refuses to accumulate locally (e.g. ZeRO stage 2); raised
            before the step communicates, so no stage is left waiting.
    """
    if not isinstance(optimizer, GradientAccumulator):
        return None
    no_sync = optimizer.no_sync
    try:
        with no_sync():
            pass
    except RuntimeError as err:
        raise ValueError(
            "pipeline schedules accumulate the gradients of every microbatch locally and "
            "reduce them once per step, through optimizer.no_sync(); "
            f"{type(optimizer).__name__} refused it: {err}"
        ) from err
    return no_sync


def _detached(obj: Any) -> tuple[list[torch.Tensor], Any]:
    tensors, spec = flatten(obj)
    return [t.detach() for t in tensors], spec
