"""``ColossalStrategy``: a ``lightning.Trainer`` strategy that trains on a Colossal plugin.

It is Lightning's ``DDPStrategy`` (launch, process group, collectives, ``reduce``/``barrier``)
with the model and the optimizer boosted by a :class:`~colossal.booster.Booster` instead of
wrapped in ``DistributedDataParallel``:

* ``backward`` runs through the boosted optimizer (ZeRO buckets, Gemini chunks, loss scaling);
* the optimizer step runs the closure, then ``optimizer.step()`` (Colossal's optimizers take no
  closure); ``gradient_clip_val`` clips with the optimizer's global norm over every shard
  (``gradient_clip_algorithm="norm"`` only);
* samplers split the data over the data-parallel ranks (tensor-parallel peers share a batch);
* checkpoints are directories in Colossal's format (model and optimizer by parameter name,
  readable under any plugin and world size) plus ``lightning_state.pt`` holding the rest of
  Lightning's checkpoint (loop and scheduler states, callbacks, hyper-parameters).

Precision is the plugin's (e.g. ``LowLevelZeroPlugin(precision="bf16")``); the strategy
carries a pass-through ``Precision`` so Lightning does not cast or autocast on top.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer

from colossal.booster import Booster
from colossal.booster.plugin import Plugin
from colossal.core import OptimizerWrapper
from colossal.integrations._plugins import check_plugin, data_parallel_layout

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ColossalPrecision", "ColossalStrategy"]

STATE_FILE = "lightning_state.pt"
"""Lightning's part of a checkpoint directory (everything but weights and optimizer)."""


def _unwrap_optimizer(optimizer: object) -> object:
    """The object under Lightning's ``LightningOptimizer`` wrapper."""
    return getattr(optimizer, "_optimizer", optimizer)


class ColossalPrecision(Precision):
    """Lightning's precision hooks for a Colossal plugin, which casts the model itself.

    No module conversion or autocast; clipping by norm goes to the boosted optimizer (its norm
    spans every shard); the optimizer step runs the closure, then ``step()`` without it.
    """

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clip by the global gradient norm through the boosted optimizer.

        Raises:
            TypeError: The optimizer was not boosted (the strategy was bypassed).
        """
        inner = _unwrap_optimizer(optimizer)
        if not isinstance(inner, OptimizerWrapper):
            raise TypeError(
                f"ColossalPrecision clips boosted optimizers, got {type(inner).__name__}"
            )
        inner.clip_grad_by_norm(float(clip_val))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Refused: sharded gradients are clipped by norm.

        Raises:
            ValueError: always; use ``gradient_clip_algorithm="norm"``.
        """
        raise ValueError(
            f"ColossalStrategy clips by norm only, got gradient_clip_algorithm='value' "
            f"(clip_val={clip_val}); use gradient_clip_algorithm='norm'"
        )

    def optimizer_step(
        self,
        optimizer: object,
        model: pl.LightningModule,
        closure: Callable[[], object],
        **kwargs: object,
    ) -> object:
        """Run the closure (forward, backward, clipping hooks), then step unless it skipped."""
        result = self._wrap_closure(model, optimizer, closure)
        if result is None and model.automatic_optimization:
            return None  # training_step returned None: Lightning skips the step
        step = getattr(optimizer, "step", None)
        if not callable(step):
            raise TypeError(f"cannot step {type(optimizer).__name__}")
        inner = _unwrap_optimizer(optimizer)
        if isinstance(inner, OptimizerWrapper):
            inner.step()
        else:
            step()
        return result


