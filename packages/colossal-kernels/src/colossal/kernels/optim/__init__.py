"""Adam optimizers: CPUAdam, FusedAdam, HybridAdam."""

from colossal.kernels.optim._functional import AdamHyper, torch_adam_step
from colossal.kernels.optim.cpu_adam import CPUAdam
from colossal.kernels.optim.fused_adam import FusedAdam
from colossal.kernels.optim.hybrid_adam import HybridAdam

__all__ = ["AdamHyper", "CPUAdam", "FusedAdam", "HybridAdam", "torch_adam_step"]
