"""``save_checkpoint``/``load_checkpoint`` of ColossalAI's config-era API, in Colossal's format.

``file`` names a **directory** (``'xxx.pt'`` in the seeds becomes a directory of that name).
It holds a Booster-readable checkpoint: the model as a Hugging Face safetensors directory
(``model.safetensors`` + ``model.safetensors.index.json``), the optimizer as
``optimizer*.safetensors`` + ``optimizer.safetensors.index.json`` (states by parameter name),
the lr scheduler as ``lr_scheduler.json``, and ``training_state.json`` with the epoch and the
extra keyword arguments. So ``booster.load_model(model, file)`` (any plugin, any world size)
and ``booster.load_optimizer(optimizer, file)`` read what ``save_checkpoint`` wrote, and
``load_checkpoint`` reads what the Booster saved into a directory (the epoch is then -1).
Other files in the directory are left alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, TypedDict

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from colossal.checkpoint_io import CheckpointIO, group_param_names
from colossal.core import ModelWrapper, OptimizerWrapper
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.engine.gradient_accumulation import (
    GradAccumLrSchedulerByStep,
    GradAccumOptimizer,
)
from colossal.legacy.engine.gradient_handler.moe import expert_parameters
from colossal.legacy.utils.common import is_using_pp

__all__ = [
    "TRAINING_STATE_FILE",
    "SchedulerLike",
    "TrainingState",
    "load_checkpoint",
    "read_training_state",
    "save_checkpoint",
]

#: An lr scheduler, or the one ``initialize`` wraps under gradient accumulation.
SchedulerLike = LRScheduler | GradAccumLrSchedulerByStep

#: The file of a checkpoint directory that holds the epoch and the extra keyword arguments.
TRAINING_STATE_FILE = "training_state.json"


class TrainingState(TypedDict):
    """What :func:`read_training_state` returns.

    Attributes:
        epoch: The epoch saved (-1 when the directory records none).
        extra: The extra keyword arguments of :func:`save_checkpoint`, as JSON gave them back.
    """

    epoch: int
    extra: dict[str, object]


def _plain_module(model: nn.Module) -> nn.Module:
    """``model`` without torch's DDP/DataParallel shells (Colossal's wrappers stay)."""
    while isinstance(model, DistributedDataParallel | DataParallel):
        model = model.module
    return model


def _user_module(model: nn.Module) -> nn.Module:
    model = _plain_module(model)
    if isinstance(model, ModelWrapper):
        model = _plain_module(model.unwrap())
    return model


def _scheduler(lr_scheduler: SchedulerLike) -> LRScheduler:
    """The scheduler that holds the state (inside a gradient-accumulation wrapper)."""
    if isinstance(lr_scheduler, GradAccumLrSchedulerByStep):
        return lr_scheduler.lr_scheduler
    return lr_scheduler


def _named_optimizer(optimizer: Optimizer | OptimizerWrapper, model: nn.Module) -> OptimizerWrapper:
    """An optimizer that carries the model name of each of its parameters.

    A gradient-accumulation wrapper gives the optimizer it wraps (which holds the state).
    """
    while isinstance(optimizer, GradAccumOptimizer):
        optimizer = optimizer.inner
    if isinstance(optimizer, OptimizerWrapper) and optimizer.param_names is not None:
        return optimizer
    try:
        names = group_param_names(optimizer, _user_module(model))  # type: ignore[arg-type]
    except ValueError as err:
        raise TypeError(
            f"{type(optimizer).__name__} holds tensors that are not the model's parameters "
            "and carries no parameter names; name them with optimizer.set_param_names(...) "
            "before it replaces them (colossal.legacy.initialize does)"
        ) from err
    if isinstance(optimizer, OptimizerWrapper):
        optimizer.set_param_names(names)
        return optimizer
    return OptimizerWrapper(optimizer, param_names=names)


def _checkpoint_io(model: nn.Module, optimizer: object) -> CheckpointIO:
    """The checkpoint IO that understands ``model`` and ``optimizer`` (ZeRO, Gemini, plain)."""
    from colossal.gemini import GeminiDDP, GeminiOptimizer
    from colossal.zero import LowLevelZeroOptimizer

    while isinstance(optimizer, GradAccumOptimizer):
        optimizer = optimizer.inner

    if isinstance(model, GeminiDDP) or isinstance(optimizer, GeminiOptimizer):
        from colossal.booster.plugin.gemini import GeminiCheckpointIO

        return GeminiCheckpointIO()
    if isinstance(optimizer, LowLevelZeroOptimizer):
        from colossal.booster.plugin.zero import ZeroCheckpointIO

        io = ZeroCheckpointIO()
        io.optimizers.append(optimizer)
        return io
    return CheckpointIO()


def _refuse_pipeline(what: str) -> None:
    if is_using_pp():
        raise NotImplementedError(
            f"{what}: a pipeline-parallel model is split over the stages; save it with "
            "the Booster and HybridParallelPlugin (booster.save_model) instead"
        )


def _refuse_split_experts(what: str, model: nn.Module) -> None:
    if (
        gpc.is_initialized(ParallelMode.MOE_MODEL)
        and gpc.get_world_size(ParallelMode.MOE_MODEL) > 1
        and expert_parameters(model)
    ):
        raise NotImplementedError(
            f"{what}: the experts are split over the MoE model-parallel ranks (each holds its "
            "own under the same local names); save them per rank with "
            "torch.save(model.state_dict(), f'rank{rank}.pt'), or train with moe=dict(size=1)"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    file: str | os.PathLike[str],
    epoch: int,
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper | None = None,
    lr_scheduler: SchedulerLike | None = None,
    **kwargs: Any,
) -> None:
    """Save a training state into the directory ``file`` (collective: call on every rank).

    Args:
        file: The checkpoint directory (created if needed; see the module docstring).
        epoch: The epoch just completed (returned by :func:`load_checkpoint`).
        model: The model (plain, torch DDP, or a Colossal wrapper: ZeRO, Gemini, AMP).
        optimizer: Its optimizer (or the Engine's), saved too when given.
        lr_scheduler: Its lr scheduler (or the one ``initialize`` returned), saved too
            when given.
        **kwargs: More values to keep, JSON-serializable (returned by
            :func:`read_training_state`).

    Raises:
        TypeError: A value in ``kwargs`` that JSON cannot hold, or an optimizer without
            parameter names whose tensors are not the model's.
        NotImplementedError: Pipeline parallelism (use the Booster's hybrid plugin), or
            experts split over MoE model-parallel ranks.
    """
    _refuse_pipeline("save_checkpoint")
    _refuse_split_experts("save_checkpoint", model)
    state = {"epoch": int(epoch), "extra": dict(kwargs)}
    try:
        text = json.dumps(state, indent=2, sort_keys=True)
    except TypeError as err:
        raise TypeError(
            f"save_checkpoint keeps extra values as JSON; {sorted(kwargs)} holds a value "
            f"JSON cannot hold ({err}); save tensors with the model or optimizer instead"
        ) from err
    directory = os.fspath(file)
    model = _plain_module(model)
    io = _checkpoint_io(model, optimizer)
    io.save_model(model, directory)
    if optimizer is not None:
        io.save_optimizer(_named_optimizer(optimizer, model), directory)
    if lr_scheduler is not None:
        io.save_lr_scheduler(_scheduler(lr_scheduler), directory)
    if _rank() == 0:
        target = os.path.join(directory, TRAINING_STATE_FILE)
        with open(target + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(target + ".tmp", target)
    _barrier()


def read_training_state(file: str | os.PathLike[str]) -> TrainingState:
    """``{"epoch": int, "extra": {...}}`` saved by :func:`save_checkpoint` into ``file``.

    A directory without it (a Booster checkpoint) gives ``{"epoch": -1, "extra": {}}``.
    """
    path = os.path.join(os.fspath(file), TRAINING_STATE_FILE)
    if not os.path.isfile(path):
        return {"epoch": -1, "extra": {}}
    with open(path, encoding="utf-8") as handle:
        state: Mapping[str, Any] = json.load(handle)
    return {"epoch": int(state.get("epoch", -1)), "extra": dict(state.get("extra", {}))}


def load_checkpoint(
    file: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper | None = None,
    lr_scheduler: SchedulerLike | None = None,
    strict: bool = True,
) -> int:
    """Load a checkpoint directory into ``model`` (and ``optimizer``, ``lr_scheduler``).

    Collective: call on every rank. Reads what :func:`save_checkpoint` or the Booster wrote
    (any plugin, any world size), or a Hugging Face model directory (model only).

    Args:
        file: The checkpoint directory.
        model: The model to load into.
        optimizer: Loaded from the directory's optimizer files when given.
        lr_scheduler: Loaded from its ``lr_scheduler.json`` when given.
        strict: The model's and the checkpoint's tensor names must match.

    Returns:
        The epoch saved with it, -1 when the directory records none.

    Raises:
        FileNotFoundError: No checkpoint (or no scheduler state) at ``file``.
        colossal.checkpoint_io.CheckpointError: A checkpoint of another model.
        NotImplementedError: Pipeline parallelism (use the Booster's hybrid plugin).
    """
    _refuse_pipeline("load_checkpoint")
    _refuse_split_experts("load_checkpoint", model)
    directory = os.fspath(file)
    if not os.path.exists(directory):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {directory!r}")
    model = _plain_module(model)
    io = _checkpoint_io(model, optimizer)
    io.load_model(model, directory, strict=strict)
    if optimizer is not None:
        io.load_optimizer(_named_optimizer(optimizer, model), directory)
    if lr_scheduler is not None:
        io.load_lr_scheduler(_scheduler(lr_scheduler), directory)
    return read_training_state(directory)["epoch"]