class ColossalStrategy(DDPStrategy):
    """Train a ``LightningModule`` with a Colossal plugin under ``lightning.Trainer``.

    Args:
        plugin: ``LowLevelZeroPlugin(...)``, ``GeminiPlugin(...)``,
            ``HybridParallelPlugin(tp_size=...)`` (``pp_size`` 1; the module's ``forward``
            must reach a Hugging Face model the plugin shards), ``TorchDDPPlugin``,
            ``TorchFSDPPlugin``. Build it after ``torch.distributed`` is initialized (e.g.
            ``colossal.core.launch_from_torch()`` under ``torchrun``).
        module_attribute: Boost this attribute of the ``LightningModule`` (e.g. ``"model"``
            holding a Hugging Face model) instead of the whole module; the module then calls
            the boosted model. Needed by plugins that shard by model family (tensor
            parallelism: ``HybridParallelPlugin``, ``GeminiPlugin(tp_size>1)``); the
            optimizer must hold only that attribute's parameters.
        **kwargs: ``DDPStrategy``'s arguments (``cluster_environment``, ``timeout``, ...).

    Raises:
        TypeError: ``plugin`` is not a Colossal plugin.
        ValueError: The plugin runs pipeline stages; ``configure_optimizers`` returns more
            than one optimizer (found at ``fit``).

    Example:
        >>> trainer = lightning.Trainer(accelerator="cpu", devices=2,
        ...     strategy=ColossalStrategy(plugin=LowLevelZeroPlugin(stage=2)))
        >>> trainer.fit(module, datamodule)
    """

    def __init__(
        self, plugin: Plugin, module_attribute: str | None = None, **kwargs: object
    ) -> None:
        kwargs.setdefault("precision_plugin", ColossalPrecision())
        super().__init__(**kwargs)
        self.plugin = check_plugin(plugin, "ColossalStrategy")
        self.booster = Booster(plugin=self.plugin)
        self._boosted: nn.Module | None = None
        self._boosted_optimizer: OptimizerWrapper | None = None
        self._checkpoint_dir: str | None = None
        if module_attribute is not None and (
            not isinstance(module_attribute, str) or not module_attribute.isidentifier()
        ):
            raise ValueError(
                f"module_attribute must name an attribute of the LightningModule (e.g. "
                f"'model'), got {module_attribute!r}"
            )
        self.module_attribute = module_attribute

    def _boost_target(self, module: nn.Module) -> nn.Module:
        if self.module_attribute is None:
            return module
        target = getattr(module, self.module_attribute, None)
        if not isinstance(target, nn.Module):
            raise ValueError(
                f"ColossalStrategy(module_attribute={self.module_attribute!r}): "
                f"{type(module).__name__}.{self.module_attribute} is "
                f"{type(target).__name__}, not an nn.Module"
            )
        return target

    # ---- setup --------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        """Boost the module (and the one optimizer when fitting) instead of wrapping in DDP."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._boosted is None:
            optimizer = None
            if fitting:
                self.setup_optimizers(trainer)
                created: list[Optimizer] = list(getattr(self, "optimizers", []))
                if len(created) != 1:
                    raise ValueError(
                        f"ColossalStrategy trains with one optimizer; configure_optimizers "
                        f"returned {len(created)} (combine the parameter groups into one)"
                    )
                optimizer = created[0]
            boosted = self.booster.boost(self._boost_target(module), optimizer)
            self._boosted = boosted.model
            self._boosted_optimizer = boosted.optimizer
            if self.module_attribute is not None:
                setattr(module, self.module_attribute, boosted.model)
        if fitting:
            if self._boosted_optimizer is None:
                raise ValueError(
                    "ColossalStrategy boosted this module for evaluation first; fit a new "
                    "module (boosting happens once per module)"
                )
            self.optimizers = [self._boosted_optimizer]
        self.model = self._boosted if self.module_attribute is None else module
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        """Nothing: the plugin places the model."""

    def teardown(self) -> None:
        """Release the accelerator; the boosted model stays for a later fit/validate."""
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """The data-parallel ranks only: tensor-parallel peers read the same batches."""
        dp_size, dp_rank = data_parallel_layout(self.plugin)
        return {"num_replicas": dp_size, "rank": dp_rank}

    # ---- step ---------------------------------------------------------------------------------
    def backward(
        self,
        closure_loss: torch.Tensor,
        optimizer: Optimizer | None,
        *args: object,
        **kwargs: object,
    ) -> torch.Tensor:
        """Back-propagate through the boosted optimizer (Lightning's hooks around it)."""
        module = self.lightning_module
        assert module is not None
        optimizer_wrapper = self._boosted_optimizer
        if optimizer_wrapper is None:
            raise RuntimeError("backward before ColossalStrategy.setup boosted an optimizer")
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.booster.backward(closure_loss, optimizer_wrapper)
        return self.precision_plugin.post_backward(closure_loss, module)

    # ---- checkpoints --------------------------------------------------------------------------
    def lightning_module_state_dict(self) -> dict[str, object]:
        """Empty: :meth:`save_checkpoint` writes the weights itself (collectively)."""
        return {}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, torch.Tensor]:
        """Empty: :meth:`save_checkpoint` writes the optimizer itself (collectively)."""
        return {}

    def save_checkpoint(
        self,
        checkpoint: dict[str, object],
        filepath: str | os.PathLike[str],
        storage_options: object | None = None,
    ) -> None:
        """Write ``filepath`` as a directory: model, optimizer, then Lightning's state (rank 0).

        Collective: every rank calls it (Lightning's ``ModelCheckpoint`` does).
        """
        path = os.fspath(filepath)
        if self._boosted is None:
            raise RuntimeError("save_checkpoint before ColossalStrategy.setup boosted the model")
        self.booster.save_model(self._boosted, path, shard=True)
        if self._boosted_optimizer is not None:
            self.booster.save_optimizer(self._boosted_optimizer, path, shard=True)
        # "optimizer_states" stays (empty dicts, see optimizer_state): Lightning reads its
        # presence as "not weights-only" on resume
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        if self.is_global_zero:
            torch.save(rest, os.path.join(path, STATE_FILE))
        self.barrier("ColossalStrategy.save_checkpoint")

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Delete a checkpoint directory (rank 0)."""
        path = os.fspath(filepath)
        if self.is_global_zero and os.path.isdir(path):
            shutil.rmtree(path)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Weights and optimizer load into the boosted objects, so after :meth:`setup`."""
        return True

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, object]:
        """Lightning's state from a directory written by :meth:`save_checkpoint`.

        Raises:
            ValueError: ``checkpoint_path`` is not such a directory.
        """
        path = os.fspath(checkpoint_path)
        state_file = os.path.join(path, STATE_FILE)
        if not os.path.isfile(state_file):
            raise ValueError(
                f"{path} is not a ColossalStrategy checkpoint (no {STATE_FILE}); pass a "
                "directory its ModelCheckpoint wrote"
            )
        self._checkpoint_dir = path
        state: dict[str, object] = torch.load(state_file, map_location="cpu", weights_only=False)
        state["state_dict"] = {}
        return state

    def load_model_state_dict(self, checkpoint: Mapping[str, object], strict: bool = True) -> None:
        """Load the weights of the checkpoint directory into the boosted model."""
        if self._boosted is None or self._checkpoint_dir is None:
            raise RuntimeError("load_model_state_dict needs setup() and load_checkpoint() first")
        self.booster.load_model(self._boosted, self._checkpoint_dir, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, object]) -> None:
        """Load the optimizer of the checkpoint directory into the boosted optimizer."""
        if self._boosted_optimizer is None or self._checkpoint_dir is None:
            return
        self.booster.load_optimizer(self._boosted_optimizer, self._checkpoint_dir)
