"""The plugin interface every Booster plugin implements."""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from colossal.booster.plugin.dataloader import build_dataloader
from colossal.checkpoint_io.names import group_param_names
from colossal.core import OptimizerWrapper, ParallelDims, ProcessGroupMesh, get_accelerator
from colossal.lazy import LazyInitContext, is_lazy

if TYPE_CHECKING:
    from colossal.checkpoint_io import CheckpointIO

__all__ = ["Boosted", "Criterion", "DPPluginBase", "Plugin", "warn_if_slow_precision"]

logger = logging.getLogger(__name__)

Criterion = Callable[..., torch.Tensor]
"""A loss function: called with the model's outputs (and the batch), returns the loss."""

_ModuleT = TypeVar("_ModuleT", bound=nn.Module)


class Boosted(NamedTuple):
    """The training objects after :meth:`Plugin.configure` (and ``Booster.boost``).

    A tuple: it unpacks as ``model, optimizer, criterion, dataloader, lr_scheduler``.
    ``None`` stays ``None`` (an object that was not given is not created).

    Attributes:
        model: The wrapped model (a :class:`~colossal.core.ModelWrapper` under a plugin).
        optimizer: The optimizer wrapper, or None.
        criterion: The loss function, or None.
        dataloader: The dataloader, or None.
        lr_scheduler: The learning-rate scheduler, or None.
    """

    model: nn.Module
    optimizer: OptimizerWrapper | None
    criterion: Criterion | None
    dataloader: DataLoader | None
    lr_scheduler: LRScheduler | None


