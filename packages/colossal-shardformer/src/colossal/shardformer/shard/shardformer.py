"""``ShardFormer``: shards a model in place with a policy (ColossalAI's entry point)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from colossal.shardformer.policies.base_policy import Policy
from colossal.shardformer.shard.config import ShardConfig
from colossal.shardformer.shard.model_hooks import set_attention_implementation
from colossal.shardformer.shard.sharder import ShardSummary, apply_module_policy

__all__ = ["ShardFormer"]

logger = logging.getLogger(__name__)


def _local_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class ShardFormer:
    """Applies tensor parallelism and the optional fused kernels to a model.

    Example::

        shard_config = ShardConfig(tensor_parallel_process_group=tp_group)
        model, shared_params = ShardFormer(shard_config).optimize(model)

    Args:
        shard_config: The sharding options.

    Raises:
        TypeError: ``shard_config`` is not a :class:`ShardConfig`.
    """

    def __init__(self, shard_config: ShardConfig) -> None:
        if not isinstance(shard_config, ShardConfig):
            raise TypeError(f"ShardFormer needs a ShardConfig, got {type(shard_config).__name__}")
        self.shard_config = shard_config
        self.summary: ShardSummary | None = None

    def optimize(
        self, model: nn.Module, policy: Policy | None = None
    ) -> tuple[nn.Module, Sequence[Mapping[int, torch.Tensor | None]]]:
        """Shard ``model`` in place.

        Order: the policy's ``config_sanity_check``; with a pipeline stage manager, the
        split into this rank's stage (one model chunk per ``num_model_chunks``; layers of
        other stages are dropped before anything is sharded); then for every chunk the
        policy's ``preprocess``, its module policy (parallel layers, divided attributes,
        tensor-parallel regions) when tensor parallelism is on, ``postprocess``
        (vocab-parallel loss and the like), sequence parallelism, fused norms, the Colossal
        attention implementation, and gradient checkpointing when asked for.

        Args:
            model: The model (modified in place).
            policy: A policy instance; None picks one with ``get_autopolicy(model)``.

        Returns:
            ``(model, shared_params)``. With a pipeline stage manager holding several model
            chunks per stage, ``model`` is an ``nn.ModuleList`` of the chunks (in chunk
            order). ``shared_params`` lists parameters shared between pipeline stages as
            ``{stage: parameter}`` (empty without pipeline parallelism).

        Raises:
            TypeError: ``model`` is not an ``nn.Module`` or ``policy`` not a ``Policy``.
            NotImplementedError: No policy supports ``model``'s class.
            ValueError: The model's shape cannot be split over the parallel sizes.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"optimize needs an nn.Module, got {type(model).__name__}")
        if policy is None:
            from colossal.shardformer.policies.auto_policy import get_autopolicy

            policy = get_autopolicy(model)
        elif not isinstance(policy, Policy):
            raise TypeError(f"policy must be a Policy instance (e.g. MyPolicy()), got {policy!r}")
        config = self.shard_config
        policy.set_model(model)
        policy.set_shard_config(config)
        policy.config_sanity_check()
        chunks: list[nn.Module] = [model]
        shared: Sequence[Mapping[int, torch.Tensor | None]] = []
        if config.pipeline_stage_manager is not None:
            from colossal.shardformer.pipeline import split_into_stages

            chunks, shared = split_into_stages(model, policy, config)
        chunks = [self._shard_chunk(chunk, policy, i) for i, chunk in enumerate(chunks)]
        if config.pipeline_stage_manager is None:
            shared = policy.get_shared_params()
        result = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        return result, shared

    def _apply_grid(self, model: nn.Module, policy: Policy) -> ShardSummary:
        """The 2D / 2.5D / 3D modes: the policy's grid plan applied with the mode's layers."""
        from colossal.shardformer.grid import apply_grid_parallelism, grid_mode

        dims = self.shard_config.grid_dims()
        return apply_grid_parallelism(model, policy.grid_plan(), grid_mode(dims), dims.group("tp"))

    def _shard_chunk(self, model: nn.Module, policy: Policy, chunk_id: int) -> nn.Module:
        """Apply everything but the pipeline split to one model chunk."""
        config = self.shard_config
        policy.set_model(model)
        model = policy.preprocess()
        before = _local_numel(model)
        tp = config.enable_tensor_parallelism and dist.is_initialized()
        grid = tp and config.is_grid_mode
        if grid:
            self.summary = self._apply_grid(model, policy)
        elif tp:
            self.summary = apply_module_policy(
                model, policy.module_policy(), config.tensor_parallel_process_group
            )
        elif config.enable_tensor_parallelism:
            logger.info(
                "torch.distributed is not initialized: %s is not split", type(model).__name__
            )
        if not grid:  # the 1D postprocess installs vocab-parallel losses; grid heads are whole
            model = policy.postprocess()
        if config.enable_sequence_parallelism:
            from colossal.shardformer.sequence import apply_sequence_parallelism

            apply_sequence_parallelism(model, config, policy)
        if config.enable_fused_normalization:
            from colossal.shardformer.norm import replace_norms

            replace_norms(model)
        if config.enable_flash_attention and config.sequence_parallel_group_kind != "attention":
            from colossal.shardformer.attention import register_attention

            set_attention_implementation(model, register_attention())
        if config.gradient_checkpoint_config is not None:
            from colossal.shardformer.shard.grad_ckpt import apply_gradient_checkpointing

            apply_gradient_checkpointing(model, config, chunk_id)
        if self.summary is not None:
            logger.info(
                "%s sharded with %s over %d ranks: %d modules replaced, %d attributes set, "
                "%d tensor-parallel regions, %d sharded parameters; local parameters %d -> %d",
                type(model).__name__,
                type(policy).__name__,
                config.tensor_parallel_size,
                len(self.summary.replaced),
                len(self.summary.attributes),
                len(self.summary.tp_regions),
                len(self.summary.sharded_params),
                before,
                _local_numel(model),
            )
        return model
