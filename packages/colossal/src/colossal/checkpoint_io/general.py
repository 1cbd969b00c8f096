"""GeneralCheckpointIO: ColossalAI's plain checkpoint IO (one file, or a sharded directory).

ColossalAI's ``GeneralCheckpointIO`` saves a model or an optimizer either as one file (a
``torch.save`` file, or safetensors with ``use_safetensors=True``) or, with ``shard=True``, as
a directory of shards with an index. Ours writes the one-file forms the same way and a
sharded save in Colossal's directory format (safetensors shards and their index, the same
as :class:`~colossal.checkpoint_io.CheckpointIO`); :meth:`load_model` and
:meth:`load_optimizer` read every form back, whichever it is, from the path alone.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.optim import Optimizer

from colossal.checkpoint_io.saver import run_on_rank0
from colossal.checkpoint_io.template import CheckpointIO, _dedupe_tied
from colossal.core import OptimizerWrapper

__all__ = ["GeneralCheckpointIO"]


class GeneralCheckpointIO(CheckpointIO):
    """Plain checkpoint IO with ColossalAI's ``save_*``/``load_*`` arguments.

    Made for one process (a plain model and optimizer); in a job it is collective over
    ``group`` like :class:`CheckpointIO` (rank 0 writes the one-file forms). Arguments as
    :class:`CheckpointIO`'s.
    """

    def save_model(  # type: ignore[override]  # ColossalAI's argument order
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save ``model``: one file at ``checkpoint``, or a sharded directory (``shard``).

        Args:
            model: The (plain or boosted) model.
            checkpoint: A file path (``shard=False``, the file is replaced if it exists) or
                a directory (``shard=True``).
            shard: Write Colossal's sharded safetensors directory, files of at most
                ``size_per_shard`` MB (``use_safetensors`` is then always True).
            gather_dtensor: Kept for ColossalAI compatibility (tensors are saved whole).
            prefix: Kept for ColossalAI compatibility.
            size_per_shard: MB per shard file.
            use_safetensors: With ``shard=False``: a safetensors file instead of a
                ``torch.save`` file.
            use_async: Write in the background (safetensors only); wait with
                :meth:`synchronize` (ColossalAI: ``_sync_io``).

        Raises:
            ValueError: ``use_async`` with a ``torch.save`` file, or ``checkpoint`` is an
                existing directory with ``shard=False``.
        """
        if shard:
            super().save_model(model, checkpoint, True, size_per_shard, True, use_async)
            return
        if os.path.isdir(checkpoint):
            raise ValueError(
                f"checkpoint={checkpoint!r} is a directory: pass a file path, or shard=True to "
                "save a sharded directory"
            )
        state = self.model_state(model)
        if use_safetensors:
            self.saver.save_file(
                _dedupe_tied(state), checkpoint, use_async=use_async, gather=self.to_full
            )
            return
        if use_async:
            raise ValueError(
                "use_async=True writes safetensors only: pass use_safetensors=True (or "
                "use_async=False for a torch.save file)"
            )
        full = {name: self.to_full(value, 0) for name, value in state.items()}
        run_on_rank0(lambda: _torch_save(full, checkpoint), self.group)

    def save_optimizer(  # type: ignore[override]  # ColossalAI's argument order
        self,
        optimizer: OptimizerWrapper | Optimizer,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save the optimizer: one ``torch.save`` file, or a sharded directory (``shard``).

        With ``shard=False`` the file holds ``optimizer.state_dict()`` as torch returns it
        (``use_async`` is then refused); with ``shard=True``, Colossal's directory format
        (states by parameter name, files of at most ``size_per_shard`` MB).

        Raises:
            ValueError: ``use_async`` with ``shard=False``, or ``checkpoint`` is an existing
                directory with ``shard=False``.
        """
        if shard:
            named = _named(optimizer)
            super().save_optimizer(named, checkpoint, True, size_per_shard, use_async)
            return
        if os.path.isdir(checkpoint):
            raise ValueError(
                f"checkpoint={checkpoint!r} is a directory: pass a file path, or shard=True to "
                "save a sharded directory"
            )
        if use_async:
            raise ValueError(
                "an unsharded optimizer checkpoint is one torch.save file, written at once: "
                "pass use_async=False, or shard=True for an async save"
            )
        state = optimizer.state_dict()
        run_on_rank0(lambda: _torch_save(state, checkpoint), self.group)

    def _load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None:
        """A ``torch.save`` file is loaded as it is; a directory as :class:`CheckpointIO`'s."""
        if not os.path.isfile(checkpoint):
            super()._load_optimizer(_named(optimizer), checkpoint)
            return
        self.wait_snapshots()
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or "param_groups" not in state:
            raise ValueError(
                f"{checkpoint!r} is not an optimizer state dict (no 'param_groups'): pass the "
                "file save_optimizer wrote"
            )
        optimizer.load_state_dict(state)


def _named(optimizer: OptimizerWrapper | Optimizer) -> OptimizerWrapper:
    """``optimizer``, or a plain one wrapped with names by position (``"<group>.<index>"``).

    A boosted optimizer carries its parameters' model names; a plain torch optimizer has
    none, so its sharded checkpoint names each parameter by its place in the param groups
    (and loads into an optimizer with the same groups).
    """
    if isinstance(optimizer, OptimizerWrapper) and optimizer.param_names is not None:
        return optimizer
    if isinstance(optimizer, OptimizerWrapper):
        optimizer = optimizer.optim
    names = [
        [f"{g}.{i}" for i in range(len(group["params"]))]
        for g, group in enumerate(optimizer.param_groups)
    ]
    return OptimizerWrapper(optimizer, names)


def _torch_save(state: object, path: str) -> None:
    """``torch.save(state, path)`` through a temporary file, so a crash keeps the old file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.tmp-{os.getpid()}"
    torch.save(_detached(state), temporary)
    os.replace(temporary, path)


def _detached(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_detached(v) for v in value]
    return value
