"""Training utilities under ColossalAI's ``colossalai.nn`` names.

Only :mod:`colossal.nn.lr_scheduler` lives here for now: the learning-rate schedulers that
ColossalAI scripts import (``from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR``
becomes ``from colossal.nn.lr_scheduler import CosineAnnealingWarmupLR``).
"""

from __future__ import annotations

from colossal.nn import lr_scheduler

__all__ = ["lr_scheduler"]
