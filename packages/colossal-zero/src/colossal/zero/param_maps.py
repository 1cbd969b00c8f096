"""ColossalAI's per-parameter view of a ZeRO optimizer: masters, padding, full gradients.

ColossalAI's ``LowLevelZeroOptimizer`` pads each parameter to a multiple of the group size and
gives rank ``r`` the ``r``-th chunk of it as its master; its users and tests ask for
``working_to_master_param`` / ``master_to_working_param`` (dicts keyed by ``id``),
``get_param_padding_size`` and ``get_param_grad``. Colossal packs parameters into buckets
(:mod:`colossal.zero.layout`): a rank's master is its slice of a bucket, so a parameter's
master here is the 1-D view of the elements of it that this rank holds (its
:meth:`~colossal.zero.layout.Bucket.slot_shard_range`, possibly empty), and the padding is
what the layout adds after the parameter (non-zero only for a bucket's last parameter).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from colossal.core.comm import all_gather
from colossal.zero.layout import Bucket, ParamSlot

if TYPE_CHECKING:
    from colossal.zero.optimizer import LowLevelZeroOptimizer

__all__ = ["MasterMaps", "full_param_grad", "find_slot", "padding_after"]


class MasterMaps:
    """``working_to_master_param`` and ``master_to_working_param`` of one optimizer.

    The master views are made once, so ``master_to_working[id(working_to_master[id(p)])]``
    is ``p`` (ColossalAI's tests walk the maps that way). They are views into the optimizer's
    master buffers: a step updates them, writing into them writes the masters.

    Attributes:
        working_to_master: ``id(working parameter)`` -> this rank's master elements (1-D).
        master_to_working: ``id(master view)`` -> the working parameter.
    """

    def __init__(self, optimizer: LowLevelZeroOptimizer) -> None:
        self.working_to_master: dict[int, torch.Tensor] = {}
        self.master_to_working: dict[int, torch.Tensor] = {}
        rank, world = optimizer.rank, optimizer.world_size
        for bucket, master in zip(optimizer.buckets, optimizer.masters, strict=True):
            lo, _ = bucket.shard_range(rank, world)
            for slot in bucket.slots:
                start, stop = bucket.slot_shard_range(slot, rank, world)
                begin = slot.offset + start - lo
                view = master[begin : begin + stop - start] if stop > start else master[:0]
                self.working_to_master[id(slot.param)] = view
                self.master_to_working[id(view)] = slot.param


def find_slot(optimizer: LowLevelZeroOptimizer, param: torch.Tensor) -> tuple[Bucket, ParamSlot]:
    """The bucket and slot of a working parameter.

    Raises:
        ValueError: ``param`` is not one of the optimizer's trainable parameters.
    """
    for bucket in optimizer.buckets:
        for slot in bucket.slots:
            if slot.param is param:
                return bucket, slot
    raise ValueError(
        f"a parameter of shape {tuple(param.shape)} is not trained by this "
        "LowLevelZeroOptimizer: pass one of the model's parameters given to its optimizer "
        "(with requires_grad=True)"
    )


def padding_after(bucket: Bucket, slot: ParamSlot) -> int:
    """Zero elements the layout adds after ``slot`` (its bucket's padding, if it is last)."""
    return bucket.size - bucket.used if slot is bucket.slots[-1] else 0


def full_param_grad(optimizer: LowLevelZeroOptimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The whole averaged gradient of ``param`` (collective over the data-parallel group).

    The gradient summed over the group divided by the optimizer's ``grad_divisor`` (the mean,
    as DDP) and unscaled (fp16), in the parameter's dtype: what ``param.grad`` would be under
    DDP. None when no backward ran since the last step (on this rank; every rank is expected
    to agree, as they run the same backwards).

    Raises:
        ValueError: ``param`` is not trained by ``optimizer``.
    """
    bucket, slot = find_slot(optimizer, param)
    if not any(optimizer.reducer.has_grads(b) for b in optimizer.buckets):
        return None
    optimizer.reducer.ensure_reduced()
    shard = optimizer.reducer.shard_grad(bucket).detach().clone()
    whole = torch.empty(
        shard.numel() * optimizer.world_size, dtype=shard.dtype, device=shard.device
    )
    all_gather(whole, shard, group=optimizer.dp_group)
    begin = slot.offset - bucket.start
    grad = whole[begin : begin + slot.numel].view(param.shape)
    return (grad.float() / (optimizer.grad_divisor * optimizer.loss_scale)).to(param.dtype)
