"""Checkpoint IO of the hybrid-parallel plugin: any TP x PP x DP layout in the one format.

A rank holds some of the model's tensors (its pipeline stage's), each whole or as a
tensor-parallel part, and so do its data-parallel replicas. Saving sees every tensor of the
model on every rank as a :class:`colossal.core.LocalShard` over the whole job: the first
replica (data-parallel coordinate 0) of each stage holds its part, every other rank an empty
one, so the saver plans the same files everywhere and gathers each tensor only to the rank
writing it. A tied weight held by two stages is saved once, under its first name, as every
other plugin saves it. Loading reads into each held tensor only its part, under whichever of
its names the checkpoint uses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from colossal.booster.plugin.zero_checkpoint_io import ZeroCheckpointIO
from colossal.checkpoint_io import CheckpointError
from colossal.checkpoint_io.sharded import marked_state_dict
from colossal.checkpoint_io.template import unwrap_model
from colossal.core import Block, LocalShard, OptimizerWrapper, shard_spec
from colossal.core.comm import all_gather_object

logger = logging.getLogger(__name__)

__all__ = ["HybridCheckpointIO"]


def _chunks(module: nn.Module) -> list[nn.Module]:
    return list(module) if isinstance(module, nn.ModuleList) else [module]


def _empty(shape: Sequence[int], dtype: torch.dtype) -> LocalShard:
    """A rank's empty part of a tensor of ``shape`` (held elsewhere)."""
    if not shape:
        from colossal.core import FlatRange

        return LocalShard(torch.empty(0, dtype=dtype), FlatRange(0, 0), shape)
    none = (0, *shape[1:])
    return LocalShard(torch.empty(none, dtype=dtype), Block((0,) * len(shape), none), shape)


class HybridCheckpointIO(ZeroCheckpointIO):
    """Saves and loads hybrid-parallel models in the format of every other plugin.

    Args:
        replica: Whether this rank is its stage's first data-parallel replica (it writes).
        layout: ``(tp_size, pp_size)``; optimizer checkpoints need both 1 for now.
    """

    def __init__(self, replica: bool, layout: tuple[int, int]) -> None:
        super().__init__()
        self.replica = replica
        self.layout = layout
        self.canonical: dict[str, str] = {}
        self.names: dict[str, list[str]] = {}

    def set_aliases(self, aliases: Sequence[Sequence[str]]) -> None:
        """Every name of each parameter of the unsharded model; the first is the one saved."""
        self.canonical = {name: names[0] for names in aliases for name in names}
        self.names = {names[0]: list(names) for names in aliases}

    def _held(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's tensors under their saved names (tied copies once)."""
        held: dict[str, torch.Tensor] = {}
        for chunk in _chunks(unwrap_model(model)):
            for name, value in marked_state_dict(chunk).items():
                held.setdefault(self.canonical.get(name, name), value)
        return held

    def config_module(self, model: nn.Module) -> nn.Module:
        """The first chunk: a shallow copy of the model, with its config."""
        return _chunks(unwrap_model(model))[0]

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """Every tensor of the model, as this rank's part of it (collective: learns the names)."""
        held = self._held(model) if self.replica else {}
        mine = [(n, tuple(_shape(t)), str(t.dtype)) for n, t in held.items()]
        state: dict[str, Any] = {}
        for entries in all_gather_object(mine):
            for name, shape, dtype in entries:
                if name in state:
                    continue
                value = held.get(name)
                if value is None:
                    state[name] = _empty(shape, getattr(torch, dtype.split(".")[-1]))
                    continue
                spec = shard_spec(value)
                part = spec.part if spec is not None else Block.whole(shape)
                state[name] = LocalShard(value.detach(), part, shape)
        return state

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True) -> None:
        """Load any plugin's model checkpoint (or a Hugging Face one) into the held tensors.

        Collective. ``strict`` refuses names the checkpoint lacks, and names no rank of the
        job holds.

        Raises:
            CheckpointError: A missing, unexpected or differently shaped tensor.
        """
        self.wait_snapshots()
        targets = self._held(model)
        wanted = {n: self.names.get(n, [n]) for n in targets}
        reader = self._model_reader(checkpoint, [a for names in wanted.values() for a in names])
        saved = set(reader.weight_map)
        chosen: dict[str, Any] = {}
        missing = []
        for name, target in targets.items():
            source = next((a for a in wanted[name] if a in saved), None)
            if source is None:
                missing.append(name)
                continue
            whole = shard_spec(target).shape if shard_spec(target) else target.shape
            if list(whole) != list(reader.shape(source)):
                raise CheckpointError(
                    f"{source!r} has shape {reader.shape(source)} in {reader.directory} but "
                    f"{list(whole)} in the model: the checkpoint belongs to another model"
                )
            chosen[source] = target
        known = {a for names in all_gather_object(sorted(wanted)) for n in names
                 for a in self.names.get(n, [n])}
        unexpected = sorted(saved - known)
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"checkpoint {reader.directory} does not match the model: missing "
                f"{missing[:8]}, unexpected {unexpected[:8]}; load the checkpoint of this "
                "model or pass strict=False"
            )
        self.load_model_state(model, chosen, reader)
        reader.close()

    def _refuse_optimizer(self) -> None:
        if self.layout != (1, 1):
            raise NotImplementedError(
                f"optimizer checkpoints of HybridParallelPlugin with tp_size x pp_size = "
                f"{self.layout[0]} x {self.layout[1]} are not supported yet (only tp_size = "
                "pp_size = 1); save the model with booster.save_model, which works for every "
                "layout"
            )

    def save_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str, *args: Any,
                       **kwargs: Any) -> None:
        """ZeRO's optimizer save (data and sequence parallelism only, for now).

        Raises:
            NotImplementedError: Under tensor or pipeline parallelism.
        """
        self._refuse_optimizer()
        super().save_optimizer(optimizer, checkpoint, *args, **kwargs)

    def load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None:
        """ZeRO's optimizer load (data and sequence parallelism only, for now).

        Raises:
            NotImplementedError: Under tensor or pipeline parallelism.
        """
        self._refuse_optimizer()
        super().load_optimizer(optimizer, checkpoint)


def _shape(tensor: torch.Tensor) -> Sequence[int]:
    spec = shard_spec(tensor)
    return spec.shape if spec is not None else tensor.shape

