"""FSDP2's all-gather and reduce-scatter through float8 (``TorchFSDPPlugin(fp8_communication=)``).

``fully_shard`` lets a module replace the collectives of its parameter group
(``set_custom_all_gather`` / ``set_custom_reduce_scatter``). These replacements run
:func:`colossal.core.comm.fp8_all_gather` and :func:`~colossal.core.comm.fp8_reduce_scatter`:
the payload crosses the wire as float8 plus its scales (a quarter of fp32's bytes, tracked by
the comm tracker). Each rank's sharded parameters (the optimizer's) stay exact; what is
rounded is the gathered copy used for compute and the gradient sum. Buffers FSDP packs as raw
bytes (parameters of mixed dtypes) and reductions other than sum/average go through the plain
collectives. The float8 collectives are synchronous: the returned work is ``None``, which
FSDP treats as already done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from colossal.core.comm import fp8_all_gather, fp8_reduce_scatter

__all__ = ["Fp8AllGather", "Fp8ReduceScatter", "use_fp8_collectives"]

_FP8_OPS = (ReduceOp.SUM, ReduceOp.AVG)


def _empty(size: Sequence[int | torch.SymInt], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


class Fp8AllGather(AllGather):
    """FSDP2's parameter all-gather with float8 payloads."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer (FSDP copies the shards into it)."""
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        """Gather ``input_tensor`` from every rank into ``output_tensor`` (float8 on the wire)."""
        if not input_tensor.is_floating_point():  # FSDP's byte view of mixed-dtype groups
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                               async_op=async_op)
        fp8_all_gather(output_tensor, input_tensor, group=group)
        return None


class Fp8ReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter with float8 payloads."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A plain buffer (FSDP copies the gradients into it)."""
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: object, async_op: bool = False
                 ) -> dist.Work | None:
        """Reduce ``input_tensor`` over ``group``, this rank's slice into ``output_tensor``."""
        if op not in _FP8_OPS or not input_tensor.is_floating_point():
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        fp8_reduce_scatter(output_tensor, input_tensor, op=op, group=group)
        return None


def use_fp8_collectives(model: nn.Module) -> int:
    """Give every ``fully_shard``-ed module of ``model`` the float8 collectives.

    Returns:
        How many modules got them.
    """
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_custom_all_gather(Fp8AllGather())
        module.set_custom_reduce_scatter(Fp8ReduceScatter())
    return len(modules)
