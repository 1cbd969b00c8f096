"""ColossalAI's config-era ``colossalai.utils``: ranks, devices, data, timers, checkpoints."""

from colossal.legacy.context.random import moe_set_seed
from colossal.legacy.utils.checkpointing import (
    TRAINING_STATE_FILE,
    load_checkpoint,
    read_training_state,
    save_checkpoint,
)
from colossal.legacy.utils.common import (
    get_current_device,
    is_dp_rank_0,
    is_no_pp_or_last_stage,
    is_tp_rank_0,
    is_using_ddp,
    is_using_pp,
    is_using_sequence,
    print_rank_0,
)
from colossal.legacy.utils.data import get_dataloader
from colossal.legacy.utils.memory import memory_usage, report_memory_usage
from colossal.legacy.utils.timer import MultiTimer, Timer

__all__ = [
    "TRAINING_STATE_FILE",
    "MultiTimer",
    "Timer",
    "get_current_device",
    "get_dataloader",
    "is_dp_rank_0",
    "is_no_pp_or_last_stage",
    "is_tp_rank_0",
    "is_using_ddp",
    "is_using_pp",
    "is_using_sequence",
    "load_checkpoint",
    "memory_usage",
    "moe_set_seed",
    "print_rank_0",
    "read_training_state",
    "report_memory_usage",
    "save_checkpoint",
]
