"""colossal-legacy: ColossalAI's config-era API on Colossal's packages.

``launch(config=...)`` reads a config and builds a :class:`~colossal.core.ParallelDims` that
``gpc`` (``colossal.legacy.core.global_context``) answers questions about; ``initialize``
turns the config into Colossal's pieces (DDP or ZeRO, mixed precision, gradient
accumulation, clipping, pipeline schedules) and returns an ``Engine``; ``Trainer`` runs it
with hooks.
"""

from colossal.legacy.__about__ import __version__
from colossal.legacy.amp import AMP_TYPE, convert_to_amp
from colossal.legacy.config import Config
from colossal.legacy.context import ParallelMode
from colossal.legacy.core import global_context
from colossal.legacy.engine import Engine
from colossal.legacy.initialize import initialize
from colossal.legacy.launch import (
    get_default_parser,
    init_context,
    launch,
    launch_from_openmpi,
    launch_from_slurm,
    launch_from_torch,
)
from colossal.legacy.trainer import Trainer, hooks

__all__ = [
    "AMP_TYPE",
    "Config",
    "Engine",
    "ParallelMode",
    "Trainer",
    "__version__",
    "convert_to_amp",
    "global_context",
    "hooks",
    "get_default_parser",
    "init_context",
    "initialize",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]
