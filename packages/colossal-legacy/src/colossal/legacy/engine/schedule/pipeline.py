"""PipelineSchedule / InterleavedPipelineSchedule on colossal-pipeline's 1F1B schedules.

ColossalAI's legacy pipeline schedules take ``(data, label)`` batches and the engine; here
each batch is flattened into one dict of tensors, split into microbatches by
:mod:`colossal.pipeline` and run by its :class:`~colossal.pipeline.OneForwardOneBackwardSchedule`
(or :class:`~colossal.pipeline.InterleavedSchedule`) over the ``pp`` axis of ``gpc.dims``: the
first model slice gets a microbatch's data, the last computes the criterion on its label.
The backward goes through the engine's optimizer (loss scaling and gradient accumulation
apply); data-parallel and tied-weight gradients are synchronized afterwards by the engine's
gradient handlers, in ``engine.step()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.engine.schedule.base import (
    BaseSchedule,
    Batch,
    StepResult,
    call_criterion,
    call_model,
)
from colossal.pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineStageManager,
)
from colossal.pipeline import PipelineSchedule as _Runner

if TYPE_CHECKING:
    from colossal.legacy.engine.engine import Engine

__all__ = ["InterleavedPipelineSchedule", "PipelineSchedule"]

Spec = tuple[Any, ...]


def _pack(obj: Any, key: str, out: dict[str, Any]) -> Spec:
    """Put every leaf of ``obj`` into ``out`` under a key made from ``key``; return the layout."""
    if isinstance(obj, Mapping):
        return ("map", tuple((k, _pack(v, f"{key}.{k}", out)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (
            "seq",
            isinstance(obj, list),
            tuple(_pack(v, f"{key}.{i}", out) for i, v in enumerate(obj)),
        )
    out[key] = obj
    return ("leaf", key)


def _unpack(spec: Spec, flat: Mapping[str, Any]) -> Any:
    """Rebuild what :func:`_pack` flattened, from one microbatch's dict."""
    kind = spec[0]
    if kind == "map":
        return {k: _unpack(s, flat) for k, s in spec[1]}
    if kind == "seq":
        items = [_unpack(s, flat) for s in spec[2]]
        return items if spec[1] else tuple(items)
    return flat[spec[1]]


class _FirstSlice(nn.Module):
    """The first model slice, called with a microbatch dict: rebuilds the data for it.

    With ``carry`` (dict data), the data travels on with the output so every later slice
    gets the batch's keys too (ColossalAI's ``model(stage_output, **data)``).
    """

    def __init__(self, chunk: nn.Module, spec: Spec, carry: bool = False) -> None:
        super().__init__()
        self.chunk = chunk
        self.spec = spec
        self.carry = carry

    def forward(self, **microbatch: Any) -> Any:
        data = _unpack(self.spec, microbatch)
        out = call_model(self.chunk, data)
        return (out, data) if self.carry else out


class _LaterSlice(nn.Module):
    """A later slice of a pipeline fed dict data: ``chunk(stage_output, **data)``."""

    def __init__(self, chunk: nn.Module, last: bool) -> None:
        super().__init__()
        self.chunk = chunk
        self.last = last

    def forward(self, stage_output: Any, data: Mapping[str, Any]) -> Any:
        out = self.chunk(stage_output, **data)
        return out if self.last else (out, data)


class _Chunk(nn.Module):
    """Model chunk ``index`` of an interleaved stage: sets gpc's virtual pipeline rank."""

    def __init__(self, chunk: nn.Module, index: int) -> None:
        super().__init__()
        self.chunk = chunk
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        gpc.set_virtual_pipeline_parallel_rank(self.index)
        return self.chunk(*args, **kwargs)


