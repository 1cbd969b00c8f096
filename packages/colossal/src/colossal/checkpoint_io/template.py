"""CheckpointIO: saves and loads models, optimizers and lr schedulers in the one format.

Every tensor is seen through :class:`colossal.core.ShardedTensor`: saving gathers each one
only to the rank that writes it, loading reads only the part each rank holds. Plugins
override the state hooks (which tensors a boosted model/optimizer has and how a rank holds
them); the files, the index, sharding, async writing and crash safety live here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from colossal.checkpoint_io import durable
from colossal.checkpoint_io.commit import resolve_directory
from colossal.checkpoint_io.formats import COLOSSAL, detect_model_checkpoint, open_model_reader
from colossal.checkpoint_io.hf_config import hf_config_files
from colossal.checkpoint_io.index import CheckpointError, read_index
from colossal.checkpoint_io.names import param_names
from colossal.checkpoint_io.optimizer_fit import check_optimizer_fits, param_shapes_entry
from colossal.checkpoint_io.optimizer_state import indexed_to_named, named_to_indexed
from colossal.checkpoint_io.reader import TensorReader
from colossal.checkpoint_io.saver import ShardedSaver, run_on_rank0
from colossal.checkpoint_io.sharded import (
    DTensorShard,
    TensorLike,
    as_sharded,
    is_sharded,
    marked_state_dict,
)
from colossal.core import (
    LocalShard,
    ModelWrapper,
    OptimizerWrapper,
    ShardedTensor,
    shard_spec,
    sharded_view,
)
from colossal.core.io import adopt_optimizer_state

logger = logging.getLogger(__name__)

__all__ = ["MODEL_INDEX", "OPTIMIZER_INDEX", "CheckpointIO", "unwrap_model"]

MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "optimizer.safetensors.index.json"
SCHEDULER_FILE = "lr_scheduler.json"


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside Colossal and torch wrappers."""
    return model.unwrap() if isinstance(model, ModelWrapper) else model


