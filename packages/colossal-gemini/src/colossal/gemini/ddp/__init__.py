"""GeminiDDP: hooks that gather, release and reduce a model's chunks around forward/backward."""

from colossal.gemini.ddp.gemini_ddp import GeminiDDP, TrainableShard

__all__ = ["GeminiDDP", "TrainableShard"]
