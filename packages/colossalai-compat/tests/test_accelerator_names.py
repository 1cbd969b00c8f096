"""colossalai.accelerator and colossalai.utils.get_current_device through the compat package."""

from __future__ import annotations

import torch
from colossalai.accelerator import BaseAccelerator, get_accelerator
from colossalai.utils import get_current_device

import colossal.core.accelerator as ours


def test_accelerator_is_ours_with_colossalai_methods() -> None:
    """Catches: the compat path serving another class, a ColossalAI method missing on the
    accelerator a script gets, get_current_device disagreeing with the accelerator."""
    acc = get_accelerator()
    assert BaseAccelerator is ours.BaseAccelerator and isinstance(acc, ours.BaseAccelerator)
    assert get_current_device() == acc.get_current_device()
    acc.reset_max_memory_allocated()
    acc.reset_max_memory_cached()
    assert acc.max_memory_allocated() >= acc.memory_allocated() > 0
    acc.manual_seed(3)
    state = acc.get_rng_state()
    first = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(2), first)
    acc.empty_cache()
    acc.synchronize()
