"""HybridParallelPlugin: tensor x sequence x pipeline x data parallelism as a composition.

Nothing here re-implements a parallelism; the plugin assembles the packages:

- :class:`~colossal.core.ParallelDims` lays the ranks out (``dp`` outside ``pp``, ``sp``,
  ``tp`` by default; ``dp_outside=False`` puts ``pp`` outermost) and hands out every group;
- colossal-shardformer shards the model (``ShardConfig`` + ``ShardFormer.optimize``): tensor
  and sequence parallelism, this rank's pipeline stage, fused norms and attention;
- colossal-pipeline's stage manager and schedule (1F1B, interleaved, ZB-V) run
  :meth:`execute_pipeline`;
- colossal-zero's ``LowLevelZeroOptimizer`` keeps fp32 master weights, scales fp16 losses and
  reduces gradients over the data-parallel group (with ``dp x sp`` for the sequence modes
  with a group of their own, whose parameters see only this rank's tokens).

Gradients are combined in this order: a parameter that sees only this rank's part of the
sequence is made whole as autograd produces each gradient (before any accumulation): summed
over the tensor-parallel group (``split_gather``'s norms), or scaled by ``sp`` where ZeRO
averages over ``dp x sp`` (``all_to_all``, ``ring_attn``: the average of the scaled parts
is their sum); the data-parallel
reduction runs in ZeRO's buckets during the (last) backward; tied weights on two pipeline
stages are summed by the schedule after the backward (sums commute, so every copy ends with
the full gradient). The global gradient norm is colossal.core's over each parameter's
placements, so it counts each element once: ZeRO is told the tp and pp groups (a parameter
without a tensor-parallel record is replicated over tp, and owned by its stage along pp),
and a weight tied across stages is recorded as replicated over its stages (counted on the
first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from colossal.booster.plugin.base import Boosted, Criterion, DPPluginBase, materialize_model
from colossal.booster.plugin.fp8 import require_fp8_matmul, use_fp8_linears
from colossal.booster.plugin.hybrid.checkpoint_io import HybridCheckpointIO
from colossal.booster.plugin.hybrid.colossalai_options import check_colossalai_options
from colossal.booster.plugin.hybrid.config import HybridConfig, ShardOptions, unused_arguments
from colossal.booster.plugin.hybrid.lora import (
    HybridLoraSource,
    peft_parts,
    prefixed_aliases,
    release_unheld,
)
from colossal.booster.plugin.hybrid.model import HybridParallelModel, cast_floats, mark_tied
from colossal.booster.plugin.sharding import first_names, shard_and_repoint
from colossal.checkpoint_io import CheckpointIO
from colossal.core import (
    ModelWrapper,
    OptimizerWrapper,
    ParallelDims,
    ScalerConfig,
    get_accelerator,
    is_accumulating,
    parse_precision,
    warn_once,
)
from colossal.core.comm import group_ranks
from colossal.shardformer.policies import lora_policy
from colossal.zero import LowLevelZeroOptimizer, ZeroConfig

if TYPE_CHECKING:
    from colossal.pipeline import PipelineSchedule, PipelineStageManager, ScheduledNode
    from colossal.shardformer import PipelineGradientCheckpointConfig, Policy, ShardConfig

logger = logging.getLogger(__name__)

__all__ = ["HybridParallelPlugin"]


class HybridParallelPlugin(DPPluginBase):
    """Tensor, sequence, pipeline and data parallelism (DDP-style or ZeRO-1/2) combined.

    The data-parallel size is what the other sizes leave of the world:
    ``dp = world / (tp_size * pp_size * sp_size)``. The model must be a Hugging Face
    transformers model Shardformer has a policy for (or pass ``custom_policy``).

    Args:
        tp_size: Tensor-parallel size (1: none).
        pp_size: Pipeline stages (1: none).
        sp_size: Size of a sequence-parallel group of its own (``all_to_all`` and
            ``ring_attn`` modes); None or 1 for the modes that use the tensor-parallel group.
        precision: ``"fp16"`` (dynamic loss scaling), ``"bf16"`` or ``"fp32"``; fp16/bf16 keep
            fp32 master weights.
        zero_stage: 0, 1 or 2. Stage 2 shards gradients too and cannot run with a pipeline.
            Unlike ColossalAI, stage 0 is not torch DDP: it runs ZeRO-1's buckets as well
            (the same updates as plain data parallelism, with optimizer states sharded over
            dp, so less memory), because torch DDP can serve neither the pipeline's local
            microbatch accumulation nor one gradient norm over tp x pp. Its checkpoints are
            the one format, so they load under any plugin.
        enable_all_optimization: Fused normalization and flash attention (Shardformer).
        enable_fused_normalization: colossal-kernels' fused LayerNorm/RMSNorm.
        enable_flash_attention: colossal-kernels' attention dispatch.
        enable_jit_fused: Accepted for compatibility; no effect (Shardformer has no JIT-fused
            kernels), True warns once.
        enable_sequence_parallelism: Split the sequence (see ``sequence_parallelism_mode``).
        sequence_parallelism_mode: ``"split_gather"`` (default), ``"ring"`` (inside the
            tensor-parallel group), ``"all_to_all"`` or ``"ring_attn"`` (over ``sp_size``).
            Ignored (as in ColossalAI) while ``enable_sequence_parallelism`` is False.
        enable_sequence_overlap: Shardformer's option (needs sequence parallelism).
        parallel_output: Keep LM logits split over the vocabulary (vocab-parallel loss).
        num_microbatches: Microbatches per batch under a pipeline.
        microbatch_size: Samples per microbatch (when ``num_microbatches`` is None).
        initial_scale: fp16 loss scaler: initial scale.
        min_scale: fp16 loss scaler: smallest scale.
        growth_factor: fp16 loss scaler: growth multiplier.
        backoff_factor: fp16 loss scaler: backoff multiplier.
        growth_interval: fp16 loss scaler: clean steps between growths.
        hysteresis: fp16 loss scaler: overflows tolerated before a backoff.
        max_scale: fp16 loss scaler: largest scale.
        max_norm: Clip gradients to this global norm (0: no clipping).
        broadcast_buffers: ColossalAI's torch DDP setting; no effect (see ``zero_stage``), a
            value other than the default warns once.
        ddp_bucket_cap_mb: ColossalAI's torch DDP setting; no effect (see ``zero_stage``), a
            value other than the default warns once.
        find_unused_parameters: ColossalAI's torch DDP setting; no effect (see ``zero_stage``), a
            value other than the default warns once.
        check_reduction: ColossalAI's torch DDP setting; no effect (see ``zero_stage``), a
            value other than the default warns once.
        gradient_as_bucket_view: ColossalAI's torch DDP setting; no effect (see ``zero_stage``), a
            value other than the default warns once.
        static_graph: ColossalAI's torch DDP setting; no effect (see ``zero_stage``), a
            value other than the default warns once.
        zero_bucket_size_in_m: Gradient bucket size in millions of elements.
        cpu_offload: Keep masters and optimizer states on the CPU.
        communication_dtype: dtype gradients are reduced in (the parameters' by default).
        overlap_communication: Reduce buckets during the backward.
        custom_policy: A Shardformer ``Policy`` instance to use instead of the automatic one.
        pp_style: ``"1f1b"``, ``"interleaved"`` or ``"zbv"``.
        num_model_chunks: Model chunks per stage (``interleaved``: >= 2; ``zbv``: 2).
        num_layers_per_stage: Layers of each stage and chunk (even split when None).
        gradient_checkpoint_config: Shardformer's recompute plan per stage.
        enable_metadata_cache: Reuse the shapes of point-to-point transfers between steps.
        make_vocab_size_divisible_by: Pad the vocabulary to a multiple of this times tp.
        dp_outside: Data parallel as the outermost axis (else pipeline outermost).
        verbose: Log overflows and scale changes at INFO level.
        tensor_parallel_mode: ``"1d"`` (Megatron, default), ``"2d"`` (``tp_size`` = q*q),
            ``"2.5d"`` (``tp_size`` = ``tp_depth`` * q*q) or ``"3d"`` (``tp_size`` = q**3):
            ColossalAI's ``parallel=dict(tensor=dict(size=..., mode=..., depth=...))``. The grid
            modes shard the transformer blocks with the layers of colossal-shardformer's
            ``tp2d`` / ``tp2p5d`` / ``tp3d`` (see ``colossal.shardformer.grid``); the
            per-replica batch must divide by the grid's batch split (q, depth*q, q*q). Not
            with a pipeline or sequence parallelism.
        tp_depth: The 2.5D grid's depth (ColossalAI's ``depth``).
        fp8_communication: Reduce the data-parallel gradients and all-gather the ZeRO
            parameter slices as float8 (``LowLevelZeroOptimizer(fp8_communication=True)``;
            zero_stage 0 too, through the same buckets). Not compressed: the tensor-parallel
            and sequence-parallel collectives inside the model and the pipeline's
            point-to-point transfers (they carry activations in the training precision).
        use_fp8: ColossalAI's float8 matmuls: the model's linear layers (``nn.Linear``, GPT-2
            ``Conv1D``, Shardformer's ``Linear1D_Col``/``Row``) run forward and backward
            through :func:`colossal.kernels.fp8.linear_fp8` (``torch._scaled_mm``, e4m3
            operands, e5m2 gradients); the LM head, attention and MoE experts stay
            unquantized. Refused (``NotImplementedError`` naming what is missing) where
            ``torch._scaled_mm`` fails on the device
            (:func:`colossal.booster.plugin.fp8.require_fp8_matmul`).
        overlap_p2p: ColossalAI's asynchronous pipeline transfers: always on here (False is
            accepted and warns that it has no effect; see :mod:`.colossalai_options`).
        overlap_allgather: ZeRO's parameter all-gather overlaps the next forward
            (``LowLevelZeroOptimizer(overlap_allgather=)``; on by default: every read of a
            parameter waits for its own bucket, so it is safe).
        scheduler_nodes: ColossalAI's ZB-V node list (``pp_style="zbv"`` only,
            ``PipelineGraph(...).get_v_schedule()`` of :mod:`colossal.pipeline.v_schedule`):
            the schedule runs its order instead of generating one.
        inner_ring_size: The double ring's inner size under ``ring_attn``: must divide
            ``sp_size``; our ring attention is one ring (the same attention).

    Attributes:
        pg_mesh: The :class:`~colossal.core.ProcessGroupMesh` the groups come from (named
            axes ``dp_replicate``, ``dp_shard``, ``pp``, ``sp``, ``tp``); ``dp_axis``,
            ``pp_axis``, ``tp_axis``, ``sp_axis`` index it (ColossalAI's attributes).
        dp_group, tp_group, pp_group, sp_group: The groups the plugin trains with
            (``sp_group`` is the tp group for the modes inside it).
        zero_group: ZeRO's group (``dp`` x ``sp`` for the sp modes with their own group);
            ColossalAI's ``mixed_dp_group``.
        stage_manager: The pipeline's stage manager (None without a pipeline).

    Raises:
        ValueError: A size or combination that cannot work, naming the values.
        RuntimeError: torch.distributed is not initialized.
    """

    SUPPORTED_PRECISIONS = ("fp16", "bf16", "fp32")
    CONTROLS_PRECISION = True

    def __init__(
        self,
        tp_size: int,
        pp_size: int,
        sp_size: int | None = None,
        precision: str = "fp16",
        zero_stage: int = 0,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_parallelism: bool = False,
        sequence_parallelism_mode: str | None = None,
        enable_sequence_overlap: bool = False,
        parallel_output: bool = True,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0,
        broadcast_buffers: bool = True,
        ddp_bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        zero_bucket_size_in_m: int = 12,
        cpu_offload: bool = False,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        custom_policy: Policy | None = None,
        pp_style: str = "1f1b",
        num_model_chunks: int = 1,
        num_layers_per_stage: list[int] | None = None,
        gradient_checkpoint_config: PipelineGradientCheckpointConfig | None = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        dp_outside: bool = True,
        verbose: bool = False,
        tensor_parallel_mode: str = "1d",
        tp_depth: int = 1,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        overlap_p2p: bool = True,
        overlap_allgather: bool = True,
        scheduler_nodes: Sequence[Sequence[ScheduledNode]] | None = None,
        inner_ring_size: int | None = None,
    ) -> None:
        if use_fp8:
            require_fp8_matmul(type(self).__name__)
        self.use_fp8 = bool(use_fp8)
        if not dist.is_initialized():
            raise RuntimeError(
                "HybridParallelPlugin needs torch.distributed initialized first: call "
                "colossal.core.launch_from_torch() (under torchrun) or launch(...)"
            )
        self.config = HybridConfig(
            tp_size=tp_size,
            pp_size=pp_size,
            world_size=dist.get_world_size(),
            sp_size=sp_size,
            precision=precision,
            zero_stage=zero_stage,
            enable_sequence_parallelism=enable_sequence_parallelism,
            sequence_parallelism_mode=sequence_parallelism_mode,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            pp_style=pp_style,
            num_model_chunks=num_model_chunks,
            num_layers_per_stage=None if num_layers_per_stage is None
            else tuple(num_layers_per_stage),
            max_norm=float(max_norm),
            zero_bucket_size_in_m=zero_bucket_size_in_m,
            dp_outside=dp_outside,
            tensor_parallel_mode=tensor_parallel_mode,
            tp_depth=tp_depth,
        )
        if ddp_bucket_cap_mb <= 0:
            raise ValueError(f"HybridParallelPlugin: ddp_bucket_cap_mb={ddp_bucket_cap_mb!r} "
                             "must be > 0")
        cfg = self.config
        order = ("dp", "pp", "sp", "tp") if dp_outside else ("pp", "dp", "sp", "tp")
        dims = ParallelDims(dp=cfg.dp_size, pp=pp_size, tp=tp_size, sp=cfg.resolved_sp_size,
                            order=order, tp_mode=cfg.grid_tp_mode, tp_depth=tp_depth)
        super().__init__(parallel_dims=dims)
        # Every group now, in one order on every rank (creating groups is collective).
        self.tp_group = dims.group("tp")
        self.pp_group = dims.group("pp")
        self.sp_group = dims.group("sp") if cfg.sp_group_of_its_own else self.tp_group
        self.zero_group = dims.group(("dp", "sp")) if cfg.sp_group_of_its_own else self.dp_group
        self.stage_manager = self._stage_manager(dims) if pp_size > 1 else None
        self.custom_policy = custom_policy
        self.shard_options = ShardOptions(
            enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_jit_fused=enable_jit_fused,
            enable_sequence_overlap=enable_sequence_overlap,
            parallel_output=parallel_output,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            gradient_checkpoint_config=gradient_checkpoint_config,
        )
        self.enable_metadata_cache = enable_metadata_cache
        self.zero_config = ZeroConfig(
            partition_grad=zero_stage == 2,
            clip_grad_norm=float(max_norm),
            reduce_bucket_size=int(zero_bucket_size_in_m * 1024**2),
            communication_dtype=communication_dtype,
            overlap_communication=overlap_communication,
            cpu_offload=cpu_offload,
            fp8_communication=bool(fp8_communication),
        )
        self.scaler_config = ScalerConfig(
            initial_scale=initial_scale, min_scale=min_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval,
            hysteresis=hysteresis, max_scale=max_scale,
        )
        self.verbose = verbose
        check_colossalai_options(
            cfg, logger, overlap_p2p=overlap_p2p, overlap_allgather=overlap_allgather,
            scheduler_nodes=scheduler_nodes, inner_ring_size=inner_ring_size,
        )
        self.overlap_p2p = overlap_p2p
        self.overlap_allgather = overlap_allgather
        self.scheduler_nodes = scheduler_nodes
        self.inner_ring_size = inner_ring_size
        unused = unused_arguments(
            {"broadcast_buffers": broadcast_buffers, "ddp_bucket_cap_mb": ddp_bucket_cap_mb,
             "find_unused_parameters": find_unused_parameters,
             "check_reduction": check_reduction,
             "gradient_as_bucket_view": gradient_as_bucket_view, "static_graph": static_graph},
            enable_jit_fused,
        )
        if unused:
            warn_once(logger, f"HybridParallelPlugin: {', '.join(unused)} has no effect here: "
                      "gradients are reduced in ZeRO's buckets (not torch DDP) and Shardformer "
                      "has no JIT-fused kernels; leave them at their defaults")
        self.schedule: PipelineSchedule | None = None
        replica = dims.coordinate(("dp", "sp") if cfg.sp_group_of_its_own else "dp") == 0
        self._checkpoint_io = HybridCheckpointIO(replica, (tp_size, pp_size),
                                                 self.pp_group if pp_size > 1 else None)
        if zero_stage == 0 and dims.dp > 1:
            logger.info("zero_stage=0: gradients are reduced through ZeRO-1's buckets")

    # ---- layout ------------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        """Tensor-parallel size."""
        return self.config.tp_size

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return self.config.pp_size

    @property
    def sp_size(self) -> int:
        """Ranks the sequence is split over (the tensor-parallel group for its modes)."""
        if not self.config.enable_sequence_parallelism:
            return 1
        return self.config.resolved_sp_size if self.config.sp_group_of_its_own else self.tp_size

    @property
    def dp_size(self) -> int:
        """Data-parallel size."""
        return self.config.dp_size

    @property
    def precision(self) -> str:
        """The training precision (``"fp16"``, ``"bf16"`` or ``"fp32"``)."""
        return self.config.precision

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage (0, 1 or 2)."""
        return self.config.zero_stage

    @property
    def max_norm(self) -> float:
        """The gradient clipping norm (0: none)."""
        return self.config.max_norm

    @property
    def enable_sequence_parallelism(self) -> bool:
        """Whether the sequence is split."""
        return self.config.enable_sequence_parallelism

    @property
    def sequence_parallelism_mode(self) -> str | None:
        """The sequence-parallel mode (None when the sequence is not split)."""
        return self.config.sequence_parallelism_mode

    @property
    def mixed_dp_group(self) -> dist.ProcessGroup:
        """ColossalAI's name of :attr:`zero_group` (dp x sp for the sp modes with a group)."""
        return self.zero_group

    def _mesh_axis(self, name: str) -> int | tuple[int, ...]:
        axes = self.parallel_dims.mesh_axes
        if name == "dp":  # dp_replicate is 1 here: dp is the dp_shard axis
            return axes.index("dp_shard")
        if name == "tp" and "tp" not in axes:  # a grid tp mode: its axes together
            return tuple(i for i, a in enumerate(axes) if a.startswith("tp_"))
        return axes.index(name)

    @property
    def dp_axis(self) -> int | tuple[int, ...]:
        """Index of the data-parallel axis in :attr:`pg_mesh`."""
        return self._mesh_axis("dp")

    @property
    def pp_axis(self) -> int | tuple[int, ...]:
        """Index of the pipeline axis in :attr:`pg_mesh`."""
        return self._mesh_axis("pp")

    @property
    def tp_axis(self) -> int | tuple[int, ...]:
        """Index of the tensor-parallel axis in :attr:`pg_mesh` (the grid's axes in 2D/3D)."""
        return self._mesh_axis("tp")

    @property
    def sp_axis(self) -> int | tuple[int, ...]:
        """Index of the sequence-parallel axis in :attr:`pg_mesh` (1 rank for the tp modes)."""
        return self._mesh_axis("sp")

    @property
    def shard_config(self) -> ShardConfig:
        """The Shardformer settings :meth:`configure` shards the model with."""
        from colossal.shardformer import ShardConfig

        cfg = self.config
        return ShardConfig(
            tensor_parallel_process_group=self.tp_group,
            sequence_parallel_process_group=self.sp_group if cfg.sp_group_of_its_own else None,
            pipeline_stage_manager=self.stage_manager,
            enable_tensor_parallelism=self.tp_size > 1,
            enable_sequence_parallelism=cfg.enable_sequence_parallelism,
            sequence_parallelism_mode=cfg.sequence_parallelism_mode,
            tensor_parallel_mode=cfg.tensor_parallel_mode,
            tensor_parallel_depth=cfg.tp_depth,
            parallel_dims=self.parallel_dims if cfg.grid_tp_mode is not None else None,
            **self.shard_options.shard_config_kwargs(),
        )

    def _stage_manager(self, dims: ParallelDims) -> PipelineStageManager:
        from colossal.pipeline import PipelineStageManager

        cfg = self.config
        return PipelineStageManager(
            dims.build_mesh(),
            "pp",
            enable_interleave=cfg.pp_style == "interleaved",
            num_model_chunks=cfg.num_model_chunks,
            use_zbv=cfg.pp_style == "zbv",
            num_layers_per_stage=cfg.num_layers_per_stage,
        )

    def _schedule(
        self,
        stage_manager: PipelineStageManager,
        shared: Sequence[Mapping[int, torch.Tensor | None]],
    ) -> PipelineSchedule:
        from colossal.pipeline import (
            InterleavedSchedule,
            OneForwardOneBackwardSchedule,
            ZeroBubbleVPipeScheduler,
        )

        cfg = self.config
        microbatches = cfg.num_microbatches
        microbatch_size = None if cfg.num_microbatches else cfg.microbatch_size
        cache = self.enable_metadata_cache
        if cfg.pp_style == "interleaved":
            return InterleavedSchedule(
                stage_manager,
                cfg.num_model_chunks,
                num_microbatches=microbatches,
                microbatch_size=microbatch_size,
                enable_metadata_cache=cache,
                shared_params=shared,
            )
        if cfg.pp_style == "zbv":
            return ZeroBubbleVPipeScheduler(
                stage_manager,
                2,
                num_microbatches=microbatches,
                microbatch_size=microbatch_size,
                enable_metadata_cache=cache,
                shared_params=shared,
                schedule=self.scheduler_nodes or None,
            )
        return OneForwardOneBackwardSchedule(
            stage_manager,
            num_microbatches=microbatches,
            microbatch_size=microbatch_size,
            enable_metadata_cache=cache,
            shared_params=shared,
        )

    # ---- plugin interface --------------------------------------------------------------------

    def support_no_sync(self) -> bool:
        """ZeRO stage 0 and 1 (stage 2 keeps no local gradients)."""
        return self.config.zero_stage < 2

    def support_pipeline(self) -> bool:
        """True when ``pp_size > 1``."""
        return self.pp_size > 1

    def support_lora(self) -> bool:
        """True; frozen base weights get no optimizer state.

        Any tensor, pipeline and ZeRO layout; sequence parallelism only with ``tp_size == 1``
        (see :mod:`.lora` and :mod:`colossal.shardformer.policies.lora`).
        """
        return not self._lora_refusal()

    def enable_lora(self, model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        """Add peft LoRA adapters (see ``Booster.enable_lora``).

        Raises:
            NotImplementedError: Sequence parallelism with ``tp_size > 1``.
        """
        self._check_lora()
        return super().enable_lora(model, *args, **kwargs)

    def _lora_refusal(self) -> str:
        if self.config.grid_tp_mode is not None:
            return (
                f"HybridParallelPlugin(tensor_parallel_mode={self.config.tensor_parallel_mode!r}) "
                "does not support LoRA: the adapters have no grid layers. Use "
                "tensor_parallel_mode='1d'"
            )
        if self.tp_size > 1 and self.config.enable_sequence_parallelism:
            return (
                f"HybridParallelPlugin(tp_size={self.tp_size}, enable_sequence_parallelism=True) "
                "does not support LoRA: the adapters do not follow the sequence split. Turn "
                "sequence parallelism off, or use tp_size=1"
            )
        return ""

    def _check_lora(self) -> None:
        refusal = self._lora_refusal()
        if refusal:
            raise NotImplementedError(refusal)

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Criterion | None = None,
        dataloader: DataLoader | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Shard the model, build the schedule, wrap the optimizer in ``LowLevelZeroOptimizer``."""
        materialize_model(model, optimizer)
        dtype = self.precision_dtype
        model = model.to(device=get_accelerator().get_current_device(), dtype=dtype)
        shard_config = self.shard_config
        inner, peft_model, prefix = peft_parts(model)
        policy = self.custom_policy
        if peft_model is not None:
            self._check_lora()
            policy = self._lora_policy(inner, policy)
        module = self._shard_stage(inner, optimizer, shard_config, policy, prefix)
        if self.use_fp8:
            use_fp8_linears(module)
        self._sum_partial_grads(module)
        zero = None
        if optimizer is not None:
            names = first_names(optimizer, module)
            zero = LowLevelZeroOptimizer(
                optimizer, **dataclasses.asdict(self.zero_config),
                overlap_allgather=self.overlap_allgather,
                dp_process_group=self.zero_group,
                tp_process_group=self.tp_group if self.tp_size > 1 else None,
                pp_process_group=self.pp_group if self.pp_size > 1 else None,
                scaler_config=self.scaler_config, verbose=self.verbose,
            )
            zero.set_param_names(names)
            self._checkpoint_io.optimizers.append(zero)
        wrapped = HybridParallelModel(module, dtype, pipelined=self.stage_manager is not None)
        if peft_model is not None:
            wrapped.lora_source = self._lora_source(peft_model, module, prefix)
        return Boosted(wrapped, zero, criterion, dataloader, lr_scheduler)

    def _shard_stage(
        self,
        inner: nn.Module,
        optimizer: Optimizer | None,
        shard_config: ShardConfig,
        policy: Policy | None,
        prefix: str,
    ) -> nn.Module:
        """Shardformer's split of ``inner`` and this rank's stage (the optimizer repointed).

        Also records the checkpoint aliases and, under a pipeline, the schedule and its tied
        weights.
        """
        module, shared, aliases = shard_and_repoint(inner, optimizer, shard_config, policy)
        self._checkpoint_io.set_aliases(prefixed_aliases(aliases, prefix))
        if self.stage_manager is not None:
            self.schedule = self._schedule(self.stage_manager, shared)
            mark_tied(self.schedule.shared_params.pairs())
        return module

    @property
    def precision_dtype(self) -> torch.dtype:
        """The dtype parameters are cast to."""
        return parse_precision(self.config.precision).dtype

    def _lora_policy(self, inner: nn.Module, policy: Policy | None) -> Policy | None:
        """The policy splitting LoRA adapters with their base layers (``tp_size > 1``)."""
        if self.tp_size == 1:
            return policy
        from colossal.shardformer.policies import get_autopolicy

        return lora_policy(get_autopolicy(inner) if policy is None else policy, self.tp_group)

    def _lora_source(
        self, peft_model: nn.Module, module: nn.Module, prefix: str
    ) -> HybridLoraSource:
        """The adapter saver of a boosted ``PeftModel`` (other stages' weights released)."""
        chunks = list(module) if isinstance(module, nn.ModuleList) else [module]
        release_unheld(peft_model, chunks)
        return HybridLoraSource(peft_model, chunks, prefix,
                                self.pp_group if self.pp_size > 1 else None)

    def _sum_partial_grads(self, module: nn.Module) -> None:
        """Hooks making sequence-partial gradients whole before ZeRO averages them.

        Summed over the tensor-parallel group (``split_gather``); scaled by ``sp`` where
        ZeRO averages over ``dp x sp`` (the average of the scaled parts is their sum).
        """
        from colossal.shardformer.sequence import register_partial_grad_hooks

        zero_ranks = set(group_ranks(self.zero_group))
        register_partial_grad_hooks(module, averaged=lambda ranks: set(ranks) <= zero_ranks)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Criterion,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One batch through the pipeline schedule: forward, loss, backward of every microbatch.

        ``criterion(outputs, microbatch)`` runs on the last stage; each rank draws one batch
        from ``data_iter`` (floating tensors are cast to the training precision). Under
        ``torch.no_grad()`` (evaluation) only the forwards run and ``optimizer`` may be None.

        Returns:
            ``{"loss": ..., "outputs": ...}`` (None on ranks without the last stage).

        Raises:
            RuntimeError: ``pp_size == 1`` (call the model and ``booster.backward``).
            TypeError: ``model`` is not the model returned by ``boost``.
        """
        if self.schedule is None:
            raise RuntimeError(
                "execute_pipeline needs pp_size > 1 and a model boosted by this plugin; with "
                "pp_size=1 call the model and booster.backward(loss, optimizer)"
            )
        if not isinstance(model, ModelWrapper):
            raise TypeError(
                f"execute_pipeline needs the model returned by boost(), got {type(model).__name__}"
            )
        dtype = self.precision_dtype
        batches = (cast_floats(batch, dtype) for batch in data_iter)
        # Under no_sync, tied weights are summed over the stages in the call that reduces.
        accumulating = is_accumulating(optimizer)
        return self.schedule.forward_backward_step(
            model.unwrap(), batches, criterion, optimizer=optimizer,
            return_loss=return_loss, return_outputs=return_outputs,
            sync_shared_params=not accumulating,
        )

    def get_checkpoint_io(self) -> CheckpointIO:
        """The one checkpoint format for every layout (see :mod:`.checkpoint_io`)."""
        return self._checkpoint_io

    def no_sync(
        self, model: nn.Module | None, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without reducing them (ZeRO stage 0/1).

        Raises:
            NotImplementedError: Under ZeRO stage 2.
            TypeError: No boosted optimizer given.
        """
        if self.config.zero_stage == 2:
            raise NotImplementedError(
                "HybridParallelPlugin(zero_stage=2) does not support no_sync(); use "
                "zero_stage=1 or call booster.backward for every micro-batch"
            )
        if not isinstance(optimizer, LowLevelZeroOptimizer):
            raise TypeError("no_sync needs the optimizer returned by boost()")
        return optimizer.no_sync()

