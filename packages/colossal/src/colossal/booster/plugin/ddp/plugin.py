"""TorchDDPPlugin: torch DistributedDataParallel behind the Booster API."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import (
    Boosted,
    Criterion,
    DPPluginBase,
    find_module,
    materialize_model,
)
from colossal.booster.plugin.fp8 import fp8_allreduce_hook
from colossal.checkpoint_io import CheckpointIO
from colossal.checkpoint_io.names import group_param_names
from colossal.core import ModelWrapper, OptimizerWrapper, get_accelerator

logger = logging.getLogger(__name__)

__all__ = ["DDPConfig", "TorchDDPModel", "TorchDDPPlugin"]


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Arguments passed to ``DistributedDataParallel`` (validated)."""

    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_cap_mb, int | float) or self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")


class TorchDDPModel(ModelWrapper):
    """A model wrapped in ``DistributedDataParallel``.

    With ``fp8_communication`` its gradient buckets are averaged through float8
    (:func:`colossal.booster.plugin.fp8.fp8_allreduce_hook`).
    """

    def __init__(
        self,
        module: nn.Module,
        config: DDPConfig,
        process_group: dist.ProcessGroup | None = None,
        fp8_communication: bool = False,
    ) -> None:
        device = next(module.parameters()).device
        ids = [device.index] if device.type == "cuda" else None
        kwargs = dataclasses.asdict(config)
        broadcast = kwargs.pop("broadcast_buffers")  # True is DDP's default: not passed
        with warnings.catch_warnings():
            if not broadcast:
                # Torch 2.13 deprecates the argument, but its replacement
                # (forward_sync_buffers=False) still syncs at init; only this keeps buffers
                # rank-local as the plugin's argument documents.
                warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated",
                                        FutureWarning)
                kwargs["broadcast_buffers"] = False
            ddp = DistributedDataParallel(module, device_ids=ids, process_group=process_group,
                                          **kwargs)
        if fp8_communication:
            ddp.register_comm_hook(process_group, fp8_allreduce_hook)
        super().__init__(ddp)


class TorchDDPPlugin(DPPluginBase):
    """Data parallelism with ``torch.nn.parallel.DistributedDataParallel``.

    Precision is left to the Booster (``Booster(mixed_precision="fp16"|"bf16", ...)``).

    Args:
        broadcast_buffers: Broadcast buffers from rank 0 at wrapping and at every forward
            (``False``: buffers stay rank-local).
        bucket_cap_mb: Gradient bucket size in MB.
        find_unused_parameters: Detect parameters that get no gradient.
        check_reduction: Deprecated DDP flag (kept for API compatibility).
        gradient_as_bucket_view: Let gradients be views into the buckets.
        static_graph: The graph does not change between iterations.
        dp_group: The data-parallel group (the whole job when None).
        fp8_communication: Average the gradient buckets through float8 (a DDP comm hook:
            all-to-all of e4m3 pieces, float32 sums, all-gather of the re-encoded sums;
            synchronous, a quarter of the bytes). Buffers are broadcast in their own dtype.

    Example:
        >>> plugin = TorchDDPPlugin()
        >>> booster = Booster(plugin=plugin, mixed_precision="bf16")
    """

    SUPPORTED_PRECISIONS = ("fp32", "fp16", "bf16")
    SUPPORTS_NO_SYNC = True
    SUPPORTS_LORA = True

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        dp_group: dist.ProcessGroup | None = None,
        fp8_communication: bool = False,
    ) -> None:
        super().__init__(dp_group)
        self.fp8_communication = bool(fp8_communication)
        self.config = DDPConfig(
            broadcast_buffers,
            bucket_cap_mb,
            find_unused_parameters,
            check_reduction,
            gradient_as_bucket_view,
            static_graph,
        )

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Move the model to the device, wrap it in DDP and the optimizer in a wrapper."""
        materialize_model(model, optimizer)
        moved = model.to(get_accelerator().get_current_device())
        wrapper = None
        if optimizer is not None:
            wrapper = OptimizerWrapper(optimizer, param_names=group_param_names(optimizer, moved))
        wrapped = TorchDDPModel(moved, self.config, self.dp_group, self.fp8_communication)
        return Boosted(wrapped, wrapper, criterion, dataloader, lr_scheduler)

    def get_checkpoint_io(self) -> CheckpointIO:
        """The default checkpoint IO (every rank holds full tensors)."""
        return CheckpointIO(self.dp_group)

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """DDP's ``no_sync``: gradients accumulate locally until the next synced backward."""
        ddp = find_module(model, DistributedDataParallel)
        if ddp is None:
            raise TypeError(f"no_sync needs the model returned by boost(), got {type(model)}")
        return ddp.no_sync()
