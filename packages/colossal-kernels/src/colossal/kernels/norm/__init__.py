"""Fused LayerNorm and RMSNorm: functions, modules and a model-wide swap."""

from colossal.kernels.norm.functional import fused_layer_norm, fused_rms_norm
from colossal.kernels.norm.modules import FusedLayerNorm, FusedRMSNorm, replace_norms

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "fused_layer_norm", "fused_rms_norm", "replace_norms"]
