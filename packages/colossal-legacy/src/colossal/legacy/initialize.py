"""initialize(...): the config's features applied to model, optimizer, criterion, dataloaders.

Reads ``gpc.config`` (after :func:`colossal.legacy.launch`) and returns
``(engine, train_dataloader, test_dataloader, lr_scheduler)``:

- ``zero=dict(stage=1|2, ...)``: :class:`colossal.zero.LowLevelZeroOptimizer` over the DATA
  group (the model is not wrapped; the ``ZeROGradientHandler`` has nothing to do).
- ``fp16=dict(mode=AMP_TYPE.TORCH | AMP_TYPE.NAIVE, ...)``: :func:`~colossal.legacy.amp.
  convert_to_amp`.
- data parallelism (DATA larger than one rank; SEQUENCE_DP under sequence mode): without
  ``gradient_handler`` in the config, torch DDP over the group, or, with pipeline or tensor
  parallelism or naive AMP, the ``DataParallelGradientHandler`` (as ColossalAI does); with
  ``gradient_handler=[dict(type=...)]`` those handlers and no DDP. Tied pipeline parameters
  add the ``PipelineSharedModuleGradientHandler``.
- ``gradient_accumulation=N``: :func:`~colossal.legacy.engine.gradient_accumulation.
  accumulate_gradient`; ``clip_grad_norm=x``: the Engine clips; ``NUM_MICRO_BATCHES`` with
  a pipeline: :class:`PipelineSchedule` (``InterleavedPipelineSchedule`` when the config's
  ``model.num_chunks`` > 1).
- ``parallel=dict(moe=dict(size=E))`` and a model with experts: the ``MoeGradientHandler``
  (experts over ``MOE_DATA``, the rest over ``DATA``) instead of DDP, parameters broadcast
  over the same groups, expert parameters marked so the clipping norm counts each once;
  ZeRO is refused with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from colossal.checkpoint_io import group_param_names
from colossal.core import OptimizerWrapper, get_accelerator
from colossal.core.comm import broadcast
from colossal.legacy.amp import AMP_TYPE, convert_to_amp
from colossal.legacy.amp.naive_amp import convert_to_naive_amp
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.engine import (
    BaseSchedule,
    Engine,
    InterleavedPipelineSchedule,
    NonPipelineSchedule,
    PipelineSchedule,
)
from colossal.legacy.engine.features import EngineFeatures, parse_features
from colossal.legacy.engine.gradient_accumulation import accumulate_gradient
from colossal.legacy.engine.gradient_handler import BaseGradientHandler
from colossal.legacy.engine.gradient_handler.moe import expert_parameters, mark_expert_placements
from colossal.legacy.engine.replicas import mark_replicated_axes
from colossal.legacy.pipeline.shared import mark_stage_parameters, shared_parameters
from colossal.legacy.registry import GRADIENT_HANDLER
from colossal.legacy.utils.checkpointing import SchedulerLike
from colossal.zero import LowLevelZeroOptimizer

__all__ = ["initialize"]

logger = logging.getLogger(__name__)

_TrainBatchT = TypeVar("_TrainBatchT")
_TestLoaderT = TypeVar("_TestLoaderT", bound=Iterable[object])


def _data_mode() -> ParallelMode:
    """The mode whose ranks hold the same model: SEQUENCE_DP under sequence mode, else DATA."""
    if gpc.is_initialized(ParallelMode.SEQUENCE_DP):
        return ParallelMode.SEQUENCE_DP
    return ParallelMode.DATA


def _sync_params(model: nn.Module, mode: ParallelMode) -> None:
    """Broadcast parameters and buffers from the mode's first rank (what DDP does itself)."""
    if gpc.get_world_size(mode) < 2:
        return
    group, src = gpc.get_group(mode), gpc.get_ranks_in_group(mode)[0]
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            broadcast(tensor.data, src, group)


def _moe_job(model: nn.Module, features: EngineFeatures) -> bool:
    """Whether ``model`` has experts in a job with MoE groups (checks what combines with it)."""
    if not gpc.is_initialized(ParallelMode.MOE_MODEL) or not expert_parameters(model):
        return False
    if features.zero is not None:
        raise ValueError(
            "zero=dict(...) with a MoE model under parallel=dict(moe=...) is not supported: "
            "ZeRO would average expert gradients over DATA; drop zero (the MoeGradientHandler "
            "reduces the gradients) or use colossal's MoeHybridParallelPlugin"
        )
    return True


