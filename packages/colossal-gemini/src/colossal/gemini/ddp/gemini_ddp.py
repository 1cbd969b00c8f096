"""GeminiDDP: a model whose parameters live in sharded chunks, driven by hooks.

The user's module is unchanged: its parameters' ``.data`` become views of chunk payloads
(gathered before use, released after), and their gradients go straight into the chunks and
are reduce-scattered into per-rank gradient shards. The optimizer side
(:class:`~colossal.gemini.GeminiOptimizer`) updates the fp32 master shards.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import ModelWrapper, keep_alive
from colossal.gemini.chunk import Chunk, ChunkManager, search_chunk_configuration
from colossal.gemini.ddp.hooks import ChunkRuntime
from colossal.gemini.memory import (
    AutoPlacement,
    DeviceMemoryBudget,
    MemStats,
    StaticPlacement,
)

logger = logging.getLogger(__name__)

__all__ = ["GeminiDDP", "TrainableShard"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
_CHUNK_CONFIG_KEYS = {"chunk_size", "keep_gathered"}


class TrainableShard(NamedTuple):
    """One trainable parameter (see :meth:`GeminiDDP.trainable_shards`)."""

    name: str
    param: nn.Parameter
    chunk: Chunk


class GeminiDDP(ModelWrapper):
    """Chunk-based ZeRO-3 data parallelism with device/host placement of the model data.

    Parameters are packed, in order of first use (``memstats.first_use_order()``, else the
    module's definition order), into chunks sharded evenly over ``process_group``; tied
    parameters are registered once; frozen parameters (``requires_grad=False``) go to their
    own chunks without master or gradient. Hooks gather a chunk before its module runs and
    release it after; an operator that uses a parameter outside its module's call (a tied
    head ``x @ self.wte.weight.t()`` in the root forward) is treated as a call of its own,
    found by a ``TorchFunctionMode`` active during the root forward (``ddp/outside.py``; its
    cost per operator is in colossal-gemini's CHANGELOG); backward follows the forward's
    access sequence reversed (see ``colossal.gemini.ddp.order``) so every rank issues the
    same collectives even when some outputs reach the loss on some ranks only. Gradients are
    reduce-scattered asynchronously on a separate process group over the same ranks.

    Not supported: a forward that runs different modules (or a different number of calls)
    on different ranks (colossal-core's collective timeout turns it into an error, not a
    hang), a view of a parameter (``w.t()``) made in forward and read after it returns,
    activation checkpointing that re-runs forward inside backward, and several
    forwards before one backward. Call :meth:`backward` (or the optimizer's) rather than
    ``loss.backward()`` so a rank on which no gradient reached the model still joins the
    reductions.

    Args:
        module: The model (its parameters are moved into chunks).
        process_group: The data-parallel group (``None``: the default group, or one process
            without torch.distributed). Next to tensor parallelism the job has several
            data-parallel groups: each rank passes its own (only its ranks take part in
            building the model).
        extra_dp_group: Ranks holding replicas of this rank's chunk shards (ColossalAI's
            extra data parallelism: the data-parallel ranks are ``process_group`` x
            ``extra_dp_group``); after the reduce-scatter over ``process_group`` each
            gradient shard is averaged over it at the end of backward (with
            ``enable_gradient_accumulation``: once, when ``GeminiOptimizer`` reads the
            shards; see ``ChunkManager.reduce_replica_grads``). ``None``: no replicas.
        precision: ``"fp16"``, ``"bf16"`` or ``"fp32"``: the dtype of the chunks (compute).
        chunk_config_dict: ``{"chunk_size": elements, "keep_gathered": bool}``; ``None``
            searches the size (:func:`~colossal.gemini.search_chunk_configuration`).
        search_range_m: Search range in 2**20 elements.
        hidden_dim: Search step (the model's hidden size), optional.
        min_chunk_size_m: Smallest searched chunk size in 2**20 elements.
        placement_policy: ``"static"`` or ``"auto"``.
        shard_param_frac: Static: fraction of the parameter bytes sharded (the rest kept
            gathered).
        offload_optim_frac: Static: fraction of the masters/optimizer states on the host.
        offload_param_frac: Static: fraction of the parameter shards on the host.
        warmup_non_model_data_ratio: Auto: device share for model data without memstats.
        steady_cuda_cap_ratio: Auto: device share for model data with memstats.
        device_memory_limit: Device capacity (bytes or a size string such as ``"512MB"``;
            ``None``: ``COLOSSAL_DEVICE_MEMORY_LIMIT`` or the accelerator's memory).
        memstats: A traced :class:`~colossal.gemini.MemStats` of this module (parameter
            order; the auto policy's next-use table).
        pin_memory: Pin host tensors (CUDA).
        force_outputs_fp32: Cast floating outputs to fp32.
        strict_ddp_mode: Accepted for API compatibility and ignored: every parameter is
            always managed by the chunks (ColossalAI's strict mode), so it is a no-op.
        enable_gradient_accumulation: Each backward adds to the gradient shards until the
            optimizer frees them (needed by :meth:`no_sync`); the gradient shards are then
            fp32 (with master weights), else they keep the chunk dtype.
        max_prefetch: How many chunks to gather ahead (asynchronously).
        master_weights: Keep fp32 master shards (else the optimizer updates the
            low-precision shards).
        verbose: Log the chunk layout.
        fp8_communication: Gather the chunks and reduce their gradients (over the extra dp
            replicas too) as float8 (:mod:`colossal.core.comm.fp8`): a quarter of the bytes,
            synchronous (no prefetch overlap); the masters and each rank's own shard stay
            exact.

    Raises:
        ValueError: An unknown ``precision``, ``placement_policy`` or chunk config key, a
            fraction outside [0, 1].
        colossal.gemini.DeviceMemoryExceeded: The placed model data does not fit the device
            memory limit.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: ProcessGroup | None = None,
        extra_dp_group: ProcessGroup | None = None,
        precision: str = "fp16",
        chunk_config_dict: Mapping[str, int | bool] | None = None,
        search_range_m: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        placement_policy: str = "static",
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        device_memory_limit: int | str | None = None,
        memstats: MemStats[nn.Parameter] | None = None,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        master_weights: bool = True,
        verbose: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
        if placement_policy not in ("static", "auto"):
            raise ValueError(f"placement_policy must be 'static' or 'auto', got "
                             f"{placement_policy!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        super().__init__(module)
        self.precision = precision
        self.compute_dtype = _DTYPES[precision]
        self.force_outputs_fp32 = force_outputs_fp32
        self.enable_gradient_accumulation = enable_gradient_accumulation
        self.strict_ddp_mode = strict_ddp_mode
        self.process_group = process_group
        self.extra_dp_group = extra_dp_group
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.budget = DeviceMemoryBudget(device_memory_limit)

        if isinstance(placement_policy, str) and placement_policy == "auto":
            auto = AutoPlacement(warmup_non_model_data_ratio, steady_cuda_cap_ratio)
            self.placement: StaticPlacement | AutoPlacement = auto
        else:
            self.placement = StaticPlacement(shard_param_frac, offload_optim_frac,
                                             offload_param_frac)

        named = self._ordered_params(module, memstats)
        chunk_size, keep = self._chunk_size(named, chunk_config_dict, world, search_range_m,
                                            min_chunk_size_m, hidden_dim, verbose)
        # Accumulating backwards add into the gradient shards: fp32 then, so many
        # micro-batches do not round away each other's small contributions.
        fp32_grads = enable_gradient_accumulation and master_weights
        self.chunk_manager = ChunkManager(
            chunk_size,
            process_group,
            budget=self.budget,
            master_dtype=torch.float32 if master_weights else None,
            pin_memory=pin_memory,
            max_prefetch=max_prefetch,
            grad_dtype=torch.float32 if fp32_grads else None,
            extra_dp_group=keep_alive(extra_dp_group),
            fp8_communication=bool(fp8_communication),
        )
        # Plan before building: every chunk is built on its planned locations and every byte
        # is charged to the budget as it is allocated (a limit that the model cannot fit
        # fails here, naming the need and the limit).
        specs = self.chunk_manager.layout(named, dtype=self.compute_dtype, keep_gathered=keep)
        plan = self.placement.plan(specs)
        self.chunk_manager.set_plan(plan)
        for name, p in named:
            self.chunk_manager.register(name, p, dtype=self.compute_dtype, keep_gathered=keep)
        self.chunk_manager.close_all()
        self.chunk_manager.set_plan(None)
        assert [s.payload_bytes for s in specs] == \
            [c.payload_bytes for c in self.chunk_manager.chunks], "layout drifted from register"
        self.chunk_manager.apply_placement(plan)  # already so (a no-op)
        self._cast_buffers(module)

        if isinstance(self.placement, AutoPlacement) and memstats is not None:
            by_param = {id(p): self.chunk_manager.chunk_of(p) for _, p in named}
            chunk_stats = memstats.remap(lambda obj: by_param.get(id(obj)))
            self.placement = self.placement.with_memstats(chunk_stats)
        # The device model-data peak while building; the budget's peak restarts for training.
        self.construction_peak = self.budget.peak("device")
        self.budget.reset_peak()

        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD) \
            if dist.is_initialized() else [0]
        # Only this group's ranks create it (its name hashes the ranks): next to tensor
        # parallelism every rank passes another data-parallel group, and a job-wide
        # ``new_group`` would pair ranks of different groups under one name.
        self.reduce_group = keep_alive(dist.new_group(ranks, use_local_synchronization=True)) \
            if dist.is_initialized() and world > 1 else None
        self._runtime = ChunkRuntime(
            self.chunk_manager,
            self.reduce_group,
            accumulate=enable_gradient_accumulation,
            before_gather=self._evict if isinstance(self.placement, AutoPlacement) else None,
            fits=self._fits if self.budget.capacity is not None else None,
        )
        self._runtime.install(module)
        self._no_sync = False
        self.evictions = 0  # parameter shards the auto placement moved to the host
        if verbose:
            logger.info("GeminiDDP: %d chunks of %d elements (%s), %s", len(self.chunk_manager
                        .chunks), chunk_size, precision, self.chunk_manager.memory())

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _ordered_params(
        module: nn.Module, memstats: MemStats[nn.Parameter] | None
    ) -> list[tuple[str, nn.Parameter]]:
        named = list(module.named_parameters())  # tied parameters once
        if memstats is None:
            return named
        pos = {id(p): i for i, (_, p) in enumerate(named)}
        first = [pos[id(o)] for o in memstats.first_use_order() if id(o) in pos]
        order = list(dict.fromkeys(first + list(range(len(named)))))
        return [named[i] for i in order]

    @staticmethod
    def _chunk_size(
        named: list[tuple[str, nn.Parameter]],
        config: Mapping[str, int | bool] | None,
        world: int,
        search_range_m: float,
        min_chunk_size_m: float,
        hidden_dim: int | None,
        verbose: bool,
    ) -> tuple[int, bool]:
        if config is not None:
            unknown = set(config) - _CHUNK_CONFIG_KEYS
            if unknown or "chunk_size" not in config:
                raise ValueError(f"chunk_config_dict takes {sorted(_CHUNK_CONFIG_KEYS)} "
                                 f"(chunk_size required), got {sorted(config)}")
            return int(config["chunk_size"]), bool(config.get("keep_gathered", False))
        result = search_chunk_configuration(
            named, search_range_m=search_range_m, min_chunk_size_m=min_chunk_size_m,
            dp_size=world, hidden_dim=hidden_dim, verbose=verbose,
        )
        return result.chunk_size, False

    def _cast_buffers(self, module: nn.Module) -> None:
        device = torch.device("cpu") if not self.chunk_manager.chunks else \
            self.chunk_manager.chunks[0].shard.device
        for sub in module.modules():
            for key, buf in sub._buffers.items():
                if buf is not None:
                    sub._buffers[key] = buf.to(device)

    def _stats_step(self, step: int) -> int:
        assert isinstance(self.placement, AutoPlacement)
        stats = self.placement.memstats
        return min(step, len(stats) - 1) if stats is not None and len(stats) else 0

    def _fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more device bytes fit (auto: the policy's model-data limit)."""
        if not isinstance(self.placement, AutoPlacement):
            return self.budget.fits(nbytes)
        limit = self.placement.model_data_limit(self._stats_step(self._runtime.step),
                                                self.budget)
        return limit is None or self.budget.used("device") + nbytes <= limit

    def _evict(self, needed: list[Chunk], step: int, demand: int | None = None) -> None:
        """Auto placement: move parameter shards to the host so ``demand`` device bytes fit.

        ``demand`` defaults to the payloads of the ``needed`` chunks not gathered (a gather
        allocates the whole payload; the shard stays where it is).
        """
        assert isinstance(self.placement, AutoPlacement)
        resident = [c for c in self.chunk_manager.chunks
                    if not c.keep_gathered and not c.is_gathered and c.shard_location == "device"]
        step = self._stats_step(step)
        if demand is None:
            demand = sum(c.payload_bytes for c in needed if not c.is_gathered)
        for chunk in self.placement.evictions(
            resident, needed, step, self.budget, demand=demand, size_of=lambda c: c.shard_bytes
        ):
            chunk.move_shard("host")
            self.evictions += 1

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module with floating inputs cast to the compute dtype.

        A managed parameter may also be used outside the forward of its module (a tied head
        ``x @ self.wte.weight.t()`` in the root forward): such an operator is gathered for,
        recorded and replayed in backward like a module call (``ddp/outside.py``).
        """
        self._runtime.start_forward()
        cast = self._cast_input
        args, kwargs = pytree.tree_map(cast, (args, kwargs))
        with self._runtime.outside_use():
            out = self.module(*args, **kwargs)
        if self.force_outputs_fp32:
            out = pytree.tree_map(
                lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point()
                else t, out)
        return out

    def _cast_input(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.compute_dtype)
        return t

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` and finish the step's reductions (every rank joins them)."""
        loss.backward()
        self._runtime.finish_backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """``torch.autograd.backward(tensor, grad)`` and finish the step's reductions."""
        torch.autograd.backward(tensor, grad)
        self._runtime.finish_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over micro-batches (into the gradient shards).

        Gemini reduces every backward (the gradients live only in the chunks); with
        ``enable_gradient_accumulation`` each reduction is added to the gradient shards until
        the optimizer step frees them, which is what accumulation needs.

        Raises:
            RuntimeError: The model was built without ``enable_gradient_accumulation``.
        """
        if not self.enable_gradient_accumulation:
            raise RuntimeError("GeminiDDP.no_sync() needs enable_gradient_accumulation=True "
                               "(each backward would otherwise replace the gradients)")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    @property
    def accumulating(self) -> bool:
        """Whether backward passes now accumulate (inside :meth:`no_sync`)."""
        return self._no_sync

    # ------------------------------------------------------------------ optimizer interface
    def trainable_shards(self) -> list[TrainableShard]:
        """``(name, param, chunk)`` of every trainable parameter, in chunk order.

        ``chunk.tensor_shard(param, source="master" | "grad" | "shard")`` gives this rank's
        ``(start, stop, view)`` of it.
        """
        out = []
        for chunk in self.chunk_manager.chunks:
            if chunk.requires_grad:
                out += [TrainableShard(chunk.infos[p].name, p, chunk) for p in chunk.params]
        return out

    def named_chunk_params(self) -> Iterator[tuple[str, nn.Parameter, Chunk]]:
        """Every managed parameter (frozen ones too) with its name and chunk."""
        for chunk in self.chunk_manager.chunks:
            for p in chunk.params:
                yield chunk.infos[p].name, p, chunk

    def after_optimizer_step(self) -> None:
        """Refresh the shards from the masters (released payloads are stale)."""
        for chunk in self.chunk_manager.chunks:
            if chunk.requires_grad:
                chunk.update_shard_from_master()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free every gradient shard."""
        for chunk in self.chunk_manager.chunks:
            if chunk.requires_grad:
                chunk.free_grad_shard()

    # ------------------------------------------------------------------ state
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Full fp32 tensors on the CPU, gathered chunk by chunk.

        For small models and tests only: every rank ends up with the whole model. The
        sharded checkpoint protocol (no whole-model gather) is the way to save big models.
        As torch's, a tied parameter appears under each of its names (the same tensor), in
        the module's order.
        """
        values: dict[int, torch.Tensor] = {}
        for chunk in self.chunk_manager.chunks:
            was = chunk.is_gathered
            self.chunk_manager.access(chunk)
            for p in chunk.params:
                values[id(p)] = p.detach().to("cpu", torch.float32, copy=True)
            if not was:
                self.chunk_manager.release(chunk)
        out: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in values:
                out[name] = values[id(p)]
        for name, buf in self.module.named_buffers():
            out[name] = buf.detach().cpu().clone()
        return out

    def _aliases(self) -> dict[int, list[str]]:
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return names

    def load_state_dict(self, state_dict: dict[str, torch.Tensor],  # type: ignore[override]
                        strict: bool = True) -> None:
        """Load full tensors into the shards and masters (each rank takes its slices).

        A tied parameter is read under any of its names.

        Raises:
            KeyError: ``strict`` and a parameter is missing.
        """
        aliases = self._aliases()
        for chunk in self.chunk_manager.chunks:
            for p in chunk.params:
                name = chunk.infos[p].name
                found = [n for n in aliases.get(id(p), [name]) if n in state_dict]
                if not found:
                    if strict:
                        raise KeyError(f"parameter {name!r} missing from the state dict")
                    continue
                name = found[0]
                flat = state_dict[name].reshape(-1)
                for source in ("shard", "master"):
                    start, stop, view = chunk.tensor_shard(p, source=source)
                    view.copy_(flat[start:stop])
            if chunk.is_gathered:
                if chunk.keep_gathered:
                    for p in chunk.params:
                        found = [n for n in aliases.get(id(p), []) if n in state_dict]
                        if found:
                            with torch.no_grad():
                                p.copy_(state_dict[found[0]].reshape(p.shape))
                else:
                    self.chunk_manager.release(chunk)
        for name, buf in self.module.named_buffers():
            if name in state_dict:
                buf.copy_(state_dict[name])
        return None


if TYPE_CHECKING:  # a type checker verifies the accumulation contract
    from colossal.core import GradientAccumulator

    def _accumulates(obj: GeminiDDP) -> GradientAccumulator:
        return obj
