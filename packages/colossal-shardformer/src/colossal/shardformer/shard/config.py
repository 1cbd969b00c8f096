"""``ShardConfig``: the sharding options, with ColossalAI's argument names and defaults."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["SEQUENCE_PARALLELISM_MODES", "ShardConfig"]

logger = logging.getLogger(__name__)

SEQUENCE_PARALLELISM_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
"""Values ``sequence_parallelism_mode`` accepts (with ``enable_sequence_parallelism``)."""

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
        pipeline_stage_manager: Pipeline stage manager (not supported yet: must be None).
        enable_tensor_parallelism: Split layers over ``tensor_parallel_process_group``.
        enable_fused_normalization: Swap LayerNorm/RMSNorm for colossal-kernels' fused norms.
        enable_flash_attention: Route attention through colossal-kernels' ``attention``
            dispatch (registered with transformers' ``AttentionInterface`` as ``"colossal"``).
        enable_jit_fused: Accepted for ColossalAI compatibility; a no-op (the fused paths
            come from colossal-kernels, nothing is JIT-scripted).
        enable_sequence_parallelism: Not supported yet (the next release): must be False.
        sequence_parallelism_mode: One of ``SEQUENCE_PARALLELISM_MODES``, only together with
            ``enable_sequence_parallelism``.
        enable_sequence_overlap: Overlap sequence-parallel communication (needs sequence
            parallelism).
        parallel_output: Keep the LM head's logits split over the vocabulary (the loss is
            computed vocab-parallel); False gathers them to full ``(..., vocab)`` logits.
        make_vocab_size_divisible_by: The vocabulary is padded to a multiple of this times
            the tensor-parallel size.
        gradient_checkpoint_config: Accepted for ColossalAI compatibility; must be None (use
            the model's ``gradient_checkpointing_enable()``).
        enable_all_optimization: Turn on fused normalization, flash attention and JIT fusion.

    Raises:
        TypeError: An option of the wrong type.
        ValueError: An invalid value or combination.
        NotImplementedError: Sequence parallelism or a pipeline stage manager (next release).
    """

    tensor_parallel_process_group: Any = None
    pipeline_stage_manager: Any = None
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
        group = self.tensor_parallel_process_group
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                "ShardConfig.tensor_parallel_process_group must be a torch.distributed "
                f"ProcessGroup or None (the whole job), got {type(group).__name__}"
            )
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
        if self.enable_sequence_parallelism:
            raise NotImplementedError(
                "sequence parallelism is not supported by colossal-shardformer yet (planned "
                "for the next release); set enable_sequence_parallelism=False"
            )
        if self.pipeline_stage_manager is not None:
            raise NotImplementedError(
                "pipeline parallelism inside ShardFormer is not supported yet (planned for "
                "the next release); pass pipeline_stage_manager=None"
            )
        if self.gradient_checkpoint_config is not None:
            raise NotImplementedError(
                "gradient_checkpoint_config is not supported; call "
                "model.gradient_checkpointing_enable() on the Hugging Face model instead"
            )
        if self.enable_all_optimization:
            self.enable_fused_normalization = True
            self.enable_flash_attention = True
            self.enable_jit_fused = True
        if self.enable_jit_fused:
            logger.debug("enable_jit_fused is a no-op: fused paths come from colossal-kernels")

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
