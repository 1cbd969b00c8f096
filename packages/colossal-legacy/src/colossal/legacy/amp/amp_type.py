"""AMP_TYPE: the mixed-precision modes a config's ``fp16=dict(mode=...)`` names."""

from __future__ import annotations

from enum import Enum

__all__ = ["AMP_TYPE", "SUPPORTED_AMP_MODES", "parse_amp_mode"]


class AMP_TYPE(str, Enum):  # noqa: N801 - ColossalAI's public name
    """A mixed-precision mode (ColossalAI's ``colossalai.amp.AMP_TYPE``).

    ``TORCH``: the forward under ``torch.autocast`` in fp16, fp32 weights and a dynamic loss
    scaler (torch's ``GradScaler`` arguments). ``NAIVE``: the model in fp16, fp32 master
    weights in the optimizer, a dynamic loss scaler with hysteresis. ``APEX``: NVIDIA apex;
    not supported (refused with the supported list).
    """

    APEX = "apex"
    TORCH = "torch"
    NAIVE = "naive"


SUPPORTED_AMP_MODES = (AMP_TYPE.TORCH, AMP_TYPE.NAIVE)

_APEX_REFUSED = (
    "AMP_TYPE.APEX (NVIDIA apex) is not supported by colossal-legacy; the supported modes are "
    "AMP_TYPE.TORCH ('torch': autocast + dynamic loss scaling, what apex O1 does) and "
    "AMP_TYPE.NAIVE ('naive': fp16 model + fp32 master weights, what apex O2 does)"
)


def parse_amp_mode(mode: object) -> AMP_TYPE:
    """The :class:`AMP_TYPE` named by ``mode`` (an AMP_TYPE or its value, any case).

    Raises:
        ValueError: ``mode`` is APEX (refused) or names no mode; the message lists the
            supported modes.
    """
    try:
        parsed = AMP_TYPE(mode.lower() if isinstance(mode, str) else mode)
    except ValueError:
        raise ValueError(
            f"fp16 mode {mode!r} is not an AMP_TYPE; the supported modes are AMP_TYPE.TORCH "
            "('torch') and AMP_TYPE.NAIVE ('naive')"
        ) from None
    if parsed is AMP_TYPE.APEX:
        raise ValueError(_APEX_REFUSED)
    return parsed
