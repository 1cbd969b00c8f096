"""What the benchmark worker measures: model-state bytes and communication bytes per rank."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from colossal.core import OptimizerWrapper

__all__ = ["TorchCommCounter", "local_nbytes", "model_state_bytes"]


def local_nbytes(t: object) -> int:
    """Bytes this rank holds for ``t`` (the local shard of a DTensor); 0 for non-tensors."""
    if not isinstance(t, torch.Tensor):
        return 0
    to_local = getattr(t, "to_local", None)
    local: torch.Tensor = to_local() if callable(to_local) else t
    return local.numel() * local.element_size()


def _find_memory_report(optimizer: Any) -> Any:
    for candidate in (optimizer, getattr(optimizer, "unwrap", lambda: None)()):
        report = getattr(candidate, "memory_report", None)
        if callable(report):
            return report
    return None


def model_state_bytes(model: nn.Module, optimizer: Optimizer | OptimizerWrapper) -> tuple[int, str]:
    """Bytes of parameters, gradients and optimizer states this rank holds now.

    Uses the optimizer's own ``memory_report()`` (ZeRO) when it has one, since only it knows
    its flat buffers, fp32 masters and sharded gradients; otherwise sums the tensors.

    Returns:
        ``(bytes, source)`` where source is ``"memory_report"`` or ``"tensors"``.
    """
    report = _find_memory_report(optimizer)
    if report is not None:
        return int(report().total), "memory_report"
    params = list(model.parameters())
    total = sum(local_nbytes(p) + local_nbytes(p.grad) for p in params)
    inner = optimizer.unwrap() if hasattr(optimizer, "unwrap") else optimizer
    for state in getattr(inner, "state", {}).values():
        total += sum(local_nbytes(v) for v in state.values())
    return total, "tensors"


_WRAPPED = {
    "all_reduce": lambda a, kw: a[0] if a else kw["tensor"],
    "broadcast": lambda a, kw: a[0] if a else kw["tensor"],
    "reduce": lambda a, kw: a[0] if a else kw["tensor"],
    "all_gather_into_tensor": lambda a, kw: a[0] if a else kw["output_tensor"],
    "_all_gather_base": lambda a, kw: a[0] if a else kw["output_tensor"],
    "reduce_scatter_tensor": lambda a, kw: a[1] if len(a) > 1 else kw["input"],
    "_reduce_scatter_base": lambda a, kw: a[1] if len(a) > 1 else kw["input"],
    "all_gather_single": lambda a, kw: a[0] if a else kw["output_tensor"],
    "reduce_scatter_single": lambda a, kw: a[1] if len(a) > 1 else kw["input"],
    "all_gather": lambda a, kw: a[0] if a else kw["tensor_list"],
    "reduce_scatter": lambda a, kw: a[1] if len(a) > 1 else kw["input_list"],
}


class TorchCommCounter:
    """Counts logical bytes of ``torch.distributed`` collectives called from Python.

    Patches the collective functions of ``torch.distributed`` while active and adds a
    byte-counting comm hook to every ``DistributedDataParallel`` module given to
    :meth:`watch_ddp`: DDP's reducer calls the process group from C++, so the hook routes each
    bucket through the (patched) ``dist.all_reduce``.
    Byte counts follow :class:`colossal.core.CommTracker`: the reduced tensor, the gathered
    output, the unscattered input.
    """

    def __init__(self) -> None:
        self.nbytes = 0
        self.active = False

    def _count(self, value: Any) -> None:
        if not self.active:
            return
        if isinstance(value, (list, tuple)):
            self.nbytes += sum(local_nbytes(v) for v in value)
        else:
            self.nbytes += local_nbytes(value)

    def _wrap(self, fn: Callable[..., Any], pick: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(IndexError, KeyError):
                self._count(pick(args, kwargs))
            return fn(*args, **kwargs)

        return counted

    @contextlib.contextmanager
    def patched(self) -> Iterator[TorchCommCounter]:
        """Patch ``torch.distributed`` for the duration (counting only while ``active``)."""
        saved = {n: getattr(dist, n) for n in _WRAPPED if hasattr(dist, n)}
        try:
            for name, fn in saved.items():
                setattr(dist, name, self._wrap(fn, _WRAPPED[name]))
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    def watch_ddp(self, model: nn.Module) -> bool:
        """Register a counting all-reduce hook on each DDP module inside ``model``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        found = False
        for module in [model, *model.modules()]:
            if isinstance(module, DistributedDataParallel):
                group = module.process_group

                # No annotations: DDP rejects any but dist.GradBucket, and this module's are
                # strings (from __future__ import annotations).
                # The default hook's dist.all_reduce is counted by patched(); counting the
                # bucket here as well would count it twice.
                def hook(state, bucket):
                    return default_hooks.allreduce_hook(state, bucket)

                module.register_comm_hook(group, hook)
                found = True
                break
        return found
