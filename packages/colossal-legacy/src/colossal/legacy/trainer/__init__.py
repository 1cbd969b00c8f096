"""ColossalAI's ``colossalai.trainer``: ``Trainer`` and its ``hooks``."""

from colossal.legacy.trainer import hooks
from colossal.legacy.trainer.trainer import EngineLike, Trainer

__all__ = ["EngineLike", "Trainer", "hooks"]