class CheckpointIO:
    """Checkpoint IO in Colossal's single format; the default suits replicated models.

    Models are saved as Hugging Face safetensors directories (full, unpadded tensors under
    the module's ``state_dict`` names, tied weights once), optimizers as
    ``"<param name>.<state name>"`` shards plus JSON (param groups by name, hyper-parameters,
    steps, loss scaler). Writing is spread over the ranks of ``group``.

    Args:
        group: The ranks that write and read together (the whole job when None).
        verify_checksums: Check every file's CRC-32 before loading (each file read by one
            rank of ``group``; sizes are always checked).
        write_in_place: Write a sync save whose values are all plain (replicated) tensors,
            as a DDP model's and optimizer's, in place: every rank writes its share of the
            tensors straight into the final files (:mod:`colossal.checkpoint_io.inplace`).
            False: each file is written whole by one rank and the ranks meet in a staging
            folder. Both give the same files and the same crash safety.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        verify_checksums: bool = True,
        write_in_place: bool = True,
    ) -> None:
        self.group = group
        self.verify_checksums = verify_checksums
        self.write_in_place = write_in_place
        self.saver = ShardedSaver(group)
        self._low_cpu_mem_mode = True
        self._num_threads = 1

    # ---- how loads read --------------------------------------------------------------------
    @contextlib.contextmanager
    def reading(
        self, low_cpu_mem_mode: bool | None = None, num_threads: int | None = None
    ) -> Iterator[None]:
        """Loads inside the block read as given (None keeps the current setting).

        ``low_cpu_mem_mode=True`` (the default) streams: each tensor, or only the part a rank
        keeps, is read when it is copied in. ``False`` first reads every tensor the load
        needs whole into memory, ``num_threads`` shard files at once
        (:meth:`TensorReader.preload`): more memory (the whole tensors read), larger reads,
        files in parallel. Both load identical values.

        Raises:
            TypeError: ``low_cpu_mem_mode`` is not a bool.
            ValueError: ``num_threads`` is not a positive int.
        """
        if low_cpu_mem_mode is not None and not isinstance(low_cpu_mem_mode, bool):
            raise TypeError(f"low_cpu_mem_mode must be True or False, got {low_cpu_mem_mode!r}")
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(f"num_threads={num_threads!r} must be a positive int (1: one reader)")
        previous = (self._low_cpu_mem_mode, self._num_threads)
        if low_cpu_mem_mode is not None:
            self._low_cpu_mem_mode = low_cpu_mem_mode
        if num_threads is not None:
            self._num_threads = num_threads
        try:
            yield
        finally:
            self._low_cpu_mem_mode, self._num_threads = previous

    def _prepare_reader(self, reader: TensorReader, names: Iterable[str] | None) -> TensorReader:
        """``reader``, with ``names`` preloaded unless this load streams (see :meth:`reading`)."""
        if not self._low_cpu_mem_mode:
            read = reader.preload(names, self._num_threads)
            logger.debug("preloaded %d bytes with %d threads", read, self._num_threads)
        return reader

    def _optimizer_reader(self, directory: str, index: Mapping[str, Any]) -> TensorReader:
        """A reader over an optimizer checkpoint's shards, read as :meth:`reading` says."""
        return self._prepare_reader(TensorReader(directory, index["weight_map"]), None)

    def _rank(self) -> int:
        if not dist.is_initialized():
            return 0
        return dist.get_rank(self.group)

    # ---- hooks for plugins -----------------------------------------------------------------
    # Every tensor is seen through colossal.core.ShardedTensor (sharded.as_sharded): saving
    # gathers each one only to the rank writing it, loading reads only the part a rank holds.
    keep_states: tuple[str, ...] = ()
    """Optimizer states a plain optimizer drops on load that this IO keeps (ZeRO's masters)."""

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """Tensors (or sharded tensors) by name, the same names on every rank.

        A parameter marked with :func:`colossal.core.mark_sharded` (tensor parallel) stays
        marked, so it is saved as the whole tensor its rank holds a part of.
        """
        return marked_state_dict(unwrap_model(model))

    def to_full(self, tensor: Any, dst: int | None = None) -> torch.Tensor | None:
        """The full tensor of a possibly sharded one (collective for sharded tensors).

        ``dst`` is the rank of the group that needs it (the writer of its file); the other
        ranks get ``None`` from sharded tensors. A plain tensor is returned as it is.
        """
        if not is_sharded(tensor):
            return tensor
        return as_sharded(tensor).gather(self._global_rank(dst))

    def _writes_in_place(self, state: dict[str, Any]) -> bool:
        """Whether a sync save of ``state`` is written in place (no value is sharded)."""
        return self.write_in_place and not any(is_sharded(v) for v in state.values())

    def _global_rank(self, rank: int | None) -> int | None:
        """``rank`` of this IO's group as a global rank."""
        if rank is None or self.group is None or not dist.is_initialized():
            return rank
        return dist.get_global_rank(self.group, rank)

    def load_model_state(
        self, model: nn.Module, targets: Mapping[str, TensorLike], reader: TensorReader
    ) -> None:
        """Read into each target (name -> this rank's tensor) only the part this rank holds."""
        with torch.no_grad():
            for name, target in targets.items():
                shard = as_sharded(target)
                if shard.part.numel == 0:
                    continue  # only padding here (e.g. the tail of a padded vocabulary)
                data = reader.read_part(name, shard.part)
                held = shard.part.real(shard.local())
                held.copy_(data.reshape(held.shape))

    def optimizer_state(self, optimizer: OptimizerWrapper) -> dict[str, Any]:
        """A torch-style state dict keyed by parameter index (tensors full or sharded).

        The states of a parameter marked with :func:`colossal.core.mark_sharded` that are laid
        out like it (Adam's moments) are marked alike, so they are saved whole and unpadded.
        """
        state = optimizer.state_dict()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        marked = {i for i, p in enumerate(params) if shard_spec(p) is not None}
        if not marked:
            return state
        per_param = {}
        for index, entries in state.get("state", {}).items():
            param = params[int(index)] if int(index) in marked else None
            per_param[index] = {  # new dicts: torch's hold the optimizer's own
                key: sharded_view(value.detach(), like=param)
                if param is not None
                and isinstance(value, torch.Tensor)
                and value.shape == param.shape
                else value
                for key, value in entries.items()
            }
        return {**state, "state": per_param}

    def optimizer_layout(self, optimizer: OptimizerWrapper) -> dict[int, ShardedTensor]:
        """Per parameter index, how this rank holds that parameter's optimizer states.

        The default: as it holds the parameter (a DTensor's shard, or all of a plain one).
        """
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names = param_names(optimizer)
        if len(params) != len(names):
            raise TypeError(
                f"{type(optimizer).__name__}'s param groups hold {len(params)} tensors for "
                f"{len(names)} parameters (it keeps its own flat copies); save and load it "
                "with its plugin's checkpoint IO (booster.save_optimizer)"
            )
        return {i: as_sharded(p) for i, p in enumerate(params)}

    def load_state_value(self, layout: ShardedTensor, local: torch.Tensor) -> TensorLike:
        """What the optimizer's ``load_state_dict`` takes for a state read as ``local``.

        ``local`` holds the elements ``layout.part`` describes; a DTensor's state is rebuilt
        as a DTensor laid out like its parameter.
        """
        if isinstance(layout, DTensorShard):
            return layout.wrap(local)
        if isinstance(layout, LocalShard):  # a marked parameter: its state laid out like it
            held = layout.local()
            if held.shape != local.shape:  # padded: the checkpoint holds only the real part
                out = torch.zeros(held.shape, dtype=local.dtype, device=held.device)
                real = layout.part.real(out)
                real.copy_(local.reshape(real.shape))
                return out
        return local

    def load_optimizer_state(
        self, optimizer: OptimizerWrapper, meta: dict[str, Any], reader: TensorReader
    ) -> None:
        """Load the named checkpoint state, each rank reading only the parts it holds.

        Raises:
            CheckpointError: A stored state of a sharded parameter has another shape.
        """
        names = param_names(optimizer)
        position = {n: i for i, n in enumerate(names)}
        layouts = self.optimizer_layout(optimizer)

        def read(param: str, key: str) -> Any:
            layout = layouts.get(position[param])
            stored = reader.shape(key)
            if layout is None or not stored:
                return reader.read(key)  # scalars (e.g. step) and untrained parameters
            whole = layout.part.is_whole(layout.shape)
            if whole and tuple(stored) != tuple(layout.shape):
                return reader.read(key)  # a held-whole parameter's state of its own shape
            if whole:
                return self.load_state_value(layout, reader.read(key))
            if tuple(stored) != tuple(layout.shape):
                raise CheckpointError(
                    f"optimizer state {key!r} has shape {tuple(stored)} in the checkpoint but "
                    f"the parameter has {tuple(layout.shape)}: the checkpoint belongs to "
                    "another model"
                )
            return self.load_state_value(layout, reader.read_part(key, layout.part))

        state = named_to_indexed(meta, reader.weight_map, names, read, keep=self.keep_states)
        if not isinstance(optimizer, OptimizerWrapper) or not hasattr(optimizer, "scaler"):
            state.pop("loss_scaler", None)
        # Read tensors may be views of the file's memory map: give the optimizer its own.
        optimizer.load_state_dict(adopt_optimizer_state(optimizer, state))

    # ---- model -----------------------------------------------------------------------------
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
        """Save ``model`` into the directory ``checkpoint`` (collective).

        A Hugging Face model's ``config.json`` (and ``generation_config.json``) is written with
        the weights, so ``from_pretrained(checkpoint)`` loads it. Only the model's own files
        are replaced (the optimizer's, the scheduler's and the user's stay); the previous
        model checkpoint there stays loadable until the new index replaces its index. With
        ``shard=False`` and a ``checkpoint`` ending in ``.safetensors``, the weights are
        written as that one file instead (no index, no config). A sync save of plain
        (replicated) tensors is shared by the ranks in place (``write_in_place``); a failed
        one removes the files, and the directory, it created.

        Args:
            model: A boosted (or plain) model.
            checkpoint: Target directory (created if needed), or a ``.safetensors`` file.
            shard: Split into files of at most ``size_per_shard`` MB (else one file).
            size_per_shard: MB per shard.
            use_safetensors: Must be True: the format is safetensors.
            use_async: Write in the background; wait with :meth:`synchronize`.
            background_snapshot: With ``use_async``, snapshot the parameters on a background
                thread too (buffers are copied before returning); the caller promises not to
                modify them before :meth:`wait_snapshots` (the Booster makes the optimizer's
                step wait).

        Raises:
            ValueError: ``use_safetensors=False``.
            PermissionError: ``checkpoint`` is a read-only directory.
        """
        if not use_safetensors:
            raise ValueError(
                "Colossal checkpoints are always safetensors; pass use_safetensors=True"
            )
        state = _dedupe_tied(self.model_state(model))
        limit = size_per_shard if shard else float("inf")
        params = dict(unwrap_model(model).named_parameters(remove_duplicate=False))
        if not shard and checkpoint.endswith(".safetensors") and not os.path.isdir(checkpoint):
            self.saver.save_file(
                state,
                checkpoint,
                use_async=use_async,
                gather=self.to_full,
                background=set(params) if background_snapshot else (),
                in_place=self._writes_in_place(state),
            )
            return
        self.saver.save(
            state,
            checkpoint,
            "model",
            MODEL_INDEX,
            limit,
            use_async=use_async,
            gather=self.to_full,
            background=set(params) if background_snapshot else (),
            extra_files=hf_config_files(self.config_module(model)) if self._rank() == 0 else None,
            in_place=self._writes_in_place(state),
        )

    def config_module(self, model: nn.Module) -> nn.Module:
        """The module whose Hugging Face config files are saved with the weights."""
        return unwrap_model(model)

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str,
        strict: bool = True,
        low_cpu_mem_mode: bool | None = None,
        num_threads: int | None = None,
    ) -> None:
        """Load a model checkpoint saved by any plugin at any world size, or one users have.

        ``checkpoint`` may be a Colossal checkpoint directory, a Hugging Face model directory
        (``model.safetensors``, safetensors shards with ``model.safetensors.index.json``, or
        ``pytorch_model.bin``), a ``.safetensors`` file or a ``torch.save``'d state dict
        (a ``module.`` prefix on every name is dropped); which one was found is logged.
        Collective over the group when it has several ranks (for a Colossal checkpoint they
        share the checksum reads and agree on the verdict); each rank reads only the tensors
        or slices it keeps (a ``torch.save``'d file is read whole).

        ``low_cpu_mem_mode`` and ``num_threads`` (ColossalAI's arguments) choose how the
        tensors are read, as :meth:`reading` says (None: the current setting, streaming by
        default); the loaded values are the same.

        Raises:
            FileNotFoundError: ``checkpoint`` does not exist.
            CheckpointError: ``checkpoint`` is none of the above (the message says what it
                is), incomplete/corrupt, lacks or has unexpected tensors (``strict``), or
                has tensors of other shapes (another model's checkpoint).
        """
        with self.reading(low_cpu_mem_mode, num_threads):
            self._load_model(model, checkpoint, strict)

    def _load_model(self, model: nn.Module, checkpoint: str, strict: bool) -> None:
        self.wait_snapshots()
        module = unwrap_model(model)
        targets, aliases = _load_targets(marked_state_dict(module))
        reader = self._model_reader(checkpoint, [a for n in targets for a in aliases[n]])
        directory = reader.directory
        saved = set(reader.weight_map)
        chosen: dict[str, torch.Tensor] = {}
        missing = []
        for name, target in targets.items():
            source = next((a for a in aliases[name] if a in saved), None)
            if source is None:
                missing.append(name)
                continue
            stored = reader.shape(source)
            if list(_global_shape(target)) != stored:
                raise CheckpointError(
                    f"{source!r} has shape {stored} in {directory} but "
                    f"{list(_global_shape(target))} in the model: the checkpoint belongs to "
                    "another model"
                )
            chosen[source] = target
        unexpected = sorted(saved - {a for n in targets for a in aliases[n]})
        if strict and (missing or unexpected):
            raise CheckpointError(
                f"checkpoint {directory} does not match the model: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}; load the checkpoint of this model or pass "
                "strict=False"
            )
        self.load_model_state(model, chosen, reader)
        reader.close()

    def _model_reader(self, checkpoint: str, names: list[str]) -> TensorReader:
        """A reader over the model checkpoint at ``checkpoint``, whatever its format."""
        path = checkpoint if os.path.exists(checkpoint) else resolve_directory(checkpoint)
        source = detect_model_checkpoint(path)
        logger.info("loading the model from %s", source.description)
        if source.kind != COLOSSAL:
            return self._prepare_reader(open_model_reader(source, names), names)
        index = read_index(source.directory, MODEL_INDEX, self.verify_checksums, self.group)
        return self._prepare_reader(TensorReader(source.directory, index["weight_map"]), names)

    # ---- optimizer -------------------------------------------------------------------------
    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        shard: bool = False,
        size_per_shard: int = 1024,
        use_async: bool = False,
        background_snapshot: bool = False,
    ) -> None:
        """Save the optimizer's state into the directory ``checkpoint`` (collective).

        Only the optimizer's own files there are replaced, as in :meth:`save_model`.
        ``use_async`` and ``background_snapshot`` as in :meth:`save_model` (every state tensor
        may be snapshotted in the background: only the optimizer's step changes them).
        """
        tensors, meta = indexed_to_named(self.optimizer_state(optimizer), param_names(optimizer))
        meta["param_shapes"] = param_shapes_entry(self._param_shapes(optimizer))
        limit = size_per_shard if shard else float("inf")
        self.saver.save(
            tensors,
            checkpoint,
            "optimizer",
            OPTIMIZER_INDEX,
            limit,
            extra=meta,
            use_async=use_async,
            gather=self.to_full,
            background=set(tensors) if background_snapshot else (),
            in_place=self._writes_in_place(tensors),
        )

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        low_cpu_mem_mode: bool | None = None,
        num_threads: int | None = None,
    ) -> None:
        """Load an optimizer directory saved by any plugin at any world size.

        Collective over the group when it has several ranks, as :meth:`load_model`.
        ``prefix`` and ``size_per_shard`` are ColossalAI's and unused (the index names the
        files); ``low_cpu_mem_mode`` and ``num_threads`` as in :meth:`load_model`.

        Raises:
            CheckpointError: Incomplete/corrupt checkpoint, or one of other parameters (other
                names or shapes: another model's), refused before anything is loaded.
        """
        with self.reading(low_cpu_mem_mode, num_threads):
            self._load_optimizer(optimizer, checkpoint)

    def _load_optimizer(self, optimizer: OptimizerWrapper, checkpoint: str) -> None:
        self.wait_snapshots()
        directory = resolve_directory(checkpoint)
        index = read_index(directory, OPTIMIZER_INDEX, self.verify_checksums, self.group)
        reader = self._optimizer_reader(directory, index)
        check_optimizer_fits(index, reader.shape, self._param_shapes(optimizer))
        self.load_optimizer_state(optimizer, index, reader)
        reader.close()

    def _param_shapes(self, optimizer: OptimizerWrapper) -> dict[str, tuple[int, ...]]:
        """Global shape of each parameter of ``optimizer``, by name."""
        names = param_names(optimizer)
        layouts = self.optimizer_layout(optimizer)
        return {names[i]: tuple(layout.shape) for i, layout in layouts.items()}

    # ---- lr scheduler ----------------------------------------------------------------------
    def save_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """Save the scheduler's state as JSON (rank 0 writes; collective).

        ``checkpoint`` is the JSON file, or a directory (e.g. the one holding the model and
        optimizer) to write ``lr_scheduler.json`` into; nothing else in it is touched.
        """
        state = lr_scheduler.state_dict()
        target = _scheduler_file(checkpoint)

        def write() -> None:
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            durable.write_json(target, _to_json(state))

        run_on_rank0(write, self.group)

    def load_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str) -> None:
        """Load a scheduler state saved by :meth:`save_lr_scheduler` (file or directory)."""
        import json

        target = _scheduler_file(checkpoint)
        if not os.path.isfile(target):
            raise FileNotFoundError(f"no lr scheduler checkpoint at {target!r}")
        with open(target, encoding="utf-8") as file:
            lr_scheduler.load_state_dict(json.load(file))

    # ---- async -----------------------------------------------------------------------------
    def wait_snapshots(self) -> None:
        """Wait until async saves have snapshotted what they save (local, no collective).

        After it returns the saved parameters and optimizer states may be modified.
        """
        self.saver.wait_snapshots()

    def synchronize(self) -> None:
        """Wait until every async save has been committed on every rank (collective)."""
        self.saver.synchronize()

    # ColossalAI's tests wait for async saves through these two private names.
    def _sync_d2h(self) -> None:
        """ColossalAI's name of :meth:`wait_snapshots` (the device-to-host copies are done)."""
        self.wait_snapshots()

    def _sync_io(self) -> None:
        """ColossalAI's name of :meth:`synchronize` (every async save is on disk)."""
        self.synchronize()