def _sync_moe_params(model: nn.Module) -> None:
    """Broadcast experts over MOE_DATA and everything else over DATA (each from rank 0)."""
    experts = {id(p) for p in expert_parameters(model)}
    for mode, tensors in (
        (ParallelMode.MOE_DATA, [p for p in model.parameters() if id(p) in experts]),
        (
            ParallelMode.DATA,
            [
                *(p for p in model.parameters() if id(p) not in experts),
                *model.buffers(),
            ],
        ),
    ):
        if gpc.get_world_size(mode) < 2:
            continue
        group, src = gpc.get_group(mode), gpc.get_ranks_in_group(mode)[0]
        with torch.no_grad():
            for tensor in tensors:
                broadcast(tensor.data, src, group)


def _unwrap(optimizer: Optimizer | OptimizerWrapper) -> Optimizer:
    if isinstance(optimizer, Optimizer):
        return optimizer
    if type(optimizer) is OptimizerWrapper:
        return optimizer.unwrap()
    raise TypeError(
        f"initialize needs a torch optimizer (or a plain OptimizerWrapper) when the config "
        f"sets fp16 or zero, got {type(optimizer).__name__}"
    )


def _zero_optimizer(
    model: nn.Module, optimizer: Optimizer | OptimizerWrapper, features: EngineFeatures
) -> LowLevelZeroOptimizer:
    assert features.zero is not None
    tp = gpc.tensor_parallel_size > 1 and gpc.tensor_parallel_mode != "sequence"
    inner = _unwrap(optimizer)
    names = group_param_names(inner, model)  # before ZeRO takes over the param groups
    zero = LowLevelZeroOptimizer(
        inner,
        partition_grad=features.zero.stage == 2,
        dp_process_group=gpc.get_group(_data_mode()),
        tp_process_group=gpc.get_group(ParallelMode.TENSOR) if tp else None,
        pp_process_group=(
            gpc.get_group(ParallelMode.PIPELINE)
            if gpc.is_initialized(ParallelMode.PIPELINE)
            else None
        ),
        **features.zero.optimizer_kwargs,
    )
    zero.set_param_names(names)  # what save_checkpoint names the states by
    return zero


def _ddp(model: nn.Module, mode: ParallelMode, options: dict[str, Any]) -> DistributedDataParallel:
    device = get_accelerator().get_current_device()
    kwargs: dict[str, Any] = {"process_group": gpc.get_group(mode)}
    if device.type == "cuda":
        kwargs["device_ids"] = [device]
    kwargs.update(options)
    return DistributedDataParallel(model, **kwargs)


def _schedule(features: EngineFeatures) -> BaseSchedule:
    if not gpc.is_initialized(ParallelMode.PIPELINE):
        return NonPipelineSchedule()
    assert features.num_microbatches is not None  # parse_features requires it
    if features.num_chunks > 1:
        return InterleavedPipelineSchedule(
            features.num_microbatches, features.num_chunks, tensor_shape=features.tensor_shape
        )
    return PipelineSchedule(features.num_microbatches, tensor_shape=features.tensor_shape)


