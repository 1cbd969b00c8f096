"""Optimizers of ColossalAI's ``colossalai.nn.optimizer`` that the config-era tutorials use."""

from colossal.legacy.nn.optimizer.lamb import Lamb

__all__ = ["Lamb"]
