"""Torch's fused Adam/AdamW kernel for ZeRO's flat master shards, when the user left it unset.

ZeRO hands the wrapped optimizer a few large flat shards instead of many parameters. Torch's
default single-tensor Adam path allocates shard-sized temporaries on every step (several times
slower than the fused kernel on a large shard: colossal-zero's CHANGELOG), so a step on half the
parameters cost as much as DDP's step on all of them. When a group leaves both ``fused`` and
``foreach`` unset (torch's ``None``), its step runs with ``fused=True``: same update up to
rounding, no temporaries. The group's settings are switched only for the duration of the step,
so state dicts and checkpoints keep what the user chose; ``fused=False`` keeps the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

FUSED_CAPABLE: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose ``fused`` kernel is used when the user did not choose an implementation."""


def _eligible(group: dict[str, Any]) -> bool:
    if group.get("fused") is not None or group.get("foreach") is not None:
        return False
    if group.get("differentiable") or group.get("capturable"):
        return False
    supported = _get_fused_kernels_supported_devices()
    return all(
        p.device.type in supported and torch.is_floating_point(p) for p in group["params"]
    )


@contextlib.contextmanager
def fused_when_unset(optimizer: Optimizer) -> Iterator[None]:
    """Within the block, groups of ``optimizer`` that left the implementation unset use fused.

    Args:
        optimizer: The optimizer about to step (any type; only Adam and AdamW change).
    """
    if not isinstance(optimizer, FUSED_CAPABLE):
        yield
        return
    chosen = [g for g in optimizer.param_groups if _eligible(g)]
    for group in chosen:
        group["fused"] = True
        for p in group["params"]:  # the fused kernel keeps its step count on the param's device
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device != p.device:
                optimizer.state[p]["step"] = step.to(p.device)
    try:
        yield
    finally:
        for group in chosen:
            group["fused"] = None
