"""``ColossalTrainer``: the Hugging Face ``Trainer`` training on a Colossal plugin.

The Trainer keeps its loop, arguments, callbacks, logging, evaluation and checkpoint folders;
this subclass hands the model and optimizer to a :class:`~colossal.booster.Booster` instead of
Accelerate's ``prepare`` and replaces the few steps Accelerate would run:

* backward goes through the boosted optimizer (ZeRO buckets, Gemini chunks, loss scaling);
* ``max_grad_norm`` clips with the optimizer's global (sharded) norm;
* the optimizer's own ``zero_grad`` runs after each step (the Trainer only zeroes the model);
* dataloaders are split over the data-parallel ranks only (tensor-parallel peers share a batch);
* ``save_steps`` writes Colossal's checkpoint format (Hugging Face ``model.safetensors`` shards
  with ``config.json``, the optimizer by parameter name, ``lr_scheduler.json``) into the
  Trainer's ``checkpoint-N`` folder, next to what the Trainer writes itself
  (``trainer_state.json``, RNG states, ``training_args.bin``), and
  ``resume_from_checkpoint`` loads it back after boosting, at any plugin or world size.

Precision is the plugin's: ``TrainingArguments(bf16=True)`` needs e.g.
``LowLevelZeroPlugin(precision="bf16")`` (the plugin keeps fp32 master weights); a mismatch is
refused rather than silently autocasting twice.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch
from accelerate.data_loader import BatchSamplerShard
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from colossal.booster import Booster
from colossal.booster.plugin import Plugin
from colossal.core import OptimizerWrapper
from colossal.integrations._plugins import check_plugin, data_parallel_layout, plugin_precision

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["ColossalTrainer"]

_MODEL_INDEX = "model.safetensors.index.json"
_OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
_SCHEDULER_FILE = "lr_scheduler.json"


class _ZeroOptimizerGrads(TrainerCallback):
    """Calls the boosted optimizer's ``zero_grad`` after each step.

    ``Trainer`` zeroes only ``model.parameters()``; ZeRO and Gemini keep gradients in their
    own buffers, which would otherwise carry into the next step.
    """

    def __init__(self, trainer: ColossalTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: object,
    ) -> None:
        """Drop the optimizer's gradients once it has stepped."""
        optimizer = self.trainer.optimizer
        if isinstance(optimizer, OptimizerWrapper):
            optimizer.zero_grad()