class Plugin(abc.ABC):
    """Decides how a model, optimizer and dataloader are wrapped for parallel training.

    A plugin states what it supports (precisions, devices, ``no_sync``, LoRA, pipelines) in
    class attributes (the ``support_*`` / ``control_*`` methods read them; a plugin whose
    answer depends on its settings overrides the method), wraps the training objects in
    :meth:`configure`, and gives the checkpoint IO that reads and writes them in Colossal's
    single checkpoint format.
    """

    SUPPORTED_DEVICES: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    """Device types the plugin runs on."""
    SUPPORTED_PRECISIONS: ClassVar[tuple[str, ...]] = ("fp32",)
    """Precisions the plugin (or the booster, for it) can train in."""
    CONTROLS_PRECISION: ClassVar[bool] = False
    """Whether the plugin handles mixed precision itself (then the booster must not)."""
    CONTROLS_DEVICE: ClassVar[bool] = True
    """Whether the plugin moves the model to its device."""
    CONTROLS_CHECKPOINT_IO: ClassVar[bool] = True
    """Whether the plugin provides its own checkpoint IO."""
    SUPPORTS_NO_SYNC: ClassVar[bool] = False
    """Whether :meth:`no_sync` works (a plugin whose answer depends on its settings
    overrides :meth:`support_no_sync`)."""
    SUPPORTS_LORA: ClassVar[bool] = False
    """Whether :meth:`enable_lora` works (see :meth:`support_lora`)."""
    SUPPORTS_PIPELINE: ClassVar[bool] = False
    """Whether :meth:`execute_pipeline` is available (see :meth:`support_pipeline`)."""

    def supported_devices(self) -> list[str]:
        """Device types the plugin runs on (``"cpu"``, ``"cuda"``)."""
        return list(self.SUPPORTED_DEVICES)

    def supported_precisions(self) -> list[str]:
        """Precisions the plugin (or the booster, for it) can train in."""
        return list(self.SUPPORTED_PRECISIONS)

    def control_precision(self) -> bool:
        """Whether the plugin handles mixed precision itself (then the booster must not)."""
        return self.CONTROLS_PRECISION

    def control_device(self) -> bool:
        """Whether the plugin moves the model to its device."""
        return self.CONTROLS_DEVICE

    def support_no_sync(self) -> bool:
        """Whether :meth:`no_sync` (gradient accumulation without communication) works."""
        return self.SUPPORTS_NO_SYNC

    def support_lora(self) -> bool:
        """Whether :meth:`enable_lora` (peft LoRA adapters) works with this plugin."""
        return self.SUPPORTS_LORA

    def enable_lora(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """Add peft LoRA adapters to ``model`` before boost.

        Takes the arguments of ``Booster.enable_lora`` (``pretrained_dir``, ``lora_config``,
        ``bnb_quantization_config``, ``quantize``) and hands them to
        :func:`colossal.booster.plugin.lora.enable_lora` once :meth:`support_lora` allows it.

        Raises:
            NotImplementedError: The plugin (with these settings) does not support LoRA.
        """
        if not self.support_lora():
            raise NotImplementedError(
                f"{type(self).__name__} does not support LoRA with these settings; use "
                "TorchDDPPlugin, LowLevelZeroPlugin, TorchFSDPPlugin, GeminiPlugin (tp_size=1) "
                "or HybridParallelPlugin (sequence parallelism only with tp_size=1)"
            )
        from colossal.booster.plugin.lora import enable_lora

        return enable_lora(model, *args, **kwargs)

    def lora_reader(self, model: nn.Module) -> CheckpointIO | None:
        """The checkpoint IO that reads a boosted model's adapter tensors whole.

        None (the default): they are read from the model as they are (DTensor shards are
        gathered). A plugin whose parameters live elsewhere (Gemini's chunks) returns its IO.
        """
        return None

    def control_checkpoint_io(self) -> bool:
        """Whether the plugin provides its own checkpoint IO."""
        return self.CONTROLS_CHECKPOINT_IO

    def support_pipeline(self) -> bool:
        """Whether :meth:`execute_pipeline` is available."""
        return self.SUPPORTS_PIPELINE

    @abc.abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Wrap the training objects for this plugin.

        Returns:
            ``(model, optimizer, criterion, dataloader, lr_scheduler)`` as a
            :class:`Boosted`.
        """

    @abc.abstractmethod
    def get_checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO for models and optimizers boosted by this plugin."""

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Context in which backward passes accumulate gradients without communication.

        ``model`` and ``optimizer`` are the boosted ones; a plugin needs only the one it
        accumulates in (the model under DDP, FSDP and Gemini; the optimizer under ZeRO and
        the hybrid plugin).

        Raises:
            NotImplementedError: The plugin cannot skip gradient synchronisation.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not support no_sync(); call backward on every "
            "micro-batch instead"
        )

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Criterion,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one pipelined step (only for plugins with pipeline parallelism).

        Args:
            data_iter: Yields the batches (any structure the model and criterion take).
            model: The boosted model.
            criterion: ``criterion(outputs, batch)`` gives the loss.
            optimizer: The boosted optimizer (None for evaluation under ``no_grad``).
            return_loss: Return the loss.
            return_outputs: Return the model's outputs.

        Returns:
            ``{"loss": ..., "outputs": ...}``.

        Raises:
            NotImplementedError: The plugin has no pipeline parallelism.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no pipeline parallelism, so execute_pipeline is not "
            "available; use a plugin with pp_size > 1 (HybridParallelPlugin) or call the "
            "model directly"
        )


