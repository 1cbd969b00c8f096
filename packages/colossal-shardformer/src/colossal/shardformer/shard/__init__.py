"""ShardConfig, ShardFormer and the sharder that applies a policy."""

from colossal.shardformer.shard.config import SEQUENCE_PARALLELISM_MODES, ShardConfig
from colossal.shardformer.shard.model_hooks import (
    install_vocab_parallel_loss,
    set_attention_implementation,
    tied_parameters,
)
from colossal.shardformer.shard.sharder import ShardSummary, apply_module_policy
from colossal.shardformer.shard.shardformer import ShardFormer

__all__ = [
    "SEQUENCE_PARALLELISM_MODES",
    "ShardConfig",
    "ShardFormer",
    "ShardSummary",
    "apply_module_policy",
    "install_vocab_parallel_loss",
    "set_attention_implementation",
    "tied_parameters",
]
