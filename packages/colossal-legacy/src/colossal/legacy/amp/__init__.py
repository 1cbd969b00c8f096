"""Mixed precision of the config-era API (ColossalAI's ``colossalai.amp``).

``fp16=dict(mode=AMP_TYPE.TORCH | AMP_TYPE.NAIVE, ...)`` in the config, or
:func:`convert_to_amp` alone. ``AMP_TYPE.APEX`` is refused with the supported modes.
"""

from colossal.legacy.amp.amp_type import AMP_TYPE, SUPPORTED_AMP_MODES, parse_amp_mode
from colossal.legacy.amp.convert import AMP_CONFIG_KEYS, check_amp_config, convert_to_amp
from colossal.legacy.amp.naive_amp import NaiveAMPModel, NaiveAMPOptimizer, convert_to_naive_amp
from colossal.legacy.amp.torch_amp import (
    TorchAMPLoss,
    TorchAMPModel,
    TorchAMPOptimizer,
    convert_to_torch_amp,
)

__all__ = [
    "AMP_CONFIG_KEYS",
    "AMP_TYPE",
    "NaiveAMPModel",
    "NaiveAMPOptimizer",
    "SUPPORTED_AMP_MODES",
    "TorchAMPLoss",
    "TorchAMPModel",
    "TorchAMPOptimizer",
    "check_amp_config",
    "convert_to_amp",
    "convert_to_naive_amp",
    "convert_to_torch_amp",
    "parse_amp_mode",
]
