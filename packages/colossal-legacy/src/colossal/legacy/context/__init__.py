"""The config-era context: ``Config``, ``ParallelMode`` and the global ``gpc``."""

from colossal.legacy.config import Config
from colossal.legacy.context.initializer import GroupInfo, ProcessGroupInitializer, new_groups
from colossal.legacy.context.moe_context import MOE_CONTEXT, MoeContext, moe_env
from colossal.legacy.context.parallel_config import ParallelSettings, parse_parallel
from colossal.legacy.context.parallel_context import ParallelContext, global_context
from colossal.legacy.context.parallel_mode import ParallelMode
from colossal.legacy.context.random import moe_set_seed

__all__ = [
    "MOE_CONTEXT",
    "Config",
    "GroupInfo",
    "MoeContext",
    "ParallelContext",
    "ParallelMode",
    "ParallelSettings",
    "ProcessGroupInitializer",
    "global_context",
    "moe_env",
    "moe_set_seed",
    "new_groups",
    "parse_parallel",
]
