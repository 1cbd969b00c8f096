"""``ShardConfig``: the sharding options, with ColossalAI's argument names and defaults."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims

if TYPE_CHECKING:
    from colossal.shardformer.pipeline.manager import StageManagerLike

__all__ = [
    "GRID_TENSOR_PARALLEL_MODES",
    "SEQUENCE_PARALLELISM_MODES",
    "TENSOR_PARALLEL_MODES",
    "TP_SEQUENCE_MODES",
    "ShardConfig",
]

logger = logging.getLogger(__name__)

SEQUENCE_PARALLELISM_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
"""Values ``sequence_parallelism_mode`` accepts (with ``enable_sequence_parallelism``)."""

TENSOR_PARALLEL_MODES = ("1d", "2d", "2.5d", "3d")
"""Values ``tensor_parallel_mode`` accepts (None means ``"1d"``)."""

GRID_TENSOR_PARALLEL_MODES = ("2d", "2.5d", "3d")
"""Tensor-parallel modes that arrange the ranks in a grid (``colossal.shardformer.grid``)."""

TP_SEQUENCE_MODES = ("split_gather", "ring")
"""Sequence-parallel modes that split the sequence inside the tensor-parallel group."""

_STAGE_MANAGER_ATTRS = ("num_stages", "stage", "num_model_chunks", "layout", "distribute_layers")

_BOOL_FIELDS = (
    "enable_tensor_parallelism",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_jit_fused",
    "enable_sequence_parallelism",
    "enable_sequence_overlap",
    "parallel_output",
    "enable_all_optimization",
)


@dataclass
class ShardConfig:
    """How :class:`ShardFormer` shards a model.

    Attributes:
        tensor_parallel_process_group: The tensor-parallel group (None: the whole job).
        pipeline_stage_manager: A pipeline stage manager (``colossal.pipeline.
            PipelineStageManager`` or any object with its attributes): the model keeps only
            this stage's layers (see :mod:`colossal.shardformer.pipeline`).
        enable_tensor_parallelism: Split layers over ``tensor_parallel_process_group``.
        enable_fused_normalization: Swap LayerNorm/RMSNorm for colossal-kernels' fused norms.
        enable_flash_attention: Route attention through colossal-kernels' ``attention``
            dispatch (registered with transformers' ``AttentionInterface`` as ``"colossal"``).
        enable_jit_fused: Accepted for ColossalAI compatibility; a no-op (the fused paths
            come from colossal-kernels, nothing is JIT-scripted).
        enable_sequence_parallelism: Split the sequence over ranks (see
            :mod:`colossal.shardformer.sequence`).
        sequence_parallelism_mode: One of ``SEQUENCE_PARALLELISM_MODES``, only together with
            ``enable_sequence_parallelism`` (default then ``"split_gather"``). ``"split_gather"``
            and ``"ring"`` run inside the tensor-parallel group (``"ring"`` is served by
            ``"split_gather"``); ``"all_to_all"`` (Ulysses) and ``"ring_attn"`` run on
            ``sequence_parallel_process_group``.
        sequence_parallel_process_group: The group of ``"all_to_all"`` / ``"ring_attn"``
            (None: the whole job). Ignored by ``"split_gather"``, which uses the tensor-parallel
            group.
        enable_sequence_overlap: Overlap sequence-parallel communication (needs sequence
            parallelism).
        parallel_output: Keep the LM head's logits split over the vocabulary (the loss is
            computed vocab-parallel) and, for a causal LM in the ``"all_to_all"`` /
            ``"ring_attn"`` modes, over the sequence (the head and loss run on this rank's
            tokens; logits ``(batch, seq / P, ...)`` in layout order); False gathers them to
            full ``(batch, seq, vocab)`` logits.
        make_vocab_size_divisible_by: The vocabulary is padded to a multiple of this times
            the tensor-parallel size.
        gradient_checkpoint_config: Recompute a number of layers per stage in the backward;
            an object with ColossalAI's ``get_num_ckpt_layers(stage, num_stages,
            num_model_chunks, model_chunk_id=0)`` (e.g. ``PipelineGradientCheckpointConfig``).
        enable_all_optimization: Turn on fused normalization, flash attention and JIT fusion.
        tensor_parallel_mode: ``"1d"`` (Megatron, the default; None means it), ``"2d"``
            (SUMMA on a q x q grid), ``"2.5d"`` (Tesseract, ``tensor_parallel_depth`` layers of
            a q x q grid) or ``"3d"`` (a q x q x q cube). The grid modes split every transformer
            block's activation on the batch and the hidden dim (2D: ``[B/q, S, H/q]``) with the
            layers of ``colossal.shardformer.layer.tp2d`` / ``tp2p5d`` / ``tp3d``, through the
            policy's ``grid_plan()``; embeddings, final norm and heads stay replicated (see
            :mod:`colossal.shardformer.grid`). Not with pipeline or sequence parallelism.
        tensor_parallel_depth: The 2.5D grid's depth ``d`` (ColossalAI's ``depth``; 1 for the
            other modes).
        parallel_dims: The job's :class:`~colossal.core.ParallelDims` whose ``tp`` axis is the
            grid (its ``tp_mode`` and ``tp_depth`` must match). None: the grid spans
            ``tensor_parallel_process_group``, which must then be the whole job; pass it when
            the grid is part of a larger layout (data parallelism around it).

    Raises:
        TypeError: An option of the wrong type.
        ValueError: An invalid value or combination.
    """

    tensor_parallel_process_group: Any = None
    sequence_parallel_process_group: Any = None
    pipeline_stage_manager: StageManagerLike | None = None
    enable_tensor_parallelism: bool = True
    enable_fused_normalization: bool = False
    enable_flash_attention: bool = False
    enable_jit_fused: bool = False
    enable_sequence_parallelism: bool = False
    sequence_parallelism_mode: str | None = None
    enable_sequence_overlap: bool = False
    parallel_output: bool = True
    make_vocab_size_divisible_by: int = 64
    gradient_checkpoint_config: Any = None
    enable_all_optimization: bool = False
    tensor_parallel_mode: str | None = None
    tensor_parallel_depth: int = 1
    parallel_dims: ParallelDims | None = None

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"ShardConfig.{name} must be a bool, got {value!r}")
        m = self.make_vocab_size_divisible_by
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(
                f"ShardConfig.make_vocab_size_divisible_by must be an int >= 1, got {m!r}"
            )
        for name in ("tensor_parallel_process_group", "sequence_parallel_process_group"):
            group = getattr(self, name)
            if group is not None and not isinstance(group, dist.ProcessGroup):
                raise TypeError(
                    f"ShardConfig.{name} must be a torch.distributed ProcessGroup or None (the "
                    f"whole job), got {type(group).__name__}"
                )
        self._check_sequence_parallelism()
        self._check_pipeline()
        self._check_tensor_parallel_mode()
        if self.enable_all_optimization:
            self.enable_fused_normalization = True
            self.enable_flash_attention = True
            self.enable_jit_fused = True
        if self.enable_jit_fused:
            logger.debug("enable_jit_fused is a no-op: fused paths come from colossal-kernels")

    def _check_sequence_parallelism(self) -> None:
        mode = self.sequence_parallelism_mode
        if mode is not None and mode not in SEQUENCE_PARALLELISM_MODES:
            raise ValueError(
                f"ShardConfig.sequence_parallelism_mode={mode!r} is not one of "
                f"{SEQUENCE_PARALLELISM_MODES} (or None)"
            )
        if mode is not None and not self.enable_sequence_parallelism:
            raise ValueError(
                f"ShardConfig.sequence_parallelism_mode={mode!r} needs "
                "enable_sequence_parallelism=True (or leave the mode None)"
            )
        if self.enable_sequence_overlap and not self.enable_sequence_parallelism:
            raise ValueError(
                "ShardConfig.enable_sequence_overlap needs enable_sequence_parallelism=True"
            )
        if not self.enable_sequence_parallelism:
            return
        if mode is None:
            self.sequence_parallelism_mode = mode = "split_gather"
        if mode == "ring":
            logger.info(
                "sequence_parallelism_mode='ring' runs as 'split_gather': on gloo the ring-"
                "overlapped all-gather brings nothing over one all-gather"
            )
        if mode in TP_SEQUENCE_MODES and not self.enable_tensor_parallelism:
            raise ValueError(
                f"sequence_parallelism_mode={mode!r} splits the sequence inside the "
                "tensor-parallel group: set enable_tensor_parallelism=True, or use "
                "'all_to_all' / 'ring_attn' for sequence parallelism without it"
            )

    def _check_pipeline(self) -> None:
        manager = self.pipeline_stage_manager
        if manager is not None:
            missing = [a for a in _STAGE_MANAGER_ATTRS if not hasattr(manager, a)]
            if missing:
                raise TypeError(
                    "ShardConfig.pipeline_stage_manager must be a colossal.pipeline."
                    f"PipelineStageManager; {type(manager).__name__} lacks {missing}"
                )
        ckpt = self.gradient_checkpoint_config
        if ckpt is not None and not callable(getattr(ckpt, "get_num_ckpt_layers", None)):
            raise TypeError(
                "ShardConfig.gradient_checkpoint_config must provide get_num_ckpt_layers(stage, "
                "num_stages, num_model_chunks, model_chunk_id=0) (use colossal.shardformer."
                f"PipelineGradientCheckpointConfig), got {type(ckpt).__name__}"
            )

    def _check_tensor_parallel_mode(self) -> None:
        mode, depth = self.tensor_parallel_mode, self.tensor_parallel_depth
        if mode is not None and mode not in TENSOR_PARALLEL_MODES:
            raise ValueError(
                f"ShardConfig.tensor_parallel_mode={mode!r} is not one of "
                f"{TENSOR_PARALLEL_MODES} (or None for '1d')"
            )
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(
                f"ShardConfig.tensor_parallel_depth must be an int >= 1, got {depth!r}"
            )
        if depth != 1 and mode != "2.5d":
            raise ValueError(
                f"ShardConfig.tensor_parallel_depth={depth} applies to tensor_parallel_mode="
                f"'2.5d' only (got {mode!r}); leave it at 1"
            )
        dims = self.parallel_dims
        if dims is not None and not isinstance(dims, ParallelDims):
            raise TypeError(
                "ShardConfig.parallel_dims must be a colossal.core.ParallelDims or None, got "
                f"{type(dims).__name__}"
            )
        if mode not in GRID_TENSOR_PARALLEL_MODES:
            return
        if dims is not None and (dims.tp_mode, dims.tp_depth) != (mode, depth):
            raise ValueError(
                f"ShardConfig.parallel_dims has tp_mode={dims.tp_mode!r}, tp_depth="
                f"{dims.tp_depth}, but tensor_parallel_mode={mode!r}, tensor_parallel_depth="
                f"{depth}; build ParallelDims(tp=..., tp_mode={mode!r}"
                + (f", tp_depth={depth})" if mode == "2.5d" else ")")
            )
        for what, on in (
            ("enable_sequence_parallelism=True", self.enable_sequence_parallelism),
            ("a pipeline_stage_manager", self.pipeline_stage_manager is not None),
            ("a gradient_checkpoint_config", self.gradient_checkpoint_config is not None),
        ):
            if on:
                raise ValueError(
                    f"ShardConfig(tensor_parallel_mode={mode!r}) does not support {what} yet; "
                    "use tensor_parallel_mode='1d' for it"
                )
        if dims is not None and dist.is_initialized():
            if self.tensor_parallel_process_group is None:
                self.tensor_parallel_process_group = dims.group("tp")
            elif dist.get_world_size(self.tensor_parallel_process_group) != dims.tp:
                raise ValueError(
                    "ShardConfig.tensor_parallel_process_group has "
                    f"{dist.get_world_size(self.tensor_parallel_process_group)} ranks but "
                    f"parallel_dims.tp={dims.tp}; pass parallel_dims.group('tp') (or leave the "
                    "group None)"
                )

    @property
    def is_grid_mode(self) -> bool:
        """Whether ``tensor_parallel_mode`` is a grid mode (``"2d"``, ``"2.5d"``, ``"3d"``)."""
        return self.tensor_parallel_mode in GRID_TENSOR_PARALLEL_MODES

    def grid_dims(self) -> ParallelDims:
        """The :class:`~colossal.core.ParallelDims` of the grid (built once when not given).

        Without ``parallel_dims`` the grid spans ``tensor_parallel_process_group``, which must
        then be the whole job.

        Raises:
            ValueError: Not a grid mode, or the group is not the whole job and no
                ``parallel_dims`` was given, or the group's size does not fit the mode.
        """
        if not self.is_grid_mode:
            raise ValueError(
                f"tensor_parallel_mode={self.tensor_parallel_mode!r} is not a grid mode"
            )
        if self.parallel_dims is None:
            world = dist.get_world_size()
            tp = self.tensor_parallel_size
            if tp != world:
                raise ValueError(
                    f"ShardConfig(tensor_parallel_mode={self.tensor_parallel_mode!r}): the "
                    f"tensor-parallel group has {tp} of the {world} ranks; pass parallel_dims="
                    f"ParallelDims(dp=..., tp={tp}, tp_mode={self.tensor_parallel_mode!r}) "
                    "so the grid's rows, columns and depth are groups of that layout"
                )
            self.parallel_dims = ParallelDims(
                tp=tp, tp_mode=self.tensor_parallel_mode, tp_depth=self.tensor_parallel_depth
            )
        return self.parallel_dims

    @property
    def sequence_parallel_group(self) -> ProcessGroup | None:
        """The group the sequence is split over (None: sequence parallelism is off).

        ``"split_gather"`` / ``"ring"``: the tensor-parallel group; ``"all_to_all"`` /
        ``"ring_attn"``: ``sequence_parallel_process_group`` (``dist.group.WORLD`` when None).
        """
        if not self.enable_sequence_parallelism:
            return None
        if self.sequence_parallelism_mode in TP_SEQUENCE_MODES:
            group = self.tensor_parallel_process_group
        else:
            group = self.sequence_parallel_process_group
        return dist.group.WORLD if group is None else group

    @property
    def sequence_parallel_group_kind(self) -> str | None:
        """``"tensor"`` (split_gather, ring), ``"attention"`` (all_to_all, ring_attn) or None.

        In the ``"attention"`` modes the sequence-parallel attention implementation replaces
        the model's attention (and ``enable_flash_attention``'s).
        """
        if not self.enable_sequence_parallelism:
            return None
        return "tensor" if self.sequence_parallelism_mode in TP_SEQUENCE_MODES else "attention"

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks the sequence is split over (1 when sequence parallelism is off)."""
        if not self.enable_sequence_parallelism or not dist.is_initialized():
            return 1
        return dist.get_world_size(self.sequence_parallel_group)

    @property
    def sequence_parallel_rank(self) -> int:
        """This process's rank in the sequence-parallel group (0 when it is off)."""
        if not self.enable_sequence_parallelism or not dist.is_initialized():
            return 0
        return dist.get_rank(self.sequence_parallel_group)

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks in the tensor-parallel group (1 when torch.distributed is not initialized)."""
        if not dist.is_initialized():
            return 1
        return dist.get_world_size(self.tensor_parallel_process_group)

    @property
    def tensor_parallel_rank(self) -> int:
        """This process's rank in the tensor-parallel group (0 without torch.distributed)."""
        if not dist.is_initialized():
            return 0
        return dist.get_rank(self.tensor_parallel_process_group)
