"""The Booster: assembles a plugin, mixed precision and checkpoint IO around user objects."""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.mixed_precision import (
    SUPPORTED_MIXED_PRECISION,
    MixedPrecision,
    mixed_precision_factory,
)
from colossal.booster.plugin.base import Boosted, Criterion, Plugin
from colossal.checkpoint_io import CheckpointIO
from colossal.checkpoint_io.names import group_param_names
from colossal.core import ModelWrapper, OptimizerWrapper, get_accelerator

if TYPE_CHECKING:
    from peft import PeftConfig

logger = logging.getLogger(__name__)

__all__ = ["Booster"]


def _parse_mixed_precision(value: str | MixedPrecision | None) -> MixedPrecision | None:
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, str):
        return mixed_precision_factory(value)
    raise TypeError(
        f"mixed_precision must be a str, MixedPrecision or None, got {type(value).__name__}; "
        f"supported: {SUPPORTED_MIXED_PRECISION}"
    )


class Booster:
    """Boosts a model, optimizer, criterion, dataloader and lr scheduler for training.

    Args:
        device: Ignored unless no plugin is given (then the model is moved there); the
            accelerator's device by default.
        mixed_precision: ``"fp16"``, ``"bf16"``, ``"fp16_naive"``, ``"fp32"``/None, or a
            :class:`MixedPrecision` (e.g. ColossalAI's ``FP16TorchMixedPrecision(...)``).
            Only for plugins that do not control precision (e.g. ``TorchDDPPlugin``).
        plugin: The parallelism plugin; None trains the plain model.

    Raises:
        ValueError: ``mixed_precision`` is given to a plugin that controls precision, or is
            not supported by the plugin.

    Example:
        >>> booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="bf16")
        >>> model, optimizer, criterion, loader, sched = booster.boost(
        ...     model, optimizer, criterion, loader, sched)
        >>> booster.backward(loss, optimizer); optimizer.step()
    """

    def __init__(
        self,
        device: str | None = None,
        mixed_precision: str | MixedPrecision | None = None,
        plugin: Plugin | None = None,
    ) -> None:
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(
                f"plugin must be a colossal.booster.plugin.Plugin, got {type(plugin).__name__}"
            )
        self.plugin = plugin
        self.mixed_precision = _parse_mixed_precision(mixed_precision)
        if plugin is not None and self.mixed_precision is not None:
            if plugin.control_precision():
                raise ValueError(
                    f"{type(plugin).__name__} controls precision itself; pass "
                    f"precision={self.mixed_precision.precision!r} to the plugin instead of "
                    "mixed_precision to the Booster"
                )
            if self.mixed_precision.precision not in plugin.supported_precisions():
                raise ValueError(
                    f"{type(plugin).__name__} does not support precision "
                    f"{self.mixed_precision.precision!r}; supported: "
                    f"{plugin.supported_precisions()}"
                )
        self.device = torch.device(device) if device else get_accelerator().get_current_device()
        if plugin is not None:
            self.checkpoint_io = plugin.get_checkpoint_io()
        else:
            self.checkpoint_io = CheckpointIO()
        self._boosted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # The boosted models and optimizers whose async saves are fenced by an optimizer step.
        self._fenced: weakref.WeakSet[nn.Module | OptimizerWrapper] = weakref.WeakSet()

    def boost(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Wrap the training objects for the plugin and the precision.

        Returns:
            ``(model, optimizer, criterion, dataloader, lr_scheduler)`` as a
            :class:`~colossal.booster.plugin.base.Boosted` (a named tuple).

        Raises:
            ValueError: The model or optimizer was boosted already.
            TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"boost needs an nn.Module model, got {type(model).__name__}")
        if isinstance(model, ModelWrapper) or model in self._boosted:
            raise ValueError(
                f"{type(model).__name__} was boosted already; boost the original model once "
                "(create a new model to boost again)"
            )
        if optimizer is not None:
            if isinstance(optimizer, OptimizerWrapper):
                raise ValueError(
                    f"{type(optimizer).__name__} was boosted already; pass the plain "
                    "torch optimizer once"
                )
            if not isinstance(optimizer, Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
                )
        self._boosted.add(model)
        boosted = self._configure(model, optimizer, criterion, dataloader, lr_scheduler)
        self._boosted.add(boosted.model)
        if optimizer is not None and boosted.optimizer is not None:
            # Async saves snapshot in the background; the step that would change what they
            # read waits for them first (the user's optimizer steps inside every wrapper).
            optimizer.register_step_pre_hook(self._snapshot_fence)
            self._fenced.add(boosted.model)
            self._fenced.add(boosted.optimizer)
        return boosted

    def _configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None,
        criterion: Criterion | None,
        dataloader: DataLoader | None,
        lr_scheduler: LRScheduler | None,
    ) -> Boosted:
        """The plugin's (or the plain device move's) wrapping, then the mixed precision's."""
        if self.plugin is not None:
            boosted = self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)
        else:
            moved = model.to(self.device)
            wrapper = None
            if optimizer is not None:
                names = group_param_names(optimizer, moved)
                wrapper = OptimizerWrapper(optimizer, param_names=names)
            boosted = Boosted(moved, wrapper, criterion, dataloader, lr_scheduler)
        if self.mixed_precision is not None and (
            self.plugin is None or not self.plugin.control_precision()
        ):
            wrapped, mp_optimizer, mp_criterion = self.mixed_precision.configure(
                boosted.model, boosted.optimizer, boosted.criterion
            )
            boosted = boosted._replace(
                model=wrapped, optimizer=mp_optimizer, criterion=mp_criterion
            )
        return boosted

    def _snapshot_fence(self, *_: Any) -> None:
        self.checkpoint_io.wait_snapshots()

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Back-propagate ``loss`` through the boosted optimizer (scaling where needed)."""
        optimizer.backward(loss)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Criterion,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one pipelined forward/backward (plugins with pipeline parallelism only).

        Raises:
            NotImplementedError: The plugin has no pipeline parallelism.
        """
        if self.plugin is None or not self.plugin.support_pipeline():
            name = type(self.plugin).__name__ if self.plugin is not None else "no plugin"
            raise NotImplementedError(
                f"execute_pipeline needs a plugin with pipeline parallelism, got {name}; "
                "call the model and booster.backward directly"
            )
        return self.plugin.execute_pipeline(
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    def no_sync(
        self, model: nn.Module | None = None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Context for accumulating gradients without communication.

        Raises:
            NotImplementedError: The plugin does not support it.
        """
        if self.plugin is None:
            return contextlib.nullcontext()
        if not self.plugin.support_no_sync():
            raise NotImplementedError(
                f"{type(self.plugin).__name__} does not support no_sync(); call "
                "booster.backward for every micro-batch instead"
            )
        return self.plugin.no_sync(model, optimizer)

    # ---- LoRA ------------------------------------------------------------------------------
    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | None = None,
        lora_config: PeftConfig | None = None,
        bnb_quantization_config: object = None,
        quantize: bool = False,
    ) -> nn.Module:
        """Add LoRA adapters (``peft``) to ``model``; call before :meth:`boost`.

        The base weights are frozen and only the adapters train. Build the optimizer after
        this call from the returned model's parameters: frozen ones get no gradient, so the
        optimizer skips them (and ZeRO neither shards them nor keeps masters for them).

        Args:
            model: The plain model (not boosted yet).
            pretrained_dir: Load a saved adapter from this directory (trainable) instead of
                creating new ones.
            lora_config: A ``peft.LoraConfig`` for new adapters.
            bnb_quantization_config: Refused (QLoRA needs bitsandbytes and CUDA).
            quantize: Refused when True.

        Returns:
            The ``peft.PeftModel`` to boost.

        Raises:
            ValueError: The model was boosted already, quantization is asked, or neither
                ``lora_config`` nor ``pretrained_dir`` is given.
            NotImplementedError: The plugin does not support LoRA.

        Example:
            >>> model = booster.enable_lora(model, lora_config=peft.LoraConfig(
            ...     r=8, target_modules=["c_attn"]))
            >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            >>> model, optimizer, *_ = booster.boost(model, optimizer)
        """
        if isinstance(model, ModelWrapper) or model in self._boosted:
            raise ValueError(
                f"enable_lora got a boosted {type(model).__name__}; call "
                "booster.enable_lora(model, ...) before booster.boost and boost what it returns"
            )
        if self.plugin is not None:
            return self.plugin.enable_lora(
                model, pretrained_dir, lora_config, bnb_quantization_config, quantize
            )
        from colossal.booster.plugin.lora import enable_lora

        return enable_lora(model, pretrained_dir, lora_config, bnb_quantization_config, quantize)

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str, use_safetensors: bool = False
    ) -> None:
        """Save the LoRA adapter of a boosted model for ``peft`` (collective).

        Writes ``adapter_config.json`` and ``adapter_model.bin`` (or
        ``adapter_model.safetensors``) on the first rank, from full tensors (FSDP shards are
        gathered); ``peft.PeftModel.from_pretrained(base_model, checkpoint)`` loads it.

        Raises:
            ValueError: The model has no LoRA adapter (see :meth:`enable_lora`).
        """
        from colossal.booster.plugin.lora import save_lora_as_pretrained

        reader = self.plugin.lora_reader(model) if self.plugin is not None else None
        save_lora_as_pretrained(
            model,
            checkpoint,
            use_safetensors,
            group=getattr(self.checkpoint_io, "group", None),
            reader=reader,
        )

    # ---- checkpoints -----------------------------------------------------------------------
    def save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = True,
        use_async: bool = False,
    ) -> None:
        """Save the model as a Hugging Face safetensors directory (collective).

        Only the model's own files in ``checkpoint`` are replaced: the optimizer and the lr
        scheduler may be saved into the same directory, and the user's files and folders there
        are never touched. Until the new index replaces the old one, the previous model
        checkpoint there stays loadable, so an interrupted save loses nothing.

        Args:
            model: The boosted model.
            checkpoint: Directory (created if needed; a read-only one raises
                ``PermissionError``), or, with ``shard=False``, a path ending in
                ``.safetensors`` to write the weights as that one file.
            shard: Split into files of ``size_per_shard`` MB.
            gather_dtensor: Kept for API compatibility (tensors are always saved full).
            prefix: Kept for API compatibility.
            size_per_shard: MB per file when ``shard``.
            use_safetensors: Must be True.
            use_async: Return at once and write in the background; wait with
                :meth:`wait_async_saves`. For a model boosted with an optimizer the snapshot is
                taken in the background as well, and the optimizer's next ``step()`` waits for
                it: do not change the weights in other ways before
                :meth:`wait_async_snapshots`. Otherwise the snapshot is taken before returning.
        """
        self.checkpoint_io.save_model(
            model,
            checkpoint,
            shard,
            size_per_shard,
            use_safetensors,
            use_async,
            background_snapshot=model in self._fenced,
        )

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str,
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a model saved under any plugin and world size, or a checkpoint users have.

        ``checkpoint``: a Colossal checkpoint directory, a Hugging Face model directory
        (``model.safetensors``, sharded safetensors with their index, ``pytorch_model.bin``),
        a ``.safetensors`` file or a ``torch.save``'d state dict (with or without a
        ``module.`` prefix). Which one was found is logged; any other file is refused with
        an error that says what it is.

        ``low_cpu_mem_mode=True`` streams the tensors (each read, or only the part this rank
        keeps, when it is copied in); ``False`` reads every needed tensor whole first,
        ``num_threads`` shard files at once: more host memory, faster on many files. Both
        load the same values (see :meth:`CheckpointIO.reading`).
        """
        self.checkpoint_io.load_model(
            model, checkpoint, strict, low_cpu_mem_mode=low_cpu_mem_mode, num_threads=num_threads
        )

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save the optimizer state (by parameter name) into a directory (collective).

        Only the optimizer's own files there are replaced (see :meth:`save_model`). With
        ``use_async`` it returns at once; see :meth:`save_model`.
        """
        self.checkpoint_io.save_optimizer(
            optimizer,
            checkpoint,
            shard,
            size_per_shard,
            use_async,
            background_snapshot=optimizer in self._fenced,
        )

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load an optimizer directory saved under any plugin and world size.

        Another model's optimizer state (other parameter names or shapes) is refused with a
        ``CheckpointError`` before anything is loaded, under every plugin. ``prefix`` and
        ``size_per_shard`` are kept for API compatibility (the index names the files);
        ``low_cpu_mem_mode`` and ``num_threads`` as in :meth:`load_model`.
        """
        self.checkpoint_io.load_optimizer(
            optimizer,
            checkpoint,
            prefix,
            size_per_shard,
            low_cpu_mem_mode=low_cpu_mem_mode,
            num_threads=num_threads,
        )

    def save_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """Save the lr scheduler's state (collective).

        ``checkpoint`` is a JSON file, or a directory (e.g. the model's) to write
        ``lr_scheduler.json`` into.
        """
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """Load the lr scheduler's state (a JSON file, or a directory holding one)."""
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def wait_async_snapshots(self) -> None:
        """Block until async saves have copied what they save (local, cheap).

        The boosted optimizer's ``step()`` does this itself; call it before changing weights
        or optimizer states any other way while an async save may be pending.
        """
        self.checkpoint_io.wait_snapshots()

    def wait_async_saves(self) -> None:
        """Block until every ``use_async`` save is committed on every rank (collective)."""
        self.checkpoint_io.synchronize()
