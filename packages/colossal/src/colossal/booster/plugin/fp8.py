"""The plugins' float8 options: DDP's fp8 gradient hook, and ``use_fp8``'s float8 linears.

``fp8_communication=True`` compresses a plugin's gradient (and, for ZeRO, parameter)
collectives through :mod:`colossal.core.comm.fp8`; ``use_fp8=True`` (ColossalAI's float8
matmuls) runs the model's linear layers through :func:`colossal.kernels.fp8.linear_fp8`
(``torch._scaled_mm``; :func:`use_fp8_linears`) where a probe product runs on the device, and is
refused elsewhere by :func:`require_fp8_matmul`, naming what is missing.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at runtime.
import types
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp

from colossal.core.accelerator import get_accelerator
from colossal.core.comm import fp8_all_reduce
from colossal.kernels.fp8 import fp8_matmul_missing as kernel_fp8_missing
from colossal.kernels.fp8 import linear_fp8

__all__ = ["fp8_allreduce_hook", "fp8_matmul_missing", "require_fp8_matmul", "use_fp8_linears"]


def fp8_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A ``DistributedDataParallel`` comm hook averaging each gradient bucket through float8.

    Register with ``ddp.register_comm_hook(process_group, fp8_allreduce_hook)``. The bucket is
    averaged by :func:`colossal.core.comm.fp8_all_reduce` (e4m3, one scale per piece; each
    element within 6.25% of every rank's gradient plus the re-encoded sum) before the hook
    returns: the reduction is synchronous, the returned future already complete.
    """
    buffer = bucket.buffer()
    fp8_all_reduce(buffer, op=ReduceOp.AVG, group=process_group)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def fp8_matmul_missing() -> str | None:
    """What this process's device lacks for float8 matmuls (``torch._scaled_mm``), or None.

    A tiny probe product on the accelerator's current device
    (:func:`colossal.kernels.fp8.fp8_matmul_missing`): torch without ``_scaled_mm``, or a
    device where the call fails (a CUDA GPU below compute capability 8.9), is named.
    """
    return kernel_fp8_missing(get_accelerator().get_current_device())


def require_fp8_matmul(owner: str) -> None:
    """Refuse ``use_fp8=True`` where float8 matmuls do not run, naming what is missing.

    Raises:
        NotImplementedError: :func:`fp8_matmul_missing` names something missing.
    """
    missing = fp8_matmul_missing()
    if missing is not None:
        raise NotImplementedError(
            f"{owner}(use_fp8=True) runs linear layers as float8 matmuls (torch._scaled_mm), "
            f"which this process cannot run: {missing}. On CUDA they need compute capability "
            "8.9+ (Ada, Hopper). Pass use_fp8=False (fp8_communication=True compresses "
            "communication instead)"
        )


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear_fp8(x, self.weight, self.bias)


def _conv1d_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = cast(torch.Tensor, self.weight)  # transformers' Conv1D: (in, out)
    return linear_fp8(x, weight.t(), cast("torch.Tensor | None", self.bias))


def _parallel_matmul(self: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weight = cast(torch.Tensor, self.weight)
    out_dim = cast(int, getattr(self, "_out_dim", 0))  # 1: Conv1D layout (in, out)
    return linear_fp8(x, weight if out_dim == 0 else weight.t(), bias)


def use_fp8_linears(model: nn.Module) -> int:
    """Run the matmuls of ``model``'s linear layers through :func:`linear_fp8`, in place.

    ``nn.Linear`` (peft's base layers too), transformers' GPT-2 ``Conv1D`` and Shardformer's
    ``Linear1D_Col`` / ``Linear1D_Row`` (and their fused Conv1D variants: only the local
    matmul changes, the tensor-parallel communication stays) get an instance-level forward
    (``_matmul`` for the Shardformer layers); parameters and state dicts are untouched.
    The LM head (``model.get_output_embeddings()``, an ``nn.Linear`` or Shardformer's
    ``VocabParallelLMHead1D``), MoE experts' grouped matmuls and attention products stay in
    the training precision (the usual float8 recipe keeps the output layer out).

    Returns:
        The number of layers switched (a layer already switched is not counted twice).
    """
    from transformers.pytorch_utils import Conv1D

    from colossal.shardformer.layer import Linear1D_Col, Linear1D_Row

    head = None
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(get_head):
        head = get_head()
    count = 0
    for module in model.modules():
        if module is head or getattr(module, "_colossal_fp8", False):
            continue
        if isinstance(module, (Linear1D_Col, Linear1D_Row)):
            module._matmul = types.MethodType(_parallel_matmul, module)  # type: ignore[method-assign]
        elif isinstance(module, nn.Linear):
            module.forward = types.MethodType(_linear_forward, module)  # type: ignore[method-assign]
        elif isinstance(module, Conv1D):
            module.forward = types.MethodType(_conv1d_forward, module)  # type: ignore[method-assign]
        else:
            continue
        object.__setattr__(module, "_colossal_fp8", True)
        count += 1
    return count
