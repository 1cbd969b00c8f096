"""GeminiCheckpointIO: the checkpoint IO of :class:`GeminiPlugin`, in the one format.

Gemini keeps each parameter as a flat range of a chunk sharded over the data-parallel group.
Its parameters and optimizer states reach the writer as :class:`colossal.core.ShardedTensor`
(``colossal.gemini.ChunkTensor`` / ``ChunkStateTensor``), ordered chunk by chunk. A sync
save gathers nothing: each rank writes the bytes of its flat ranges in place into the files
(:mod:`colossal.checkpoint_io.inplace`). An async save gathers each chunk (and each
optimizer state of it) once, spreads the files over the ranks and holds about one chunk of
extra memory per rank. Loading reads only each rank's flat range
of every tensor and writes it into the fp32 masters, the low-precision shards and the
kept-gathered payloads. The files are the same as every other plugin's: a Gemini checkpoint
loads under DDP, FSDP2 or ZeRO at any world size, and theirs load here.

Next to tensor parallelism (``GeminiPlugin(tp_size > 1)``) a chunk holds a flat range of
this rank's tensor-parallel part of each parameter. A ``ChunkTensor``'s placements say so
(the parameter's tensor-parallel block, then its flat range along ``"dp"``), so the IO works
over the whole job with nothing of its own: a gather assembles the chunk over the
data-parallel group at the writer's coordinate (one chunk at a time), then the
tensor-parallel parts at the writer: full tensors under the model's names, as every plugin
writes them. Loading reads the composed part (this rank's tensor-parallel block, then its
flat range). Optimizer states laid out like their parameter are saved and loaded the same
way.

Next to extra data parallelism (``GeminiPlugin(extra_dp_size > 1)``) the ranks of the
``replica_group`` hold the same shards: only the ranks of replica coordinate 0 write (each
tensor once; with tensor parallelism as well, the IO then works over each replica's
``dp_shard`` x ``tp`` ranks), the others wait for them; every replica loads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from colossal.checkpoint_io import (
    MODEL_INDEX,
    OPTIMIZER_INDEX,
    CheckpointError,
    CheckpointIO,
    TensorReader,
)
from colossal.checkpoint_io.hf_config import hf_config_files
from colossal.checkpoint_io.names import param_names
from colossal.checkpoint_io.optimizer_fit import param_shapes_entry
from colossal.checkpoint_io.optimizer_state import indexed_to_named, named_to_indexed
from colossal.checkpoint_io.template import unwrap_model
from colossal.core import (
    LocalShard,
    OptimizerWrapper,
    ParallelDims,
    Placement,
    Replicate,
    ShardedTensor,
    shard_spec,
)
from colossal.core.comm import barrier, group_ranks
from colossal.gemini import (
    ChunkGatherer,
    ChunkTensor,
    GeminiDDP,
    GeminiOptimizer,
    load_piece,
    model_shards,
    optimizer_shards,
    refresh_chunks,
)

logger = logging.getLogger(__name__)

__all__ = ["GeminiCheckpointIO"]

_MAX_DEPTH = 8
_SKIP = object()  # a state of a parameter this rank holds none of


def _gemini_model(model: Any) -> GeminiDDP | None:
    """The ``GeminiDDP`` that ``model`` is or wraps (through ``.module``), else None."""
    for _ in range(_MAX_DEPTH):
        if isinstance(model, GeminiDDP):
            return model
        model = getattr(model, "module", None)
        if not isinstance(model, nn.Module):
            return None
    return None


def _gemini_optimizer(optimizer: Any) -> GeminiOptimizer | None:
    """The ``GeminiOptimizer`` that ``optimizer`` is or wraps (through ``.optim``), else None."""
    for _ in range(_MAX_DEPTH):
        if isinstance(optimizer, GeminiOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optim", None)
        if optimizer is None:
            return None
    return None


def _stream_order(item: tuple[str, Any]) -> tuple[int, str, int]:
    order = getattr(item[1], "order", None)
    return order if order is not None else (-1, "", 0)


class GeminiCheckpointIO(CheckpointIO):
    """Checkpoint IO of Gemini models and optimizers (any other model: as CheckpointIO).

    Args:
        group: The ranks that write and read together (the whole job when None).
        verify_checksums: Check every file's CRC-32 before loading.
        parallel_dims: The job's layout when Gemini runs next to tensor parallelism
            (``tp > 1``; then ``group`` must be None: the IO works over the whole job, or
            with extra data parallelism over each replica's ``dp_shard`` x ``tp`` ranks,
            replicated over ``dp_replicate``).
        replica_group: Ranks holding replicas of ``group``'s shards (extra data
            parallelism); its rank 0 writes together with ``group``, the others only wait.
            Saves are then collective over ``group`` and ``replica_group``.

    Raises:
        ValueError: ``parallel_dims`` with tensor parallelism and a ``group`` or a
            ``replica_group``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        verify_checksums: bool = True,
        parallel_dims: ParallelDims | None = None,
        replica_group: dist.ProcessGroup | None = None,
    ) -> None:
        tp = parallel_dims is not None and parallel_dims.tp > 1
        if tp and (group is not None or replica_group is not None):
            raise ValueError("GeminiCheckpointIO: with tensor parallelism the IO works over "
                             "the whole job; pass parallel_dims without group/replica_group")
        if tp and parallel_dims.dp_replicate > 1:  # type: ignore[union-attr]
            group = parallel_dims.group(("dp_shard", "tp"))  # type: ignore[union-attr]
            replica_group = parallel_dims.group("dp_replicate")  # type: ignore[union-attr]
        super().__init__(group, verify_checksums)
        self.parallel_dims = parallel_dims if tp else None
        self.replica_group = replica_group

    def _once(self, save: Callable[[], None]) -> None:
        """Run ``save`` on replica 0 only; the other replicas wait until it returned."""
        if self.replica_group is None or not dist.is_initialized():
            save()
            return
        if dist.get_rank(self.replica_group) == 0:
            save()
        barrier(self.replica_group)

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_safetensors: bool = True,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """Save the model (see :meth:`_save_model`); with replicas, replica 0 writes it."""
        self._once(lambda: self._save_model(model, checkpoint, shard, size_per_shard,
                                            use_safetensors, use_async, background_snapshot))

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """Save the optimizer (see :meth:`_save_optimizer`); with replicas, replica 0 writes."""
        self._once(lambda: self._save_optimizer(optimizer, checkpoint, shard, size_per_shard,
                                                use_async, background_snapshot))

    def save_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """As :meth:`CheckpointIO.save_lr_scheduler`; with replicas, replica 0 writes it."""
        self._once(lambda: super(GeminiCheckpointIO, self).save_lr_scheduler(lr_scheduler,
                                                                             checkpoint))

    def synchronize(self) -> None:
        """Wait until every async save has been committed on every rank (collective)."""
        super().synchronize()
        if self.replica_group is not None and dist.is_initialized():
            barrier(self.replica_group)

    def _in_place(self, manager: Any) -> bool:
        """Whether a sync save may write in place: the chunks are sharded over our group.

        Every rank then writes the flat ranges its chunk shards hold, and nothing is gathered
        (:mod:`colossal.checkpoint_io.inplace`). Other groups (a chunk group smaller than the
        writing group holds its ranges on several ranks) stream through gathers.
        """
        if not dist.is_initialized():
            return True
        return list(group_ranks(manager.group)) == list(group_ranks(self.group))

    # ---- model -----------------------------------------------------------------------------
    def _gemini_state(self, gemini: GeminiDDP, gatherer: ChunkGatherer) -> dict[str, Any]:
        """Managed parameters chunk by chunk (each once), then the persistent buffers."""
        state: dict[str, Any] = dict(model_shards(gemini, gatherer))
        params = {id(p) for p in gemini.module.parameters()}
        for name, value in gemini.module.state_dict(keep_vars=True).items():
            if name not in state and id(value) not in params and isinstance(value, torch.Tensor):
                state[name] = self._buffer(value)  # buffers (and extra state tensors)
        return state

    def _buffer(self, value: torch.Tensor) -> Any:
        """A buffer as saved: itself, or (split over tp) its part, alike over ``dp_shard``."""
        spec = shard_spec(value)
        if spec is None or self.parallel_dims is None:
            return value.detach()
        alike = Placement("dp", Replicate(), self.parallel_dims.group("dp_shard"))
        return LocalShard(value.detach(), (*spec.placements, alike), spec.shape)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """A Gemini model's parameters as ``ChunkTensor`` (tied ones once) and its buffers."""
        gemini = _gemini_model(model)
        if gemini is None:
            return super().model_state(model)
        return self._gemini_state(gemini, ChunkGatherer())

    def _save_model(
        self,
        model: nn.Module,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_safetensors: bool = True,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """As :meth:`CheckpointIO.save_model`; a Gemini model is written without gathers.

        A sync save into a directory writes in place: every rank writes the flat ranges of
        the parameters its chunk shards hold (fp32 masters, or the chunk-dtype shards) and
        its share of the buffers straight into the files, nothing is gathered
        (:mod:`colossal.checkpoint_io.inplace`); so does a sync save into one
        ``.safetensors`` file. An async save streams chunk by chunk through gathers (about
        one chunk of extra memory per rank whatever ``size_per_shard`` is).

        Raises:
            ValueError: ``use_safetensors=False``.
        """
        gemini = _gemini_model(model)
        if gemini is None:
            super().save_model(model, checkpoint, shard, size_per_shard, use_safetensors,
                               use_async, background_snapshot)
            return
        if not use_safetensors:
            raise ValueError(
                "Colossal checkpoints are always safetensors; pass use_safetensors=True"
            )
        gatherer = ChunkGatherer()
        state = self._gemini_state(gemini, gatherer)
        background = {n for n, v in state.items() if isinstance(v, ChunkTensor)} \
            if background_snapshot else set()
        try:
            if not shard and checkpoint.endswith(".safetensors") and \
                    not os.path.isdir(checkpoint):
                self.saver.save_file(state, checkpoint, use_async=use_async, gather=self.to_full,
                                     background=background, stream=True,
                                     in_place=self._in_place(gemini.chunk_manager))
                return
            self.saver.save(
                state,
                checkpoint,
                "model",
                MODEL_INDEX,
                size_per_shard if shard else float("inf"),
                use_async=use_async,
                gather=self.to_full,
                background=background,
                extra_files=hf_config_files(unwrap_model(model)) if self._rank() == 0 else None,
                stream=True,
                in_place=self._in_place(gemini.chunk_manager),
            )
        finally:
            gatherer.release()

    def _load_model(self, model: nn.Module, checkpoint: str, strict: bool) -> None:
        """As :meth:`CheckpointIO.load_model`; a Gemini model reads only its flat ranges.

        Every rank reads, of each parameter, the elements its shards hold and writes them
        into the masters and shards (kept-gathered payloads are re-gathered). Collective.

        Raises:
            CheckpointError: Missing/unexpected tensors (``strict``) or other shapes.
        """
        gemini = _gemini_model(model)
        if gemini is None:
            super()._load_model(model, checkpoint, strict)
            return
        self.wait_snapshots()
        module = gemini.module
        aliases: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        params = {id(p) for p in module.parameters()}
        buffers = {n: b for n, b in module.state_dict(keep_vars=True).items()
                   if isinstance(b, torch.Tensor) and id(b) not in params}
        managed = [(chunk, p, aliases.get(id(p), [chunk.infos[p].name]))
                   for chunk in gemini.chunk_manager.chunks for p in chunk.params]
        wanted = [n for _, _, names in managed for n in names] + list(buffers)
        reader = self._model_reader(checkpoint, wanted)
        try:
            self._load_gemini(gemini, reader, managed, buffers, strict)
        finally:
            reader.close()

    def _load_gemini(
        self,
        gemini: GeminiDDP,
        reader: TensorReader,
        managed: list[tuple[Any, nn.Parameter, list[str]]],
        buffers: dict[str, torch.Tensor],
        strict: bool,
    ) -> None:
        saved = set(reader.weight_map)
        missing: list[str] = []
        chosen: list[tuple[Any, nn.Parameter, str]] = []
        for chunk, p, names in managed:
            source = next((n for n in names if n in saved), None)
            if source is None:
                missing.append(names[0])
                continue
            _check_shape(reader, source, tuple(ChunkTensor(chunk, p).shape), reader.directory)
            chosen.append((chunk, p, source))
        plain: dict[str, torch.Tensor] = {}
        for name, buf in buffers.items():
            if name not in saved:
                missing.append(name)
                continue
            _check_shape(reader, name, tuple(buf.shape), reader.directory)
            plain[name] = buf
        known = {n for _, _, names in managed for n in names} | set(buffers)
        unexpected = sorted(saved - known)
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"checkpoint {reader.directory} does not match the model: missing "
                f"{missing[:8]}, unexpected {unexpected[:8]}; load the checkpoint of this "
                "model or pass strict=False"
            )
        with torch.no_grad():
            for chunk, p, source in chosen:
                start, stop, _ = chunk.tensor_shard(p, source="master")
                if stop > start:
                    load_piece(chunk, p, _read_piece(reader, source, gemini.chunk_manager,
                                                     chunk, p))
            refresh_chunks(gemini.chunk_manager)  # collective: every rank, same chunks
            for name, buf in plain.items():
                buf.copy_(reader.read(name).reshape(buf.shape))

    # ---- optimizer -------------------------------------------------------------------------
    def optimizer_state(self, optimizer: OptimizerWrapper) -> dict[str, Any]:
        """A Gemini optimizer's states by parameter index, elementwise ones as ShardedTensor.

        Collective over the chunks' group (one object all-gather of which states exist).
        """
        gemini = _gemini_optimizer(optimizer)
        if gemini is None:
            return super().optimizer_state(optimizer)
        return self._gemini_optimizer_state(gemini, ChunkGatherer())

    def _gemini_optimizer_state(
        self, gemini: GeminiOptimizer, gatherer: ChunkGatherer
    ) -> dict[str, Any]:
        names = param_names(gemini)
        position = {n: i for i, n in enumerate(names)}
        shards = optimizer_shards(gemini, gatherer)
        state = {position[name]: dict(entries) for name, entries in shards.items()}
        groups, start = [], 0
        for group, group_names in zip(gemini.optim.param_groups, gemini.param_names or (),
                                      strict=True):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + len(group_names)))})
            start += len(group_names)
        scaler = gemini.scaler.state_dict() if gemini.scaler is not None else None
        return {"state": state, "param_groups": groups, "loss_scaler": scaler}

    def optimizer_layout(self, optimizer: OptimizerWrapper) -> dict[int, ShardedTensor]:
        """Gemini: the flat range of each parameter this rank's chunk shards hold."""
        gemini = _gemini_optimizer(optimizer)
        if gemini is None:
            return super().optimizer_layout(optimizer)
        manager = gemini.chunk_manager
        out: dict[int, ShardedTensor] = {}
        for i, name in enumerate(param_names(gemini)):
            p = manager.param(name)
            out[i] = ChunkTensor(manager.chunk_of(p), p, manager=manager)
        return out

    def _save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """As :meth:`CheckpointIO.save_optimizer`; Gemini's states are written in place.

        A sync save: every rank writes its pieces of each elementwise state (and its share of
        the step counts) into the files, nothing is gathered. An async save streams chunk by
        chunk and, within a chunk, state by state, so each ``(chunk, state)`` is gathered once.
        """
        gemini = _gemini_optimizer(optimizer)
        if gemini is None:
            super().save_optimizer(optimizer, checkpoint, shard, size_per_shard, use_async,
                                   background_snapshot)
            return
        gatherer = ChunkGatherer()
        tensors, meta = indexed_to_named(self._gemini_optimizer_state(gemini, gatherer),
                                         param_names(gemini))
        tensors = dict(sorted(tensors.items(), key=_stream_order))
        meta["param_shapes"] = param_shapes_entry(self._param_shapes(gemini))
        try:
            self.saver.save(
                tensors,
                checkpoint,
                "optimizer",
                OPTIMIZER_INDEX,
                size_per_shard if shard else float("inf"),
                extra=meta,
                use_async=use_async,
                gather=self.to_full,
                background=set(tensors) if background_snapshot else (),
                stream=True,
                in_place=self._in_place(gemini.chunk_manager),
            )
        finally:
            gatherer.release()

    def load_optimizer_state(
        self, optimizer: OptimizerWrapper, meta: dict[str, Any], reader: TensorReader
    ) -> None:
        """Load the named checkpoint state: each rank reads only its pieces' flat ranges.

        Raises:
            CheckpointError: Another model's checkpoint (names or shapes differ).
        """
        gemini = _gemini_optimizer(optimizer)
        if gemini is None:
            super().load_optimizer_state(optimizer, meta, reader)
            return
        names = param_names(gemini)
        manager = gemini.chunk_manager
        pieces = {v.name: v for v in gemini.master_views}

        def read(param: str, key: str) -> Any:
            stored = tuple(reader.shape(key))
            if not stored:
                return reader.read(key)  # step and other scalars
            view = pieces.get(param)
            if view is None:
                return _SKIP  # this rank holds none of the parameter (or it is frozen)
            chunk = manager.chunk_of(manager.param(param))
            shape = tuple(ChunkTensor(chunk, view.param).shape)
            if stored != shape:
                raise CheckpointError(
                    f"optimizer state {key!r} has shape {stored} in the checkpoint but the "
                    f"parameter has {shape}: the checkpoint belongs to another model"
                )
            return _read_piece(reader, key, manager, chunk, view.param)

        indexed = named_to_indexed(meta, reader.weight_map, names, read)
        state: dict[str, Any] = {}
        for index, entries in indexed["state"].items():
            view = pieces.get(names[int(index)])
            if view is None:
                continue
            kept = {k: v for k, v in entries.items() if v is not _SKIP}
            state[view.name] = {**kept, "range": (view.start, view.stop)}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]]
        scaler = indexed.get("loss_scaler") if gemini.scaler is not None else None
        gemini.load_state_dict({"state": state, "param_groups": groups, "loss_scaler": scaler})


def _read_piece(
    reader: TensorReader, name: str, manager: Any, chunk: Any, param: nn.Parameter
) -> torch.Tensor:
    """This rank's piece of ``param`` (its flat range of its local tensor, padding zero)."""
    return reader.read_part(name, ChunkTensor(chunk, param, manager=manager).part)


def _check_shape(reader: TensorReader, name: str, shape: tuple[int, ...], where: str) -> None:
    stored = tuple(reader.shape(name))
    if stored != shape:
        raise CheckpointError(
            f"{name!r} has shape {list(stored)} in {where} but {list(shape)} in the model: "
            "the checkpoint belongs to another model"
        )
