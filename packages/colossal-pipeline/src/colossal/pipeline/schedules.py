"""Schedule classes (ColossalAI's names): each generates its IR and runs it with the executor."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import nn

from colossal.core import OptimizerWrapper, get_accelerator
from colossal.pipeline.executor import RECV_LOOKAHEAD, StageExecutor
from colossal.pipeline.generators import (
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_v,
)
from colossal.pipeline.ir import ScheduleIR, TimelineEvent
from colossal.pipeline.microbatch import (
    Batch,
    batch_size,
    resolve_num_microbatches,
    split_batch,
)
from colossal.pipeline.p2p import PipelineP2P
from colossal.pipeline.shared import SharedParamGradSync
from colossal.pipeline.simulate import ActionCosts
from colossal.pipeline.stage_manager import PipelineStageManager
from colossal.pipeline.v_schedule import ScheduledNode, nodes_to_ir
from colossal.pipeline.validate import validate_schedule

logger = logging.getLogger(__name__)


def _positive_or_none(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


def _require_manager(stage_manager: object) -> PipelineStageManager:
    if not isinstance(stage_manager, PipelineStageManager):
        raise TypeError(
            f"stage_manager must be a PipelineStageManager, got {type(stage_manager).__name__}"
        )
    return stage_manager


@overload
def _to_device(batch: Batch, device: torch.device) -> Batch: ...


@overload
def _to_device(batch: object, device: torch.device) -> object: ...


def _to_device(batch: object, device: torch.device) -> object:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


class PipelineSchedule(ABC):
    """Base of the pipeline schedules: microbatching, IR cache, execution, post-backward hooks.

    Args:
        stage_manager: This rank's stage manager.
        num_microbatches: Microbatches per step (or give ``microbatch_size``).
        microbatch_size: Samples per microbatch (or give ``num_microbatches``).
        enable_metadata_cache: Send the metadata of stage inputs/outputs once and again only
            when it changes (see :class:`~colossal.pipeline.p2p.PipelineP2P`).
        shared_params: ``{stage: parameter}`` mappings of parameters tied across stages, whose
            gradients are summed after the backward (see :class:`SharedParamGradSync`).
        record_timeline: Record every compute action's start and end in :attr:`last_timeline`,
            the posting of every transfer (a batch's time shared by its actions) in
            :attr:`last_comm_timeline`, and every receive's wait (at the compute that uses it)
            in :attr:`last_wait_timeline`. Times are ``time.perf_counter()``.
        recv_lookahead: Post every receive this many compute actions before the one that uses
            it, so its data arrives while the stage computes (it is still waited for only at
            its use); costs at most this many extra receive buffers. 0 posts receives where the
            IR has them, right before their use.

    Raises:
        TypeError: ``stage_manager`` is not a :class:`PipelineStageManager`.
        ValueError: Neither or a non-positive ``num_microbatches`` / ``microbatch_size``.
    """

    name = "base"

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        enable_metadata_cache: bool = True,
        shared_params: Sequence[Mapping[int, torch.Tensor | None]] | None = None,
        record_timeline: bool = False,
        recv_lookahead: int = RECV_LOOKAHEAD,
    ) -> None:
        _require_manager(stage_manager)
        if not isinstance(recv_lookahead, int) or recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be an int >= 0, got {recv_lookahead!r}")
        _positive_or_none("num_microbatches", num_microbatches)
        _positive_or_none("microbatch_size", microbatch_size)
        if num_microbatches is None and microbatch_size is None:
            raise ValueError(f"{type(self).__name__} needs num_microbatches or microbatch_size")
        self.stage_manager = stage_manager
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.p2p = PipelineP2P(stage_manager.pp_group, enable_metadata_cache)
        self.shared_params = SharedParamGradSync(stage_manager, shared_params or [])
        self.record_timeline = record_timeline
        self.recv_lookahead = recv_lookahead
        self.last_timeline: list[TimelineEvent] = []
        self.last_comm_timeline: list[TimelineEvent] = []
        self.last_wait_timeline: list[TimelineEvent] = []
        self._hooks: list[Callable[[], None]] = []
        self._irs: dict[int, ScheduleIR] = {}
        self._forward_irs: dict[int, ScheduleIR] = {}

    @property
    def num_model_chunks(self) -> int:
        """Model chunks per stage."""
        return self.stage_manager.num_model_chunks

    @abstractmethod
    def generate(self, num_microbatches: int) -> ScheduleIR:
        """The schedule IR for ``num_microbatches`` microbatches."""

    def get_ir(self, num_microbatches: int) -> ScheduleIR:
        """The validated IR for ``num_microbatches`` (generated once, then cached)."""
        if num_microbatches not in self._irs:
            ir = self.generate(num_microbatches)
            validate_schedule(ir)
            logger.debug(
                "%s: validated schedule for %d microbatches\n%s",
                self.name,
                num_microbatches,
                ir.format(compute_only=True),
            )
            self._irs[num_microbatches] = ir
        return self._irs[num_microbatches]

    def get_forward_ir(self, num_microbatches: int) -> ScheduleIR:
        """The forwards-only IR on this schedule's layout (evaluation; cached)."""
        if num_microbatches not in self._forward_irs:
            layout = self.get_ir(num_microbatches).layout
            self._forward_irs[num_microbatches] = forward_only(
                layout, num_microbatches, f"{self.name}-forward"
            )
        return self._forward_irs[num_microbatches]

    def register_post_backward_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after each step's backward, once every gradient is final.

        Hooks run in registration order, after tied-parameter gradients are summed; use one to
        reduce gradients for data parallelism, or to step any optimizer (plain or ZeRO).
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        self._hooks.append(hook)

    def _chunks(self, model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
        chunks = (
            [model]
            if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList)
            else list(model)
        )
        if len(chunks) != self.num_model_chunks or not all(
            isinstance(c, nn.Module) for c in chunks
        ):
            raise ValueError(
                f"{type(self).__name__} on stage {self.stage_manager.stage} needs "
                f"{self.num_model_chunks} model chunk(s) (an nn.Module or a list of them), got "
                f"{len(chunks)}: {[type(c).__name__ for c in chunks]}"
            )
        return chunks

    def forward_backward_step(
        self,
        model: nn.Module | Sequence[nn.Module],
        data_iter: Iterator[Batch],
        criterion: Callable[[Any, Any], torch.Tensor],
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = False,
        return_outputs: bool = False,
        sync_shared_params: bool = True,
    ) -> dict[str, Any]:
        """Run forward and backward of one batch through the pipeline.

        Every rank draws one batch (a tensor or a dict of tensors) from ``data_iter`` and
        splits it along dimension 0 into microbatches. The first model slice is called with
        a microbatch (a dict as keyword arguments), every other slice with the previous
        slice's output (a dict as keywords, a tuple as positional arguments). The last slice
        computes ``criterion(outputs, microbatch) / num_microbatches``; gradients accumulate
        into ``.grad`` (call ``zero_grad`` yourself). Under ``torch.no_grad()`` (evaluation)
        only the forwards run, every microbatch through the stages in order, and no gradient,
        optimizer or post-backward hook is touched (ColossalAI's ``forward_only``).

        Args:
            model: This stage's module, or its list of model chunks.
            data_iter: Iterator yielding batches.
            criterion: ``criterion(outputs, microbatch) -> scalar tensor``.
            optimizer: Optional optimizer wrapper; its ``backward`` / ``backward_by_grad`` run
                the backward (so loss scaling applies; gradients sent between stages carry
                the last stage's loss scale). Plain autograd otherwise. An optimizer with
                ``no_sync()`` (e.g. ``LowLevelZeroOptimizer`` at stage 1) accumulates every
                microbatch locally and reduces its gradients once, in the stage's last
                weight-gradient backward.
            return_loss: Return the loss (on the rank holding the last slice).
            return_outputs: Return the last slice's outputs, concatenated over microbatches.
            sync_shared_params: Sum the gradients of parameters tied across stages after the
                backward (and run the post-backward hooks). Pass False for all but the last
                of several calls that accumulate gradients (the sum is linear: summing the
                accumulated gradients once counts every call once; summing after each call
                would count the earlier ones again).

        Returns:
            ``{"loss": tensor or None, "outputs": object or None}``; both are ``None`` on ranks
            that do not hold the last slice.

        Raises:
            ValueError: The batch does not split into the configured microbatches, the
                wrong number of model chunks, or an optimizer whose ``no_sync()`` refuses
                local accumulation (ZeRO stage 2).
        """
        chunks = self._chunks(model)
        if optimizer is not None and not (
            hasattr(optimizer, "backward") and hasattr(optimizer, "backward_by_grad")
        ):
            raise TypeError(
                f"optimizer must provide backward(loss) and backward_by_grad(tensor, grad) "
                f"(wrap it in colossal.core.OptimizerWrapper), got {type(optimizer).__name__}"
            )
        batch = _to_device(next(data_iter), get_accelerator().get_current_device())
        num = resolve_num_microbatches(
            batch_size(batch), self.num_microbatches, self.microbatch_size
        )
        evaluating = not torch.is_grad_enabled()
        executor = StageExecutor(
            self.get_forward_ir(num) if evaluating else self.get_ir(num),
            self.stage_manager,
            chunks,
            self.p2p,
            split_batch(batch, num),
            criterion,
            optimizer=None if evaluating else optimizer,
            return_outputs=return_outputs,
            record_timeline=self.record_timeline,
            recv_lookahead=self.recv_lookahead,
            forward_only=evaluating,
        )
        loss, outputs = executor.run()
        self.last_timeline = executor.timeline
        self.last_comm_timeline = executor.comm_timeline
        self.last_wait_timeline = executor.wait_timeline
        if sync_shared_params and not evaluating:
            self.shared_params()
            for hook in self._hooks:
                hook()
        return {
            "loss": loss if return_loss else None,
            "outputs": outputs if return_outputs else None,
        }


class GPipeSchedule(PipelineSchedule):
    """GPipe: every microbatch forward, then every backward (any number of chunks, loop layout)."""

    name = "gpipe"

    def __init__(self, stage_manager: PipelineStageManager, *args: Any, **kwargs: Any) -> None:
        if _require_manager(stage_manager).use_zbv:
            raise ValueError(
                "GPipeSchedule runs the loop layout; create the stage manager with use_zbv=False"
            )
        super().__init__(stage_manager, *args, **kwargs)

    def generate(self, num_microbatches: int) -> ScheduleIR:
        """GPipe IR."""
        return gpipe(self.stage_manager.num_stages, num_microbatches, self.num_model_chunks)


class OneForwardOneBackwardSchedule(PipelineSchedule):
    """1F1B: warm-up forwards, then alternating forward and backward (one chunk per stage)."""

    name = "1f1b"

    def __init__(self, stage_manager: PipelineStageManager, *args: Any, **kwargs: Any) -> None:
        if _require_manager(stage_manager).num_model_chunks != 1:
            raise ValueError(
                f"OneForwardOneBackwardSchedule needs 1 model chunk per stage, the stage manager "
                f"has {stage_manager.num_model_chunks}; use InterleavedSchedule"
            )
        super().__init__(stage_manager, *args, **kwargs)

    def generate(self, num_microbatches: int) -> ScheduleIR:
        """1F1B IR."""
        return one_f_one_b(self.stage_manager.num_stages, num_microbatches)


class InterleavedSchedule(PipelineSchedule):
    """Interleaved 1F1B over ``num_model_chunks`` chunks per stage (Megatron's order).

    Args:
        stage_manager: Stage manager created with ``enable_interleave=True`` and the same
            ``num_model_chunks``.
        num_model_chunks: Model chunks per stage.
        *args: See :class:`PipelineSchedule`.
        **kwargs: See :class:`PipelineSchedule`.

    Raises:
        ValueError: Chunks disagree with the stage manager, or ``num_microbatches`` is not a
            multiple of the number of stages.
    """

    name = "interleaved"

    def __init__(
        self, stage_manager: PipelineStageManager, num_model_chunks: int, *args: Any, **kwargs: Any
    ) -> None:
        if (
            _require_manager(stage_manager).use_zbv
            or stage_manager.num_model_chunks != num_model_chunks
        ):
            raise ValueError(
                f"InterleavedSchedule(num_model_chunks={num_model_chunks}) needs a stage manager "
                "with enable_interleave=True, use_zbv=False and "
                f"num_model_chunks={num_model_chunks}; "
                f"got {stage_manager!r}"
            )
        super().__init__(stage_manager, *args, **kwargs)
        s = stage_manager.num_stages
        if self.num_microbatches is not None and self.num_microbatches % s:
            raise ValueError(
                f"InterleavedSchedule needs num_microbatches ({self.num_microbatches}) to be a "
                f"multiple of the {s} stages"
            )

    def generate(self, num_microbatches: int) -> ScheduleIR:
        """Interleaved 1F1B IR."""
        return interleaved_1f1b(
            self.stage_manager.num_stages, num_microbatches, self.num_model_chunks
        )


class ZeroBubbleVPipeScheduler(PipelineSchedule):
    """Zero-bubble V: two chunks per stage in a V, backward split into input and weight parts.

    Args:
        stage_manager: Stage manager created with ``use_zbv=True, num_model_chunks=2``.
        num_model_chunks: Must be 2.
        num_microbatches: See :class:`PipelineSchedule`.
        microbatch_size: See :class:`PipelineSchedule`.
        costs: Relative costs of F, I, W and transfers the schedule is optimised for
            (uniform by default).
        max_in_flight: Activations (microbatch x chunk) a stage may hold; ``2 x stages`` by
            default (1F1B's memory).
        schedule: ColossalAI's node lists (``PipelineGraph(...).get_v_schedule()``, see
            :mod:`colossal.pipeline.v_schedule`): run their order instead of generating one.
        **kwargs: See :class:`PipelineSchedule` (``num_microbatch``: ColossalAI's name of
            ``num_microbatches``).
    """

    name = "zbv"

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_model_chunks: int = 2,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        costs: ActionCosts | None = None,
        max_in_flight: int | None = None,
        schedule: Sequence[Sequence[ScheduledNode]] | None = None,
        **kwargs: Any,
    ) -> None:
        if "num_microbatch" in kwargs:  # ColossalAI's spelling
            if num_microbatches is not None:
                raise ValueError("pass num_microbatches or num_microbatch, not both")
            num_microbatches = kwargs.pop("num_microbatch")
        given = None if schedule is None else nodes_to_ir(schedule)
        if given is not None and num_microbatches is None and microbatch_size is None:
            num_microbatches = given.num_microbatches
        if num_model_chunks != 2 or not _require_manager(stage_manager).use_zbv:
            raise ValueError(
                f"ZeroBubbleVPipeScheduler needs num_model_chunks=2 (got {num_model_chunks}) and a "
                f"stage manager with use_zbv=True (got {stage_manager!r})"
            )
        super().__init__(stage_manager, num_microbatches, microbatch_size, **kwargs)
        self.costs = costs
        self.max_in_flight = max_in_flight
        self.schedule = given
        if self.schedule is not None and self.schedule.num_stages != stage_manager.num_stages:
            raise ValueError(
                f"schedule= has {self.schedule.num_stages} stages, the stage manager "
                f"{stage_manager.num_stages}: build the PipelineGraph with n_stage="
                f"{stage_manager.num_stages}"
            )

    def generate(self, num_microbatches: int) -> ScheduleIR:
        """ZB-V IR: the ``schedule=`` nodes' order when given, else generated from the costs.

        Raises:
            ValueError: ``schedule=`` was built for another number of microbatches.
        """
        if self.schedule is not None:
            if self.schedule.num_microbatches != num_microbatches:
                raise ValueError(
                    f"schedule= was built for {self.schedule.num_microbatches} microbatches, "
                    f"the step has {num_microbatches}: build the PipelineGraph with "
                    f"n_micro={num_microbatches}"
                )
            return self.schedule
        return zero_bubble_v(
            self.stage_manager.num_stages, num_microbatches, self.costs, self.max_in_flight
        )
