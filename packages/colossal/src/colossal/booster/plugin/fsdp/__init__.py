"""TorchFSDPPlugin: PyTorch FSDP2 behind the Booster, its checkpoint IO and FSDP1 arguments."""

from colossal.booster.plugin.fsdp.checkpoint_io import FSDPCheckpointIO
from colossal.booster.plugin.fsdp.compat import FSDP1Arguments
from colossal.booster.plugin.fsdp.plugin import (
    FSDPConfig,
    TorchFSDPModel,
    TorchFSDPOptimizer,
    TorchFSDPPlugin,
)

__all__ = [
    "FSDP1Arguments",
    "FSDPCheckpointIO",
    "FSDPConfig",
    "TorchFSDPModel",
    "TorchFSDPOptimizer",
    "TorchFSDPPlugin",
]
