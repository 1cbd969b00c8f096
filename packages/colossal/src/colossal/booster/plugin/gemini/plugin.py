"""GeminiPlugin: chunk-based ZeRO-3 with heterogeneous memory behind the Booster API.

Wraps ``colossal.gemini``: the model in :class:`~colossal.gemini.GeminiDDP` (its parameters
move into flat chunks sharded over the data-parallel group, gathered around their use), the
optimizer in :class:`~colossal.gemini.GeminiOptimizer` (the user's optimizer steps this
rank's fp32 master shards; fp16 dynamic loss scaling, global-norm clipping). Build the
optimizer over the model's parameters before boosting: Gemini moves the parameters' data
into chunks, and the optimizer is rebuilt over the master shards.

With ``tp_size > 1`` the plugin composes Gemini with Shardformer's tensor parallelism: the
ranks are laid out by :class:`~colossal.core.ParallelDims` (``dp = world / tp`` outside,
``tp`` inside), Shardformer splits the model over the tensor-parallel group, the user's
optimizer is pointed at the split parameters by name (a tied weight under any of its
names), and Gemini shards this rank's parts over the data-parallel group. Gradients are
averaged over dp by Gemini; under sequence parallelism the norms' partial gradients are
summed over tp as autograd produces them. The gradient norm and the fp16 overflow verdict
are reduced over dp and then tp; a parameter replicated over tp is counted on tp rank 0
only, a split one on every tp rank (its parts).

With ``extra_dp_size > 1`` (ColossalAI's extra data parallelism) the data-parallel ranks
are ``extra_dp x zero`` (``ParallelDims(dp_shard=zero)``: replicas outside, the shard group
inside, tp innermost): Gemini shards each chunk over the zero group of ``world / (tp_size *
extra_dp_size)`` ranks, reduce-scatters the gradients over it and then averages each
gradient shard over the extra-dp group, whose ranks hold replicas of the same shards. The
norm and the overflow verdict count each shard once (over zero, then tp). A checkpoint is
written by the replica of extra-dp coordinate 0 and read by every replica.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import (
    Boosted,
    Criterion,
    DPPluginBase,
    find_module,
    materialize_model,
    warn_if_slow_precision,
)
from colossal.booster.plugin.gemini.checkpoint_io import GeminiCheckpointIO
from colossal.booster.plugin.gemini.config import (
    GeminiConfig,
    ShardformerOptions,
    normalize_chunk_config,
)
from colossal.booster.plugin.sharding import shard_and_repoint
from colossal.checkpoint_io import CheckpointIO
from colossal.core import (
    OptimizerWrapper,
    ParallelDims,
    ScalerConfig,
    get_accelerator,
    warn_once,
)
from colossal.gemini import GeminiDDP, GeminiOptimizer, MemStats

logger = logging.getLogger(__name__)

__all__ = ["GeminiPlugin"]


class GeminiPlugin(DPPluginBase):
    """ZeRO-3 on chunks (``colossal.gemini``) with static or automatic device/host placement.

    Parameters are packed in order of first use into chunks of a searched size, sharded
    evenly over the data-parallel group; each chunk is all-gathered before its parameters
    compute and released after, and its gradients are reduce-scattered as soon as they are
    complete. The plugin controls precision (the chunks hold ``precision`` parameters; fp32
    masters are sharded too). Build the optimizer over the model's parameters *before*
    boosting (Gemini moves the parameters into chunks).

    Args:
        chunk_config_dict: ``{"chunk_size": elements, "keep_gathered": bool}`` (or
            ColossalAI's ``{dp_size: {...}}``); None searches the chunk size.
        chunk_init_device: Accepted for compatibility: chunks are built on the accelerator
            and the placement policy decides what moves to the host (use
            ``offload_param_frac``/``offload_optim_frac`` for that).
        placement_policy: ``"static"`` (fixed fractions below) or ``"auto"`` (a runtime
            tracer measures the first steps; chunks used furthest ahead are evicted to the
            host when the device would exceed its capacity).
        enable_gradient_accumulation: Each backward adds to the gradient shards until the
            optimizer step (needed for :meth:`no_sync` / several backwards per step).
        shard_param_frac: Static: fraction of the parameters sharded (1.0 is ZeRO-3, 0.0
            keeps every chunk gathered, ZeRO-2-like).
        offload_optim_frac: Static: fraction of the fp32 masters and optimizer states kept
            on the host.
        offload_param_frac: Static: fraction of the parameter shards kept on the host.
        warmup_non_model_data_ratio: Auto: device share for model data before memory stats.
        steady_cuda_cap_ratio: Auto: device share for model data once traced.
        precision: ``"fp16"`` (dynamic loss scaling), ``"bf16"`` or ``"fp32"``.
        master_weights: Keep fp32 master shards (else the low-precision shards are updated).
        pin_memory: Pin host tensors (effective with CUDA only; accepted on CPU).
        force_outputs_fp32: Cast the model's floating outputs to fp32.
        strict_ddp_mode: Accepted for compatibility (every parameter is managed by Gemini).
        search_range_m: Chunk-size search range in 2**20 elements.
        hidden_dim: The model's hidden size (the search's step), optional.
        min_chunk_size_m: Smallest searched chunk size in 2**20 elements.
        memstats: A traced :class:`colossal.gemini.MemStats` of the model (parameter order,
            the auto policy's next-use table).
        gpu_margin_mem_ratio: Accepted for compatibility (ColossalAI's hybrid CPU optimizer
            margin); it has no effect here: the auto policy's budget is
            ``steady_cuda_cap_ratio`` of the device memory (or ``device_memory_limit``).
        initial_scale: fp16 loss scaler: initial scale.
        min_scale: fp16 loss scaler: smallest scale.
        growth_factor: fp16 loss scaler: growth multiplier.
        backoff_factor: fp16 loss scaler: backoff multiplier.
        growth_interval: fp16 loss scaler: clean steps between growths.
        hysteresis: fp16 loss scaler: overflows tolerated before a backoff.
        max_scale: fp16 loss scaler: largest scale.
        max_norm: Clip gradients to this global norm at every step (0: no clipping); do not
            clip by hand as well.
        norm_type: The norm of the clipping.
        tp_size: Tensor-parallel size (Shardformer; the model must be a Hugging Face model
            it has a policy for); the data-parallel size is ``world / tp_size``.
        extra_dp_size: Replicas of the Gemini shard group: each chunk is sharded over
            ``world / (tp_size * extra_dp_size)`` ranks (the zero group) and its gradient
            shard averaged over the ``extra_dp_size`` replicas (1: shard over all of dp).
        enable_all_optimization: Fused normalization and flash attention (Shardformer).
        enable_fused_normalization: colossal-kernels' fused LayerNorm/RMSNorm (Shardformer).
        enable_flash_attention: colossal-kernels' attention dispatch (Shardformer).
        enable_sequence_parallelism: Split the sequence over the tensor-parallel group
            (``split_gather``; needs ``tp_size > 1``).
        enable_jit_fused: Accepted for compatibility (a no-op in Shardformer).
        enable_sequence_overlap: Shardformer's option (needs sequence parallelism).
        verbose: Log the chunk layout, skipped steps and scale changes.
        device_memory_limit: Device capacity for Gemini's accounting (bytes or ``"512MB"``;
            None: ``COLOSSAL_DEVICE_MEMORY_LIMIT`` or the accelerator's memory). On CPU it
            makes placement and eviction account "device" memory against this limit.
        max_prefetch: Chunks gathered ahead of their use (asynchronously).
        dp_group: The data-parallel group (the whole job when None; not with
            ``tp_size > 1`` or ``extra_dp_size > 1``, whose groups come from the job's
            layout).
        fp8_communication: Gather the chunks and reduce their gradients (over the extra dp
            replicas too) as float8 (``GeminiDDP(fp8_communication=True)``), synchronously
            (no prefetch overlap). The tensor-parallel collectives stay uncompressed.
        enable_async_reduce: ColossalAI's asynchronous gradient reduce-scatter (its default
            True). GeminiDDP always launches each chunk's reduction asynchronously as soon as
            its gradients are complete and waits for it before the step, so True is what
            runs; False is accepted and warns once that it has no effect (the results are
            the same). Unlike ColossalAI, it does not turn ``pin_memory`` on.

    Attributes:
        pg_mesh: The mesh the groups come from (``dp_replicate`` x ``dp_shard`` x ``tp``...).
        zero_group, extra_dp_group, tp_group: The chunks' shard group, its replicas' group
            (None without ``extra_dp_size``) and the tensor-parallel group (None at tp 1).

    Raises:
        ValueError: A value out of range or a layout that cannot work (the message names
            it and the fix), e.g. ``tp_size * extra_dp_size`` not dividing the world size.

    Example:
        >>> plugin = GeminiPlugin(precision="bf16", max_norm=1.0)
        >>> booster = Booster(plugin=plugin)
        >>> optimizer = HybridAdam(model.parameters(), lr=1e-3)  # before boost
        >>> model, optimizer, *_ = booster.boost(model, optimizer)
    """

    SUPPORTED_PRECISIONS = ("fp16", "bf16", "fp32")
    CONTROLS_PRECISION = True

    def __init__(
        self,
        chunk_config_dict: dict | None = None,
        chunk_init_device: torch.device | None = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = False,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        precision: str = "fp16",
        master_weights: bool = True,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        search_range_m: int = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        memstats: MemStats | None = None,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        tp_size: int = 1,
        extra_dp_size: int = 1,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_sequence_parallelism: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_overlap: bool = False,
        verbose: bool = False,
        device_memory_limit: int | str | None = None,
        max_prefetch: int = 0,
        dp_group: dist.ProcessGroup | None = None,
        fp8_communication: bool = False,
        enable_async_reduce: bool = True,
    ) -> None:
        shard_options = ShardformerOptions(
            tp_size=tp_size,
            extra_dp_size=extra_dp_size,
            enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_sequence_parallelism=enable_sequence_parallelism,
            enable_jit_fused=enable_jit_fused,
            enable_sequence_overlap=enable_sequence_overlap,
        )
        if memstats is not None and not isinstance(memstats, MemStats):
            raise TypeError(
                f"GeminiPlugin: memstats must be a colossal.gemini.MemStats (from "
                f"RuntimeMemTracer) or None, got {type(memstats).__name__}"
            )
        config = GeminiConfig(
            placement_policy=placement_policy,
            precision=precision,
            enable_gradient_accumulation=bool(enable_gradient_accumulation),
            shard_param_frac=shard_param_frac,
            offload_optim_frac=offload_optim_frac,
            offload_param_frac=offload_param_frac,
            warmup_non_model_data_ratio=warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=steady_cuda_cap_ratio,
            master_weights=bool(master_weights),
            pin_memory=bool(pin_memory),
            force_outputs_fp32=bool(force_outputs_fp32),
            strict_ddp_mode=bool(strict_ddp_mode),
            search_range_m=search_range_m,
            hidden_dim=hidden_dim,
            min_chunk_size_m=min_chunk_size_m,
            gpu_margin_mem_ratio=gpu_margin_mem_ratio,
            max_norm=max_norm,
            norm_type=norm_type,
            max_prefetch=max_prefetch,
            chunk_init_device=chunk_init_device,
            scaler_config=ScalerConfig(
                initial_scale=initial_scale,
                min_scale=min_scale,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
                hysteresis=hysteresis,
                max_scale=max_scale,
            ),
        )
        if tp_size > 1 or extra_dp_size > 1:
            super().__init__(parallel_dims=_gemini_dims(tp_size, extra_dp_size, dp_group))
        else:
            super().__init__(dp_group)
        self.config = config
        self.shard_options = shard_options
        # Every group now, in one order on every rank (creating groups is collective).
        dims = self.parallel_dims
        self.tp_group = dims.group("tp") if tp_size > 1 else None
        self.zero_group = dims.group("dp_shard") if extra_dp_size > 1 else self.dp_group
        self.extra_dp_group = dims.group("dp_replicate") if extra_dp_size > 1 else None
        self.chunk_config = normalize_chunk_config(chunk_config_dict, self.zero_size)
        self.memstats = memstats
        self.device_memory_limit = device_memory_limit
        self.verbose = bool(verbose)
        self.fp8_communication = bool(fp8_communication)
        if not isinstance(enable_async_reduce, bool):
            raise TypeError(
                f"GeminiPlugin: enable_async_reduce={enable_async_reduce!r} must be True or False"
            )
        if not enable_async_reduce:
            warn_once(
                logger,
                "GeminiPlugin(enable_async_reduce=False) has no effect: GeminiDDP always "
                "reduces each chunk asynchronously and waits before the step (same results)",
            )
        self.enable_async_reduce = enable_async_reduce
        self._check_device()
        warn_if_slow_precision("GeminiPlugin", config.precision)
        if tp_size > 1:
            self._checkpoint_io = GeminiCheckpointIO(parallel_dims=dims)
        else:
            self._checkpoint_io = GeminiCheckpointIO(group=self.zero_group,
                                                     replica_group=self.extra_dp_group)

    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return self.shard_options.tp_size

    @property
    def extra_dp_size(self) -> int:
        """Replicas of the zero group (ColossalAI's extra data parallelism)."""
        return self.shard_options.extra_dp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel size: ``world / tp_size`` (``zero_size * extra_dp_size``)."""
        return self.world_size

    @property
    def zero_size(self) -> int:
        """The ranks each chunk is sharded over: ``world / (tp_size * extra_dp_size)``."""
        return self.world_size // self.extra_dp_size

    def _check_device(self) -> None:
        device = self.config.chunk_init_device
        current = get_accelerator().get_current_device()
        if device is not None and device.type not in (current.type, "cpu"):
            raise ValueError(
                f"GeminiPlugin: chunk_init_device={device} is not this job's accelerator "
                f"({current.type}) nor 'cpu'; leave it None"
            )
        if device is not None and device.type != current.type:
            logger.warning(
                "GeminiPlugin: chunks are built on %s (chunk_init_device=%s is ignored); use "
                "offload_param_frac / offload_optim_frac to keep chunks on the host",
                current, device,
            )

    def support_no_sync(self) -> bool:
        """With ``enable_gradient_accumulation`` only."""
        return self.config.enable_gradient_accumulation

    def support_lora(self) -> bool:
        """Without tensor parallelism (LoRA adapters are not split); base weights get no state."""
        return self.tp_size == 1

    def _ddp_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "process_group": self.zero_group,
            "extra_dp_group": self.extra_dp_group,
            "precision": cfg.precision,
            "chunk_config_dict": self.chunk_config,
            "search_range_m": cfg.search_range_m,
            "hidden_dim": cfg.hidden_dim,
            "min_chunk_size_m": cfg.min_chunk_size_m,
            "placement_policy": cfg.placement_policy,
            "shard_param_frac": cfg.shard_param_frac,
            "offload_optim_frac": cfg.offload_optim_frac,
            "offload_param_frac": cfg.offload_param_frac,
            "warmup_non_model_data_ratio": cfg.warmup_non_model_data_ratio,
            "steady_cuda_cap_ratio": cfg.steady_cuda_cap_ratio,
            "device_memory_limit": self.device_memory_limit,
            "memstats": self.memstats,
            "pin_memory": cfg.pin_memory and torch.cuda.is_available(),
            "force_outputs_fp32": cfg.force_outputs_fp32,
            "strict_ddp_mode": cfg.strict_ddp_mode,
            "enable_gradient_accumulation": cfg.enable_gradient_accumulation,
            "max_prefetch": cfg.max_prefetch,
            "master_weights": cfg.master_weights,
            "verbose": self.verbose,
            "fp8_communication": self.fp8_communication,
        }

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Wrap the model in ``GeminiDDP`` and the optimizer in ``GeminiOptimizer``.

        A lazily initialized model is materialized first (the optimizer is pointed at the
        real parameters). The optimizer must be built over the model's parameters and not
        have stepped yet.

        Raises:
            ValueError: The optimizer has state or holds parameters the model does not own.
        """
        materialize_model(model, optimizer)
        if optimizer is not None and optimizer.state:
            raise ValueError(
                "GeminiPlugin: boost the optimizer before its first step (its state is not "
                "empty); Gemini rebuilds it over the chunks' master shards"
            )
        if self.shard_options.uses_shardformer:
            model = self._shard(model, optimizer)
        ddp = GeminiDDP(model, **self._ddp_kwargs())
        gemini = None
        if optimizer is not None:
            gemini = GeminiOptimizer(
                optimizer,
                ddp,
                max_norm=self.config.max_norm,
                norm_type=self.config.norm_type,
                verbose=self.verbose,
                scaler_config=self.config.scaler_config,
                tp_process_group=self.tp_group,
            )
        return Boosted(ddp, gemini, criterion, dataloader, lr_scheduler)

    def _shard(self, model: nn.Module, optimizer: Optimizer | None) -> nn.Module:
        """Shardformer over the tensor-parallel group; the optimizer follows by name."""
        from colossal.shardformer import ShardConfig
        from colossal.shardformer.sequence import register_partial_grad_hooks

        shard_config = ShardConfig(tensor_parallel_process_group=self.tp_group,
                                   **self.shard_options.shard_config_kwargs())
        module, _, _ = shard_and_repoint(model, optimizer, shard_config)
        # split_gather's norms see this rank's tokens: their gradients are summed over tp as
        # autograd produces them (Gemini averages over dp only, so nothing is scaled).
        register_partial_grad_hooks(module)
        return module

    def lora_reader(self, model: nn.Module) -> CheckpointIO | None:
        """Gemini's checkpoint IO: released parameters are read through the chunks."""
        return self._checkpoint_io

    def get_checkpoint_io(self) -> CheckpointIO:
        """:class:`GeminiCheckpointIO` (chunk by chunk, the one checkpoint format)."""
        return self._checkpoint_io

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients over micro-batches (``GeminiDDP.no_sync``).

        Gemini reduces every backward into the gradient shards; with
        ``enable_gradient_accumulation`` the shards add up until the optimizer step.

        Raises:
            NotImplementedError: The plugin was built without ``enable_gradient_accumulation``.
            TypeError: ``model`` is not the model returned by ``boost``.
        """
        if not self.config.enable_gradient_accumulation:
            raise NotImplementedError(
                "GeminiPlugin.no_sync() needs GeminiPlugin(enable_gradient_accumulation=True) "
                "(without it each backward replaces the gradients)"
            )
        ddp = find_module(model, GeminiDDP)
        if ddp is None:
            raise TypeError(
                f"GeminiPlugin.no_sync needs the model returned by boost(), got "
                f"{type(model).__name__}"
            )
        return ddp.no_sync()


def _gemini_dims(
    tp_size: int, extra_dp_size: int, dp_group: dist.ProcessGroup | None
) -> ParallelDims:
    """``ParallelDims(dp=world / tp_size, tp=tp_size, dp_shard=zero)`` of the job, validated.

    The zero group (``dp_shard``) has ``world / (tp_size * extra_dp_size)`` ranks; the
    ``extra_dp_size`` replicas of it are the ``dp_replicate`` axis.

    Raises:
        RuntimeError: torch.distributed is not initialized.
        ValueError: A ``dp_group`` was given, or ``tp_size * extra_dp_size`` does not divide
            the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "GeminiPlugin needs torch.distributed initialized first: call "
            "colossal.core.launch_from_torch() (under torchrun) or launch(...)"
        )
    sizes = ", ".join(f"{n}={v}" for n, v in (("tp_size", tp_size),
                                               ("extra_dp_size", extra_dp_size)) if v > 1)
    if dp_group is not None:
        raise ValueError(
            f"GeminiPlugin({sizes}, dp_group=...): with tensor or extra data parallelism the "
            "groups come from the job's layout (dp = world / tp_size, zero = dp / "
            "extra_dp_size); leave dp_group None"
        )
    world = dist.get_world_size()
    if world % (tp_size * extra_dp_size):
        product = f"tp_size={tp_size}" if extra_dp_size == 1 else \
            f"tp_size={tp_size} x extra_dp_size={extra_dp_size} = {tp_size * extra_dp_size}"
        raise ValueError(
            f"GeminiPlugin: {product} does not divide the world size {world}; choose sizes "
            "whose product divides it (the data-parallel size is world / tp_size, the zero "
            "group world / (tp_size * extra_dp_size))"
        )
    dp = world // tp_size
    return ParallelDims(dp=dp, tp=tp_size, dp_shard=dp // extra_dp_size)