class PipelineSchedule(BaseSchedule):
    """1F1B pipeline schedule over ``gpc``'s PIPELINE mode (ColossalAI's arguments).

    The engine's model is this stage's slice (e.g. from
    :func:`colossal.legacy.builder.build_pipeline_model`). Every rank draws the same batch;
    a dict batch reaches every stage (``model(stage_output, **data)`` after the first),
    the label only the last.

    Args:
        num_microbatches: Microbatches per batch (the config's ``NUM_MICRO_BATCHES``); the
            batch size must be a multiple of it.
        data_process_func: Turns a batch into ``(data, label)``.
        tensor_shape: Accepted for compatibility and not needed: shapes and dtypes travel
            between stages with the tensors (sent once, then cached).
        scatter_gather_tensors: Accepted for compatibility (no effect).

    Raises:
        ValueError: ``num_microbatches`` is not a positive int.
    """

    num_model_chunks = 1

    def __init__(
        self,
        num_microbatches: int,
        data_process_func: Callable[[Any], Batch] | None = None,
        tensor_shape: torch.Size | Sequence[int] | None = None,
        scatter_gather_tensors: bool = False,
    ) -> None:
        super().__init__(data_process_func)
        if (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or (num_microbatches < 1)
        ):
            raise ValueError(
                f"num_microbatches={num_microbatches!r} must be a positive int "
                "(the config's NUM_MICRO_BATCHES)"
            )
        self.num_microbatches = num_microbatches
        self.tensor_shape = tensor_shape
        self.scatter_gather_tensors = scatter_gather_tensors
        self._runner: _Runner | None = None

    @property
    def stage_manager(self) -> PipelineStageManager:
        """This rank's stage manager (after :meth:`pre_processing`)."""
        if self._runner is None:
            raise RuntimeError("the schedule is not attached to an engine yet")
        return self._runner.stage_manager

    def _make_runner(self, manager: PipelineStageManager) -> _Runner:
        return OneForwardOneBackwardSchedule(manager, num_microbatches=self.num_microbatches)

    def pre_processing(self, engine: Engine) -> None:
        """Build the stage manager and the colossal-pipeline schedule (collective).

        Raises:
            RuntimeError: ``gpc`` has no PIPELINE mode (the config has no ``pipeline > 1``).
        """
        if not gpc.is_initialized(ParallelMode.PIPELINE):
            raise RuntimeError(
                f"{type(self).__name__} needs parallel=dict(pipeline=N) with N > 1 in the config"
            )
        chunks = self.num_model_chunks
        manager = PipelineStageManager(
            gpc.dims.build_mesh(), "pp", enable_interleave=chunks > 1, num_model_chunks=chunks
        )
        self._runner = self._make_runner(manager)

    def _chunks(self, model: nn.Module, spec: Spec) -> list[nn.Module]:
        chunks = list(model) if isinstance(model, nn.ModuleList) else [model]
        if len(chunks) != self.num_model_chunks:
            raise ValueError(
                f"{type(self).__name__} needs {self.num_model_chunks} model chunk(s) on this "
                f"stage, the engine's model has {len(chunks)}"
            )
        # Slice c * stages + s is chunk c of stage s; with dict data every slice gets its keys.
        carry = spec[0] == "map"
        stages, stage = self.stage_manager.num_stages, self.stage_manager.stage
        last = stages * len(chunks) - 1
        for c, chunk in enumerate(chunks):
            index = c * stages + stage
            if index == 0:
                chunks[c] = _FirstSlice(chunk, spec, carry and index != last)
            elif carry:
                chunks[c] = _LaterSlice(chunk, index == last)
        if self.num_model_chunks > 1:
            chunks = [_Chunk(c, i) for i, c in enumerate(chunks)]
        return chunks

    def forward_backward_step(
        self,
        engine: Engine,
        data_iter: Iterator[object],
        forward_only: bool = False,
        return_loss: bool = True,
        return_output_label: bool = True,
    ) -> StepResult:
        """One batch through the pipeline: every microbatch's forward and backward.

        Returns:
            ``(output, label, loss)`` on the last stage (the outputs concatenated over the
            microbatches, the batch's label, the mean of the microbatch losses); ``(None,
            None, None)`` on the other stages.

        Raises:
            ValueError: ``return_loss=False`` without ``forward_only``, a batch that does
                not split into ``num_microbatches``, or the wrong number of model chunks.
        """
        self._check_flags(forward_only, return_loss)
        if self._runner is None:
            self.pre_processing(engine)
        assert self._runner is not None
        data, label = self.load_batch(data_iter)
        flat: dict[str, Any] = {}
        data_spec = _pack(data, "data", flat)
        label_spec = _pack(label, "label", flat)
        criterion = engine.criterion
        if criterion is None:
            raise ValueError("the engine has no criterion: pass criterion to initialize(...)")

        def loss_of(outputs: Any, microbatch: Mapping[str, Any]) -> torch.Tensor:
            return call_criterion(criterion, outputs, _unpack(label_spec, microbatch))

        with torch.no_grad() if forward_only else contextlib.nullcontext():
            result = self._runner.forward_backward_step(
                self._chunks(engine.model, data_spec),
                iter([flat]),
                loss_of,
                optimizer=None if forward_only else engine.optimizer,
                return_loss=return_loss,
                return_outputs=return_output_label,
            )
        last = self.stage_manager.is_last_stage(ignore_chunk=True)
        loss = result["loss"] if return_loss and last else None
        if return_output_label and last:
            return result["outputs"], label, loss
        return None, None, loss


class InterleavedPipelineSchedule(PipelineSchedule):
    """Interleaved 1F1B: each stage holds ``num_model_chunks`` slices (an ``nn.ModuleList``).

    Chunk ``c`` of stage ``s`` is model slice ``c * stages + s`` (the layout of
    :func:`colossal.legacy.builder.build_pipeline_model` with ``num_chunks``).

    Args:
        num_microbatches: Microbatches per batch, a multiple of the number of stages.
        num_model_chunks: Model chunks per stage (the config's ``model.num_chunks``).
        data_process_func: See :class:`PipelineSchedule`.
        tensor_shape: See :class:`PipelineSchedule`.
        scatter_gather_tensors: See :class:`PipelineSchedule`.
    """

    def __init__(
        self,
        num_microbatches: int,
        num_model_chunks: int,
        data_process_func: Callable[[Any], Batch] | None = None,
        tensor_shape: torch.Size | Sequence[int] | None = None,
        scatter_gather_tensors: bool = False,
    ) -> None:
        super().__init__(num_microbatches, data_process_func, tensor_shape, scatter_gather_tensors)
        if (
            isinstance(num_model_chunks, bool)
            or not isinstance(num_model_chunks, int)
            or (num_model_chunks < 1)
        ):
            raise ValueError(f"num_model_chunks={num_model_chunks!r} must be a positive int")
        self.num_model_chunks = num_model_chunks

    def _make_runner(self, manager: PipelineStageManager) -> _Runner:
        return InterleavedSchedule(
            manager, self.num_model_chunks, num_microbatches=self.num_microbatches
        )

    def pre_processing(self, engine: Engine) -> None:
        """Build the stage manager and the schedule; tell ``gpc`` the chunk count."""
        super().pre_processing(engine)
        gpc.set_virtual_pipeline_parallel_size(self.num_model_chunks)
