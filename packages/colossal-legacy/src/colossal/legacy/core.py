"""ColossalAI's ``colossalai.core``: ``from colossal.legacy.core import global_context as gpc``."""

from colossal.legacy.context.parallel_context import global_context

gpc = global_context

__all__ = ["global_context", "gpc"]
