"""colossal-shardformer: tensor parallelism for Hugging Face transformers 5.x models."""

from colossal.shardformer.__about__ import __version__

__all__ = ["__version__"]