def _scheduler_file(checkpoint: str) -> str:
    """The scheduler's JSON file for ``checkpoint`` (a file, or a directory to put it in)."""
    if os.path.isdir(checkpoint) or checkpoint.endswith(("/", os.sep)):
        return os.path.join(checkpoint, SCHEDULER_FILE)
    return checkpoint


def _global_shape(t: torch.Tensor) -> torch.Size:
    return as_sharded(t).shape


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    local = t.to_local() if hasattr(t, "to_local") else t
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape))


def _dedupe_tied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    seen: set[tuple[Any, ...]] = set()
    out = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):  # a ShardedTensor: its IO deduplicated it
            out[name] = tensor
            continue
        key = _storage_key(tensor)
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def _load_targets(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Unique tensors to fill, and for each the names it is known by (tied weights)."""
    first: dict[tuple[Any, ...], str] = {}
    targets: dict[str, torch.Tensor] = {}
    aliases: dict[str, list[str]] = {}
    for name, tensor in state.items():
        key = _storage_key(tensor)
        if tensor.numel() and key in first:
            aliases[first[key]].append(name)
            continue
        first[key] = name
        targets[name] = tensor
        aliases[name] = [name]
    return targets, aliases


def _to_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, Callable):  # type: ignore[arg-type]
        return None
    return value
