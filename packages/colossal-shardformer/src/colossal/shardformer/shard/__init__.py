"""ShardConfig, ShardFormer and the sharder that applies a policy."""
