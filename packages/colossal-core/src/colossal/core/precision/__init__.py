"""Mixed precision: the precision parser and the dynamic loss scaler."""

from colossal.core.precision.dtype import Precision, parse_precision
from colossal.core.precision.scaler import (
    DynamicGradScaler,
    ScalerConfig,
    agree_overflow,
    local_overflow,
    scaler_config_from,
)

__all__ = [
    "DynamicGradScaler",
    "Precision",
    "ScalerConfig",
    "agree_overflow",
    "local_overflow",
    "parse_precision",
    "scaler_config_from",
]