class DPPluginBase(Plugin):
    """A data-parallel plugin: every rank of the group sees a different part of the data.

    The plugin's groups come from one :class:`~colossal.core.ParallelDims`
    (``self.parallel_dims``): everything data parallel over the whole job by default, or over
    the given ``dp_group``; ``self.dp_group`` is its ``group("dp")`` (the default group when
    it spans the job).

    Args:
        dp_group: The data-parallel process group (the whole job when ``None``).
        parallel_dims: The job's parallel layout, for plugins built on more axes than dp
            (then ``dp_group`` must be None).

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: Both ``dp_group`` and ``parallel_dims`` are given.
    """

    def __init__(
        self,
        dp_group: dist.ProcessGroup | None = None,
        *,
        parallel_dims: ParallelDims | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs torch.distributed initialized first: call "
                "colossal.core.launch_from_torch() (under torchrun) or launch(...)"
            )
        if parallel_dims is not None and dp_group is not None:
            raise ValueError(
                f"{type(self).__name__}: pass dp_group or parallel_dims, not both (the dp "
                "group is parallel_dims.group('dp'))"
            )
        if parallel_dims is None:
            parallel_dims = ParallelDims.data_parallel(group=dp_group)
        self.parallel_dims = parallel_dims
        self.dp_group = parallel_dims.group("dp")
        self.rank = parallel_dims.coordinate("dp")
        self.world_size = parallel_dims.dp

    @property
    def pg_mesh(self) -> ProcessGroupMesh:
        """The :class:`~colossal.core.ProcessGroupMesh` of the plugin's layout.

        ColossalAI's attribute; its axes are named (``pg_mesh.axis_names``).

        Raises:
            ValueError: The plugin was given a ``dp_group`` (a group is not a mesh).
        """
        return self.parallel_dims.build_mesh()

    @property
    def dp_size(self) -> int:
        """Data-parallel size (the ranks that see different data)."""
        return self.world_size

    def prepare_dataloader(
        self,
        dataset: Dataset,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: type | None = None,
        **kwargs: Any,
    ) -> DataLoader:
        """A dataloader whose sampler gives this rank its part of ``dataset``.

        Args:
            dataset: A map-style dataset.
            batch_size: Samples per rank per batch.
            shuffle: Shuffle every epoch (call ``dataloader.sampler.set_epoch(epoch)``).
            seed: Seed of the shuffle and of the worker processes.
            drop_last: Drop the last incomplete batch.
            pin_memory: Pin host memory of the batches.
            num_workers: Worker processes.
            distributed_sampler_cls: Sampler class (``DistributedSampler`` by default).
            **kwargs: Further ``DataLoader`` arguments.
        """
        return build_dataloader(
            dataset,
            batch_size,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            sampler_cls=distributed_sampler_cls,
            **kwargs,
        )


def warn_if_slow_precision(plugin: str, precision: str) -> None:
    """Log a warning when ``precision`` is fp16 and the accelerator is the CPU.

    CPUs without native fp16 arithmetic (most: avx512_fp16 / AMX-FP16 are rare) convert
    every fp16 matmul, which runs many times slower than bf16 (the figure measured on this
    project's CI machines is in the CHANGELOG); ColossalAI's plugins default to fp16 because
    they target GPUs.
    """
    if precision == "fp16" and get_accelerator().get_current_device().type == "cpu":
        logger.warning(
            "%s: precision='fp16' on the CPU is emulated by most CPUs and runs many times "
            "slower than bf16; pass precision='bf16' (or 'fp32') for CPU training",
            plugin,
        )


def find_module(model: nn.Module | None, cls: type[_ModuleT]) -> _ModuleT | None:
    """The first module of type ``cls`` along ``model.module`` wrappers (or None)."""
    current: object = model
    for _ in range(16):
        if isinstance(current, cls):
            return current
        current = getattr(current, "module", None)
        if not isinstance(current, nn.Module):
            return None
    return None


def has_lazy_tensors(model: nn.Module) -> bool:
    """Whether ``model`` was built under a ``LazyInitContext`` and is not materialized."""
    return any(is_lazy(t) for t in [*model.parameters(), *model.buffers()])


def materialize_model(model: nn.Module, optimizer: Optimizer | None) -> None:
    """Materialize a lazy model in full and point ``optimizer`` at the real parameters."""
    if not has_lazy_tensors(model):
        return
    names = group_param_names(optimizer, model) if optimizer is not None else []
    LazyInitContext.materialize(model)
    if optimizer is not None:
        repoint_optimizer(optimizer, model, names)


def repoint_optimizer(optimizer: Optimizer, model: nn.Module, names: list[list[str]]) -> None:
    """Replace the optimizer's parameters by the model's current ones of the same names.

    Raises:
        ValueError: The optimizer already has state (it must be boosted before stepping).
    """
    if optimizer.state:
        raise ValueError(
            "boost the optimizer before its first step: its state is not empty, so its "
            "parameters cannot be replaced by the sharded/materialized ones"
        )
    current = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        group["params"] = [current[n] for n in group_names]