class ColossalTrainer(Trainer):
    """A ``transformers.Trainer`` whose model and optimizer are boosted by a Colossal plugin.

    Everything else is the Trainer's: pass the same arguments plus ``plugin``. Run it under
    ``torchrun`` or ``colossal run`` (the plugin needs ``torch.distributed`` initialized, e.g.
    by ``colossal.core.launch_from_torch()`` before building the plugin).

    Args:
        *args: ``Trainer``'s positional arguments (``model``, ``args``, ...).
        plugin: ``LowLevelZeroPlugin(...)``, ``GeminiPlugin(...)``,
            ``HybridParallelPlugin(tp_size=...)`` (``pp_size`` must be 1), ``TorchDDPPlugin``
            or ``TorchFSDPPlugin``.
        **kwargs: ``Trainer``'s keyword arguments.

    Raises:
        TypeError: ``plugin`` is not a Colossal plugin.
        ValueError: The plugin runs pipeline stages; ``bf16``/``fp16`` in the arguments differ
            from the plugin's precision; gradient accumulation under a ``GeminiPlugin``
            without ``enable_gradient_accumulation=True``.

    Example:
        >>> launch_from_torch()
        >>> trainer = ColossalTrainer(model=model, args=TrainingArguments("out", bf16=True),
        ...     train_dataset=data, plugin=LowLevelZeroPlugin(stage=2, precision="bf16"))
        >>> trainer.train()
    """

    def __init__(self, *args: object, plugin: Plugin, **kwargs: object) -> None:
        self.plugin = check_plugin(plugin, "ColossalTrainer")
        self.booster = Booster(plugin=self.plugin)
        self._boosted: nn.Module | None = None
        self._pending_model_checkpoint: str | None = None
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._check_arguments()
        self.add_callback(_ZeroOptimizerGrads(self))

    # ---- checks ------------------------------------------------------------------------------
    def _check_arguments(self) -> None:
        precision = plugin_precision(self.plugin)
        asked = "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else None
        if asked is not None and asked != precision:
            raise ValueError(
                f"TrainingArguments({asked}=True) but {type(self.plugin).__name__} trains in "
                f"{precision!r}: set precision={asked!r} on the plugin (it casts the model and "
                "keeps fp32 master weights), or drop the flag"
            )
        config = getattr(self.plugin, "config", None)
        if (
            self.args.gradient_accumulation_steps > 1
            and type(self.plugin).__name__ == "GeminiPlugin"
            and not getattr(config, "enable_gradient_accumulation", False)
        ):
            raise ValueError(
                f"gradient_accumulation_steps={self.args.gradient_accumulation_steps} needs "
                "GeminiPlugin(enable_gradient_accumulation=True) (Gemini otherwise keeps one "
                "backward's gradients per step)"
            )

    # ---- boosting ----------------------------------------------------------------------------
    def _boost(self) -> nn.Module:
        """Create the optimizer if needed and boost model and optimizer once (idempotent)."""
        if self._boosted is not None:
            return self._boosted
        if self.optimizer is None:
            self.create_optimizer()
        optimizer = self.optimizer
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"ColossalTrainer boosts a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        model = self.model
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"ColossalTrainer needs a model (nn.Module), got {type(model).__name__}"
            )
        boosted = self.booster.boost(model, optimizer)
        self.optimizer = boosted.optimizer  # type: ignore[assignment]
        self._boosted = boosted.model
        self.model_wrapped = boosted.model
        if self._pending_model_checkpoint is not None:
            self.booster.load_model(boosted.model, self._pending_model_checkpoint)
            self._pending_model_checkpoint = None
        return boosted.model

    def _inner_optimizer(self) -> Optimizer:
        optimizer = self.optimizer
        if isinstance(optimizer, OptimizerWrapper):
            return optimizer.unwrap()
        if isinstance(optimizer, Optimizer):
            return optimizer
        raise TypeError(f"no optimizer to schedule, got {type(optimizer).__name__}")

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: DataLoader, resume_from_checkpoint: str | None
    ) -> tuple[nn.Module, DataLoader]:
        """Boost model and optimizer (instead of ``accelerator.prepare``), then resume."""
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        model = self._boost()
        # The torch scheduler drives the learning rate of the optimizer the wrapper steps.
        self.create_scheduler(num_training_steps=max_steps, optimizer=self._inner_optimizer())
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None
    ) -> nn.Module:
        """The boosted model, for training and for evaluation (Gemini owns the weights)."""
        return self._boost()

    # ---- data ----------------------------------------------------------------------------------
    def _get_dataloader(self, *args: object, **kwargs: object) -> DataLoader:
        """The Trainer's dataloader, split over the data-parallel ranks only."""
        loader: DataLoader = super()._get_dataloader(*args, **kwargs)  # type: ignore[arg-type]
        dp_size, dp_rank = data_parallel_layout(self.plugin)
        if dp_size == self.args.world_size:
            return loader
        shard = getattr(loader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            raise ValueError(
                f"{type(self.plugin).__name__} has {dp_size} data-parallel ranks of "
                f"{self.args.world_size}, so tensor-parallel peers must read the same batches; "
                "that needs a map-style dataset (with __len__), not an iterable one"
            )
        shard.num_processes = dp_size
        shard.process_index = dp_rank
        return loader

    def get_tp_size(self) -> int:
        """Ranks that share one batch (tensor x sequence parallel): counted once in the loss."""
        dp_size, _ = data_parallel_layout(self.plugin)
        return max(1, self.args.world_size // dp_size)

    # ---- step ----------------------------------------------------------------------------------
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | object],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward and loss as the Trainer computes them; backward through the booster."""
        model.train()
        prepared = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, prepared, num_items_in_batch=num_items_in_batch)
        del prepared
        if self.loss_is_scaled_for_ga is not None:
            scaled_for_ga = bool(self.loss_is_scaled_for_ga)
        else:
            scaled_for_ga = (
                self.model_accepts_loss_kwargs and num_items_in_batch is not None
            ) or self.compute_loss_func is not None
        if not scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        optimizer = self.optimizer
        if not isinstance(optimizer, OptimizerWrapper):
            raise RuntimeError("training_step before the model was boosted (call train())")
        self.booster.backward(loss, optimizer)
        return loss.detach()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """Clip to ``max_grad_norm`` by the global norm over every shard; return that norm."""
        optimizer = self.optimizer
        assert isinstance(optimizer, OptimizerWrapper)
        norm = optimizer.clip_grad_by_norm(self.args.max_grad_norm)
        return torch.tensor(float(norm))

    def _get_grad_norm(
        self, model: nn.Module, grad_norm: torch.Tensor | float | None = None
    ) -> torch.Tensor | float | None:
        """The clipped step's norm (without clipping: the optimizer's, if it reports one)."""
        if grad_norm is not None:
            return grad_norm
        optimizer = self.optimizer
        return optimizer.get_grad_norm() if isinstance(optimizer, OptimizerWrapper) else None

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model (collective) in Colossal's format: HF safetensors + ``config.json``.

        Before training has boosted the model this is the Trainer's own ``save_model``.
        """
        if self._boosted is None:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = str(output_dir if output_dir is not None else self.args.output_dir)
        self.booster.save_model(self._boosted, output_dir, shard=True)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Optimizer states by parameter name and ``lr_scheduler.json`` (collective)."""
        optimizer = self.optimizer
        assert isinstance(optimizer, OptimizerWrapper)
        self.booster.save_optimizer(optimizer, output_dir, shard=True)
        if self.lr_scheduler is not None:
            scheduler: LRScheduler = self.lr_scheduler
            self.booster.save_lr_scheduler(scheduler, output_dir)

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """Load the weights into the boosted model (deferred until it is boosted)."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, _MODEL_INDEX)):
            raise ValueError(
                f"{resume_from_checkpoint} holds no Colossal model checkpoint ({_MODEL_INDEX}); "
                "resume from a checkpoint-N folder written by ColossalTrainer, or load other "
                "weights with from_pretrained before building the trainer"
            )
        if self._boosted is None:
            self._pending_model_checkpoint = resume_from_checkpoint
        else:
            self.booster.load_model(self._boosted, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Load the optimizer and scheduler saved by :meth:`_save_optimizer_and_scheduler`."""
        if checkpoint is None:
            return
        optimizer = self.optimizer
        assert isinstance(optimizer, OptimizerWrapper)
        if os.path.isfile(os.path.join(checkpoint, _OPTIMIZER_INDEX)):
            self.booster.load_optimizer(optimizer, checkpoint)
        if self.lr_scheduler is not None and os.path.isfile(
            os.path.join(checkpoint, _SCHEDULER_FILE)
        ):
            self.booster.load_lr_scheduler(self.lr_scheduler, checkpoint)

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the loss scaler (fp16) is part of the plugin's optimizer state."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: see :meth:`_save_scaler`."""

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager[None]:
        """No autocast: the plugin casts the model (see the class docstring)."""
        return contextlib.nullcontext()
