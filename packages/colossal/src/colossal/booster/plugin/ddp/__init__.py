"""TorchDDPPlugin: PyTorch DDP behind the Booster."""

from colossal.booster.plugin.ddp.plugin import DDPConfig, TorchDDPModel, TorchDDPPlugin

__all__ = [
    "DDPConfig",
    "TorchDDPModel",
    "TorchDDPPlugin",
]