def initialize(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    criterion: Callable[..., torch.Tensor] | None = None,
    train_dataloader: Iterable[_TrainBatchT] | None = None,
    test_dataloader: _TestLoaderT | None = None,
    lr_scheduler: LRScheduler | None = None,
    ophooks: Iterable[object] | None = None,
    verbose: bool = True,
) -> tuple[
    Engine,
    Iterable[_TrainBatchT] | None,
    _TestLoaderT | None,
    SchedulerLike | None,
]:
    """Apply the config's features and return an Engine (ColossalAI's ``initialize``).

    Collective: every rank calls it with its own (same-seeded) model.

    Args:
        model: The model (this stage's slice under a pipeline).
        optimizer: Its optimizer.
        criterion: The loss function.
        train_dataloader: The training dataloader (wrapped under gradient accumulation).
        test_dataloader: The test dataloader (returned as is).
        lr_scheduler: The lr scheduler (wrapped under gradient accumulation to step with
            the optimizer).
        ophooks: Operator hooks, stored on the engine (not called).
        verbose: Log the features applied (rank 0).

    Returns:
        ``(engine, train_dataloader, test_dataloader, lr_scheduler)``.

    Raises:
        RuntimeError: ``gpc`` is empty (call ``launch(config=...)`` first).
        ValueError: A config key with a bad value, named in the message.
        TypeError: ``model`` is not a module, or an optimizer ``fp16``/``zero`` cannot wrap.
    """
    gpc.dims  # noqa: B018 - raises, naming launch, before anything else
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize needs an nn.Module, got {type(model).__name__}")
    features = parse_features(gpc.config, gpc.pipeline_parallel_size)
    if features.cudnn_benchmark is not None:
        torch.backends.cudnn.benchmark = features.cudnn_benchmark
    if features.cudnn_deterministic is not None:
        torch.backends.cudnn.deterministic = features.cudnn_deterministic
    use_pp = gpc.is_initialized(ParallelMode.PIPELINE)
    if use_pp:
        mark_stage_parameters(model)  # each stage's share counts once in the gradient norm
    mode = _data_mode()
    moe = _moe_job(model, features)
    data_parallel = gpc.get_world_size(mode) > 1
    tensor_parallel = gpc.tensor_parallel_size > 1 and gpc.tensor_parallel_mode != "sequence"
    replicated = [("tp", gpc.get_group(ParallelMode.TENSOR))] if tensor_parallel else []
    if moe:  # experts count once in the gradient norm (dp_ep / dp_moe sub-axes of dp)
        mark_expert_placements(model)
    if data_parallel and features.zero is None:  # ZeRO describes its own data-parallel split
        replicated.append(("dp", gpc.get_group(mode)))
    mark_replicated_axes(model, replicated)  # each replica counts once in the gradient norm

    if features.zero is not None:
        _sync_params(model, mode)
        optimizer = _zero_optimizer(model, optimizer, features)
    elif features.amp_mode is AMP_TYPE.NAIVE:
        model, optimizer = convert_to_naive_amp(
            model,
            _unwrap(optimizer),
            dict(features.amp_config),
            output_to_fp32=gpc.is_pipeline_last_stage(ignore_virtual=True),
        )
    elif features.amp_mode is AMP_TYPE.TORCH:
        model, optimizer, criterion = convert_to_amp(
            model, optimizer, criterion, AMP_TYPE.TORCH, features.amp_config
        )

    handler_specs = list(features.gradient_handlers or []) or None
    if features.gradient_handlers is None:
        if features.zero is not None:
            handler_specs = [dict(type="ZeROGradientHandler")]
        elif moe:  # experts over MOE_DATA, the rest over DATA (ColossalAI adds it too)
            handler_specs = [dict(type="MoeGradientHandler")]
            _sync_moe_params(model)
        elif data_parallel:
            if use_pp or tensor_parallel or features.amp_mode is AMP_TYPE.NAIVE:
                kind = "SequenceParallel" if mode is ParallelMode.SEQUENCE_DP else "DataParallel"
                handler_specs = [dict(type=f"{kind}GradientHandler")]
                _sync_params(model, mode)
            else:
                model = _ddp(model, mode, dict(features.torch_ddp))
        if shared_parameters(model):
            shared = dict(type="PipelineSharedModuleGradientHandler")
            handler_specs = [*(handler_specs or []), shared]
    elif features.zero is None and moe:
        _sync_moe_params(model)
    elif features.zero is None:
        _sync_params(model, mode)

    if not isinstance(optimizer, OptimizerWrapper):
        optimizer = OptimizerWrapper(optimizer)
    handlers: list[BaseGradientHandler] | None = None
    if handler_specs is not None:
        handlers = [
            cast(BaseGradientHandler, GRADIENT_HANDLER.build(s, model=model, optimizer=optimizer))
            for s in handler_specs
        ]
    scheduler: SchedulerLike | None = lr_scheduler
    if features.gradient_accumulation > 1:
        optimizer, train_dataloader, handlers, scheduler = accumulate_gradient(
            model,
            optimizer,
            train_dataloader,
            features.gradient_accumulation,
            handlers,
            lr_scheduler,
        )
    engine = Engine(
        model,
        optimizer,
        criterion,
        gradient_handlers=handlers,
        clip_grad_norm=features.clip_grad_norm,
        ophook_list=ophooks,
        verbose=verbose and gpc.get_global_rank() == 0,
        schedule=_schedule(features),
    )
    if verbose and gpc.get_global_rank() == 0:
        logger.info("initialize: %s", features)
    return engine, train_dataloader, test_dataloader, scheduler
