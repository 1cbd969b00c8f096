"""AMP_TYPE.NAIVE: the model in fp16, fp32 master weights, a dynamic loss scaler.

What ColossalAI calls naive AMP (apex's O2): the model's parameters, buffers and forward are
fp16; the optimizer steps fp32 copies of the parameters (the masters) and copies them back.
The loss scaler is :class:`colossal.core.DynamicGradScaler` (with hysteresis) and its
overflow verdict is agreed across every rank, so tensor- and pipeline-parallel stages skip
the same steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

from colossal.core import (
    DynamicGradScaler,
    ModelWrapper,
    OptimizerWrapper,
    ScalerConfig,
    clip_grad_norm_,
    grad_norm,
    mark_sharded,
    shard_spec,
)
from colossal.core.comm import broadcast
from colossal.core.precision import agree_overflow, local_overflow
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.context.parallel_mode import ParallelMode

__all__ = ["NaiveAMPModel", "NaiveAMPOptimizer", "convert_to_naive_amp"]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


def _cast(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor (through tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        cast = [_cast(v, dtype) for v in obj]
        return type(obj)(cast) if isinstance(obj, list) else tuple(cast)
    return obj


class NaiveAMPModel(ModelWrapper):
    """The model in fp16: floating inputs are cast to fp16, outputs back to fp32.

    Args:
        model: The model (cast to fp16 in place).
        output_to_fp32: Cast floating outputs to fp32 (False on pipeline stages whose output
            goes to the next stage).
        parallel_mode: The data-parallel mode whose ranks share buffers.
        sync_buffer: Broadcast the buffers (e.g. BatchNorm statistics) from the mode's first
            rank before every forward, as DDP does (only when the model has buffers and the
            mode spans more than one rank).
    """

    def __init__(
        self,
        model: nn.Module,
        output_to_fp32: bool = True,
        parallel_mode: ParallelMode = ParallelMode.DATA,
        sync_buffer: bool = True,
    ) -> None:
        super().__init__(model.half())
        self.output_to_fp32 = output_to_fp32
        self.parallel_mode = parallel_mode
        self.sync_buffer = sync_buffer

    def _sync_buffers(self) -> None:
        mode = self.parallel_mode
        if not self.sync_buffer or not gpc.is_initialized(mode) or gpc.get_world_size(mode) < 2:
            return
        buffers = list(self.module.buffers())
        if not buffers:
            return
        group, src = gpc.get_group(mode), gpc.get_ranks_in_group(mode)[0]
        for buf in buffers:
            broadcast(buf, src, group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the fp16 model on fp16 inputs."""
        self._sync_buffers()
        out = self.module(*_cast(args, torch.float16), **_cast(kwargs, torch.float16))
        return _cast(out, torch.float32) if self.output_to_fp32 else out


