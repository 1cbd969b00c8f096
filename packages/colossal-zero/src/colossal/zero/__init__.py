"""colossal-zero: ZeRO stage 1/2 optimizer that drops into any DDP training script."""

from colossal.zero.__about__ import __version__
from colossal.zero.config import ZeroConfig
from colossal.zero.memory import MemoryReport
from colossal.zero.moe import MoeLowLevelZeroOptimizer, is_expert_param
from colossal.zero.moe_state import moe_sharded_params, moe_sharded_state_dict
from colossal.zero.optimizer import LowLevelZeroOptimizer
from colossal.zero.state_dict import StateRef, sharded_params, sharded_state_dict

__all__ = [
    "LowLevelZeroOptimizer",
    "MemoryReport",
    "MoeLowLevelZeroOptimizer",
    "StateRef",
    "ZeroConfig",
    "__version__",
    "is_expert_param",
    "moe_sharded_params",
    "moe_sharded_state_dict",
    "sharded_params",
    "sharded_state_dict",
]
