"""ZeROGradientHandler: nothing to do, the ZeRO optimizer reduces its own gradients."""

from __future__ import annotations

from colossal.legacy.engine.gradient_handler.base import BaseGradientHandler
from colossal.legacy.registry import GRADIENT_HANDLER

__all__ = ["ZeROGradientHandler"]


@GRADIENT_HANDLER.register_module
class ZeROGradientHandler(BaseGradientHandler):
    """The handler of a ZeRO job: a no-op.

    :class:`colossal.zero.LowLevelZeroOptimizer` reduce-scatters (stage 2) or all-reduces
    (stage 1) the gradients in its own backward hooks and step, so there is nothing left
    to synchronize. ``initialize`` uses it when the config has ``zero=dict(...)`` and no
    ``gradient_handler``.
    """

    def handle_gradient(self) -> None:
        """Nothing: the ZeRO optimizer has reduced the gradients already."""
