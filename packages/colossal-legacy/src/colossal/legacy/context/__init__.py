"""The config-era context: ``Config``, ``ParallelMode`` and the global ``gpc``."""

from colossal.legacy.config import Config
from colossal.legacy.context.initializer import GroupInfo, ProcessGroupInitializer, new_groups
from colossal.legacy.context.parallel_config import ParallelSettings, parse_parallel
from colossal.legacy.context.parallel_context import ParallelContext, global_context
from colossal.legacy.context.parallel_mode import ParallelMode

__all__ = [
    "Config",
    "GroupInfo",
    "ParallelContext",
    "ParallelMode",
    "ParallelSettings",
    "ProcessGroupInitializer",
    "global_context",
    "new_groups",
    "parse_parallel",
]