class NaiveAMPOptimizer(OptimizerWrapper):
    """Steps fp32 masters of the fp16 parameters, with dynamic loss scaling.

    The optimizer's param groups are switched to fp32 copies of the fp16 parameters (fp32
    parameters stay as they are). ``backward`` scales the loss; ``step`` checks every rank's
    gradients for inf/NaN (one agreed verdict), skips the step on overflow, otherwise copies
    the unscaled gradients to the masters, clips them (``clip_grad_norm`` or
    :meth:`clip_grad_by_norm`), steps, and copies the masters back into the model.

    Args:
        optim: The optimizer over the fp16 model's parameters (with empty state).
        clip_grad_norm: Clip the masters' gradients to this global norm at every step (0: off).
        verbose: Log overflows and scale changes at INFO level.
        log_num_zeros_in_grad: Count the zero gradient elements of each step
            (:attr:`num_zeros_in_grad`).
        initial_scale: Initial loss scale.
        min_scale: Smallest loss scale.
        growth_factor: Multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: Multiplier after ``hysteresis`` overflow steps.
        growth_interval: Steps without overflow between growths.
        hysteresis: Overflow steps tolerated before backing off.
        max_scale: Largest loss scale.
        group: The ranks that agree on overflow (every rank when None).

    Raises:
        ValueError: The optimizer already has state, or invalid scaler settings.
    """

    def __init__(
        self,
        optim: Optimizer,
        clip_grad_norm: float = 0.0,
        verbose: bool = False,
        log_num_zeros_in_grad: bool = False,
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(optim)
        if optim.state:
            raise ValueError(
                "NaiveAMPOptimizer needs an optimizer without state (it replaces the fp16 "
                "parameters by fp32 masters); create it before the first step"
            )
        if not clip_grad_norm >= 0:
            raise ValueError(f"clip_grad_norm={clip_grad_norm!r} must be >= 0 (0 disables it)")
        self.scaler = DynamicGradScaler(
            ScalerConfig(
                initial_scale=initial_scale,
                min_scale=min_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                max_scale=max_scale,
            )
        )
        self.clip_grad_norm = float(clip_grad_norm)
        self.verbose = verbose
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.num_zeros_in_grad: int | None = None
        self.group = group
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (fp16 param, fp32 master)
        for param_group in optim.param_groups:
            param_group["params"] = [self._master_of(p) for p in param_group["params"]]
        self._pending_clip: tuple[float, float] | None = None
        self._grad_norm: float | None = None

    def _master_of(self, param: torch.Tensor) -> torch.Tensor:
        if param.dtype not in _HALF:
            return param
        master = param.detach().clone().float().requires_grad_(param.requires_grad)
        spec = shard_spec(param)
        if spec is not None:  # the masters count in the global norm as their parameters do
            mark_sharded(master, spec.placements, spec.shape)
        self._pairs.append((param, master))
        return master

    @property
    def loss_scale(self) -> float:
        """The current loss scale."""
        return self.scaler.scale

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, in the order of the fp16 parameters they copy."""
        return [master for _, master in self._pairs]

    def _model_grads(self) -> list[torch.Tensor | None]:
        fp32 = {id(m) for _, m in self._pairs}
        grads: list[torch.Tensor | None] = [p.grad for p, _ in self._pairs]
        grads += [p.grad for p in self._params() if id(p) not in fp32]
        return grads

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate the loss multiplied by the loss scale."""
        self.scaler.scale_loss(loss.float()).backward(*args, **kwargs)

    def backward_by_grad(
        self, tensor: torch.Tensor, grad: torch.Tensor, *args: Any, **kwargs: Any
    ) -> None:
        """Back-propagate ``grad`` from ``tensor``.

        ``grad`` must already carry the loss scale (a pipeline stage receives it from the
        next stage, whose :meth:`backward` scaled the loss); it is not scaled again.
        """
        torch.autograd.backward(tensor, grad, *args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the fp16 gradients and the masters' gradients."""
        for param, master in self._pairs:
            param.grad = None
            master.grad = None
        self.optim.zero_grad(set_to_none=set_to_none)

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the unscaled gradients to ``max_norm`` in the coming :meth:`step`.

        Returns:
            The global norm of the (unscaled) gradients now (inf/NaN on overflow).
        """
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self._pending_clip = (float(max_norm), float(norm_type))
        scaled = float(grad_norm([p for p, _ in self._pairs] + self._fp32_params(), norm_type))
        return scaled / self.scaler.scale

    def _fp32_params(self) -> list[torch.Tensor]:
        masters = {id(m) for _, m in self._pairs}
        return [p for p in self._params() if id(p) not in masters]

    def get_grad_norm(self, norm_type: float = 2.0) -> float | None:
        """The global norm of the last step's unscaled gradients (after clipping: before)."""
        return self._grad_norm

    def step(self, *args: Any, **kwargs: Any) -> float | None:
        """Check overflow on every rank, unscale into the masters, clip, step, copy back.

        Returns:
            What the optimizer's ``step`` returns; None for a skipped (overflow) step.
        """
        grads = self._model_grads()
        overflow = local_overflow(grads)
        if dist.is_initialized():
            overflow = agree_overflow(overflow, self.group)
        scale = self.scaler.scale
        self.scaler.update(overflow)
        if overflow:
            (logger.info if self.verbose else logger.debug)(
                "gradient overflow: step skipped, loss scale now %g", self.scaler.scale
            )
            self._pending_clip = None
            self._grad_norm = None
            self.zero_grad()
            return None
        inv = 1.0 / scale
        with torch.no_grad():
            for param, master in self._pairs:
                master.grad = None if param.grad is None else param.grad.float().mul_(inv)
            for param in self._fp32_params():
                if param.grad is not None:
                    param.grad.mul_(inv)
        if self.log_num_zeros_in_grad:
            self.num_zeros_in_grad = sum(
                int((p.grad == 0).sum()) for p in self._params() if p.grad is not None
            )
        max_norm, norm_type = self._pending_clip or (self.clip_grad_norm, 2.0)
        params = list(self._params())
        if max_norm > 0:
            self._grad_norm = float(clip_grad_norm_(params, max_norm, norm_type))
        self._pending_clip = None
        result = self.optim.step(*args, **kwargs)
        self.sync_params_from_masters()
        return result

    def sync_params_from_masters(self) -> None:
        """Copy the fp32 masters into the fp16 parameters."""
        with torch.no_grad():
            for param, master in self._pairs:
                param.copy_(master)

    def sync_masters_from_params(self) -> None:
        """Copy the fp16 parameters into the masters (after loading a model state dict)."""
        with torch.no_grad():
            for param, master in self._pairs:
                master.copy_(param)

    def state_dict(self) -> StateDict:
        """The optimizer's state, the fp32 masters and the loss scaler's state."""
        state = self.optim.state_dict()
        state["fp32_master_params"] = [m.detach().clone() for m in self.master_params]
        state["loss_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: StateDict) -> None:
        """Restore what :meth:`state_dict` returned (masters and model parameters included).

        Raises:
            ValueError: The saved masters do not match this optimizer's parameters.
        """
        state = dict(state_dict)
        masters: Sequence[torch.Tensor] | None = state.pop("fp32_master_params", None)
        scaler_state = state.pop("loss_scaler", None)
        self.optim.load_state_dict(state)
        if scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)
        if masters is None:
            self.sync_masters_from_params()
            return
        if len(masters) != len(self._pairs):
            raise ValueError(
                f"the state dict holds {len(masters)} fp32 masters but this optimizer has "
                f"{len(self._pairs)} fp16 parameters"
            )
        with torch.no_grad():
            for (_, master), saved in zip(self._pairs, masters, strict=True):
                master.copy_(saved)
        self.sync_params_from_masters()


def convert_to_naive_amp(
    model: nn.Module,
    optimizer: Optimizer,
    amp_config: Mapping[str, object] | None = None,
    output_to_fp32: bool = True,
) -> tuple[nn.Module, NaiveAMPOptimizer]:
    """Wrap model and optimizer for :attr:`AMP_TYPE.NAIVE`.

    An ``nn.ModuleList`` (the model chunks of an interleaved pipeline stage) becomes a list
    of :class:`NaiveAMPModel`, of which only the last casts its outputs to fp32 (when
    ``output_to_fp32``). The optimizer carries the model's parameter names, so checkpoints
    store the masters' states by name.

    Args:
        model: The model (cast to fp16 in place).
        optimizer: Its torch optimizer (created over the model's parameters).
        amp_config: :class:`NaiveAMPOptimizer`'s keyword arguments (``initial_scale``...).
        output_to_fp32: Cast the model's outputs to fp32 (False on pipeline stages that are
            not the last).
    """
    by_id = {id(p): name for name, p in model.named_parameters()}
    names = [[by_id.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    wrapped: nn.Module
    if isinstance(model, nn.ModuleList):
        last = len(model) - 1
        wrapped = nn.ModuleList(
            [NaiveAMPModel(m, output_to_fp32 and i == last) for i, m in enumerate(model)]
        )
    else:
        wrapped = NaiveAMPModel(model, output_to_fp32)
    # The settings' types are the optimizer's to check: they come from a config file.
    settings: dict[str, Any] = dict(amp_config or {})
    amp_optimizer = NaiveAMPOptimizer(optimizer, **settings)
    if all(n is not None for group in names for n in group):  # checkpoints name the masters
        amp_optimizer.set_param_names([[str(n) for n in group] for group in names])
    return wrapped, amp_optimizer
