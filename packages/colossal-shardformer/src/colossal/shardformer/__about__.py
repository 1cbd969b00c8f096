"""Version of colossal-shardformer (read by hatchling)."""

__version__ = "0.1.0"
