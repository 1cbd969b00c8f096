"""Checkpoint IO of the hybrid-parallel plugin: any TP x PP x DP layout in the one format.

A rank holds some of the model's tensors (its pipeline stage's), each whole or as a
tensor-parallel part, and so do its data-parallel replicas. Saving sees every tensor of the
model on every rank as a :class:`colossal.core.LocalShard` over the whole job: the first
replica (data-parallel coordinate 0) of each stage holds its part, every other rank an empty
one, so the saver plans the same files everywhere and gathers each tensor only to the rank
writing it. A tied weight held by two stages is saved once, under its first name, as every
other plugin saves it. Loading reads into each held tensor only its part, under whichever of
its names the checkpoint uses. Optimizer states go the same way
(:mod:`.optimizer_state`): ZeRO's states, placed along pp, tp and dp, gathered axis
by axis to their writer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.booster.plugin.hybrid.optimizer_state import (
    empty_part,
    merge_meta,
    read_held_state,
    select_groups,
    stage_state,
)
from colossal.booster.plugin.zero.checkpoint_io import ZeroCheckpointIO
from colossal.checkpoint_io import OPTIMIZER_INDEX, CheckpointError, read_index
from colossal.checkpoint_io.commit import resolve_directory
from colossal.checkpoint_io.names import param_names
from colossal.checkpoint_io.optimizer_fit import check_optimizer_fits
from colossal.checkpoint_io.optimizer_state import indexed_to_named, named_to_indexed
from colossal.checkpoint_io.sharded import marked_state_dict
from colossal.checkpoint_io.template import unwrap_model
from colossal.core import Block, LocalShard, Nested, OptimizerWrapper, shard_spec
from colossal.core.comm import all_gather_object
from colossal.zero import LowLevelZeroOptimizer, StateRef, sharded_params

logger = logging.getLogger(__name__)

__all__ = ["HybridCheckpointIO"]


def _chunks(module: nn.Module) -> list[nn.Module]:
    return list(module) if isinstance(module, nn.ModuleList) else [module]


class HybridCheckpointIO(ZeroCheckpointIO):
    """Saves and loads hybrid-parallel models in the format of every other plugin.

    Args:
        replica: Whether this rank is its stage's first data-parallel replica (it writes).
        layout: ``(tp_size, pp_size)``; with both 1, optimizer checkpoints are ZeRO's.
        pp_group: The pipeline group (None without pipeline parallelism).
    """

    def __init__(self, replica: bool, layout: tuple[int, int],
                 pp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.replica = replica
        self.layout = layout
        self.pp_group = pp_group
        self.stage = dist.get_rank(pp_group) if pp_group is not None else 0
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
                    state[name] = empty_part(shape, getattr(torch, dtype.split(".")[-1]))
                    continue
                spec = shard_spec(value)
                part = spec.part if spec is not None else Block.whole(shape)
                if isinstance(part, Nested):
                    raise TypeError(
                        f"{name!r} is placed as {spec}, whose levels do not compose to a "
                        "block or a flat range; HybridCheckpointIO saves each held tensor as "
                        "one part of the whole"
                    )
                state[name] = LocalShard(value.detach(), part, shape)
        return state

    def _load_model(self, model: nn.Module, checkpoint: str, strict: bool) -> None:
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
            whole = _shape(target)
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

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """Save the optimizer in the one format (collective; see :mod:`.optimizer_state`).

        Raises:
            NotImplementedError: ``use_async`` under tensor or pipeline parallelism.
        """
        if self.layout == (1, 1):
            super().save_optimizer(optimizer, checkpoint, shard, size_per_shard, use_async,
                                   background_snapshot)
            return
        if use_async:
            raise NotImplementedError(
                "asynchronous optimizer saves of HybridParallelPlugin under tensor or pipeline "
                "parallelism are not supported; pass use_async=False"
            )
        names = [self.canonical.get(n, n) for n in param_names(optimizer)]
        local, meta = indexed_to_named(self.optimizer_state(optimizer), names)
        refs = self.zero_refs(optimizer)
        params = {names[i]: ref.slot.param for i, ref in refs.items()}
        stage = self.stage
        mine = []
        for key, value in local.items():
            mine.append((key, tuple(value.shape), str(value.dtype).removeprefix("torch.")))
        tensors: dict[str, Any] = {}
        for owner, entries in enumerate(self._by_stage(all_gather_object((stage, mine)))):
            for key, shape, dtype in entries:
                if key not in tensors:  # a tied weight's state: its first stage's copy
                    tensors[key] = stage_state(local.get(key), owner, self.pp_group, shape,
                                               getattr(torch, dtype), owner == stage)
        shapes = {n: tuple(_shape(p)) for n, p in params.items()}
        self.saver.save(
            tensors, checkpoint, "optimizer", OPTIMIZER_INDEX,
            size_per_shard if shard else float("inf"), extra=merge_meta(meta, shapes),
            gather=self.to_full,
        )

    def zero_refs(self, optimizer: OptimizerWrapper) -> Mapping[int, StateRef]:
        """Each trainable parameter (by optimizer index) as the ZeRO part this rank keeps.

        Raises:
            TypeError: ``optimizer`` is not the ZeRO optimizer ``boost`` returned.
        """
        return sharded_params(_zero_optimizer(optimizer))

    @staticmethod
    def _by_stage(gathered: Sequence[tuple[int, Any]]) -> list[Any]:
        """Every rank's ``(stage, entries)`` as one entries list per stage, in stage order."""
        stages: dict[int, Any] = {}
        for stage, entries in gathered:
            stages.setdefault(stage, entries)
        return [stages.get(s, []) for s in range(max(stages, default=-1) + 1)]

    def _load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None:
        """Load any plugin's optimizer checkpoint into this rank's states (collective).

        Raises:
            CheckpointError: The checkpoint lacks a parameter this rank holds, or holds it
                with another shape (another model's).
        """
        if self.layout == (1, 1):
            super()._load_optimizer(optimizer, checkpoint)
            return
        self.wait_snapshots()
        directory = resolve_directory(checkpoint)
        index = read_index(directory, OPTIMIZER_INDEX, self.verify_checksums, self.group)
        reader = self._optimizer_reader(directory, index)
        names = [self.canonical.get(n, n) for n in param_names(optimizer)]
        refs = self.zero_refs(optimizer)
        check_optimizer_fits(index, reader.shape,
                             {names[i]: tuple(_shape(r.slot.param)) for i, r in refs.items()})
        position = {n: i for i, n in enumerate(names)}

        def read(param: str, key: str) -> Any:
            ref = refs.get(position[param])
            return reader.read(key) if ref is None else read_held_state(reader, ref, key)

        state = named_to_indexed(select_groups(index, names), index["weight_map"], names, read,
                                 keep=self.keep_states)
        optimizer.load_state_dict(state)
        reader.close()


def _zero_optimizer(optimizer: OptimizerWrapper) -> LowLevelZeroOptimizer:
    """``optimizer`` as the ZeRO optimizer the hybrid plugin boosts.

    Raises:
        TypeError: It is another optimizer (not one returned by ``boost``).
    """
    if not isinstance(optimizer, LowLevelZeroOptimizer):
        raise TypeError(
            "HybridCheckpointIO saves and loads the optimizer booster.boost returned under "
            f"HybridParallelPlugin (a LowLevelZeroOptimizer), got {type(optimizer).__name__}"
        )
    return optimizer


def _shape(tensor: torch.Tensor) -> Sequence[int]:
    spec = shard_spec(tensor)
    return spec.shape if spec is not None else tensor.shape

