"""Where every trainable parameter lives: buckets of a flat buffer, each split over the ranks.

Parameters of one optimizer param group are packed, in the order their gradients are expected
(reverse registration order), into *buckets* of about ``reduce_bucket_size`` elements. Each
bucket is a contiguous region of its group's flat buffer, padded to a multiple of the
data-parallel size ``W``; rank ``r`` owns the ``r``-th of ``W`` equal slices of every bucket.

This one layout serves every step of ZeRO without rearranging data:

* gradients are copied into a bucket at the parameter's offset and the bucket is
  reduce-scattered (stage 2) or all-reduced (stage 1) as it stands;
* each rank's master weights and optimizer states are its bucket slices;
* after the step each bucket is all-gathered in place, and working parameters are views into
  the flat buffer, so they are up to date with no copy.

Buckets are numbered in one global order shared by every rank, and their collectives are
issued strictly in that order, so ranks never disagree about which collective comes next.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its group's flat buffer.

    Attributes:
        param: The working parameter.
        index: Position of the parameter in the original optimizer (over all groups).
        offset: First element of the parameter in the group's flat buffer.
        numel: Number of elements.
    """

    param: torch.Tensor
    index: int
    offset: int
    numel: int

    @property
    def end(self) -> int:
        """One past the last element in the flat buffer."""
        return self.offset + self.numel


@dataclass
class Bucket:
    """A contiguous, padded region of one group's flat buffer, reduced as one collective.

    Attributes:
        order: Position in the global order of collectives.
        group: Index of the optimizer param group.
        start: First element in the group's flat buffer.
        size: Padded number of elements (a multiple of the world size).
        slots: The parameters it holds.
        shard_offset: Where this bucket's slice starts in the rank's master buffer of the group.
    """

    order: int
    group: int
    start: int
    size: int
    slots: list[ParamSlot] = field(default_factory=list)
    shard_offset: int = 0

    def shard_size(self, world_size: int) -> int:
        """Elements of each rank's slice."""
        return self.size // world_size

    def shard_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s slice in the group's flat buffer."""
        n = self.shard_size(world_size)
        return self.start + rank * n, self.start + (rank + 1) * n

    def slot_shard_range(self, slot: ParamSlot, rank: int, world_size: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of ``slot``'s flattened parameter that ``rank`` owns.

        A parameter may straddle rank slices; ``start == stop`` when ``rank`` owns none of it.

        Args:
            slot: One of this bucket's parameters.
            rank: Data-parallel rank.
            world_size: Data-parallel size.
        """
        lo, hi = self.shard_range(rank, world_size)
        start = min(max(lo, slot.offset), slot.end) - slot.offset
        stop = max(min(hi, slot.end), slot.offset) - slot.offset
        return start, max(start, stop)

    @property
    def used(self) -> int:
        """Elements occupied by parameters (the rest is padding)."""
        return sum(s.numel for s in self.slots)


@dataclass
class GroupLayout:
    """The flat buffer plan of one optimizer param group."""

    index: int
    buckets: list[Bucket] = field(default_factory=list)
    numel: int = 0

    @property
    def slots(self) -> list[ParamSlot]:
        """Every parameter of the group, in flat-buffer order."""
        return [s for b in self.buckets for s in b.slots]


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_layout(
    groups: Sequence[Sequence[tuple[int, torch.Tensor]]],
    world_size: int,
    bucket_size: int,
) -> tuple[list[GroupLayout], list[Bucket]]:
    """Pack the trainable parameters of each group into buckets.

    Args:
        groups: Per param group, ``(original index, parameter)`` pairs in registration order.
        world_size: Data-parallel size; every bucket is padded to a multiple of it.
        bucket_size: Target elements per bucket (a larger parameter gets a bucket of its own).

    Returns:
        The per-group layouts and every bucket in the global collective order.
    """
    layouts = [GroupLayout(index=g) for g in range(len(groups))]
    open_buckets: dict[int, list[tuple[int, torch.Tensor]]] = {}
    order: list[tuple[int, list[tuple[int, torch.Tensor]]]] = []

    # Walk all parameters in the order gradients usually arrive (reverse registration),
    # filling one open bucket per group; a bucket joins the global order when it closes.
    flat = [(g, idx, p) for g, members in enumerate(groups) for idx, p in members]
    for g, idx, p in reversed(flat):
        members = open_buckets.setdefault(g, [])
        members.append((idx, p))
        if sum(q.numel() for _, q in members) >= bucket_size:
            order.append((g, open_buckets.pop(g)))
    for g in sorted(open_buckets):
        order.append((g, open_buckets.pop(g)))

    buckets = []
    for position, (g, members) in enumerate(order):
        layout = layouts[g]
        bucket = Bucket(order=position, group=g, start=layout.numel, size=0)
        offset = layout.numel
        for idx, p in members:
            bucket.slots.append(ParamSlot(p, idx, offset, p.numel()))
            offset += p.numel()
        bucket.size = _pad(max(offset - layout.numel, 1), world_size)
        bucket.shard_offset = sum(b.shard_size(world_size) for b in layout.buckets)
        layout.buckets.append(bucket)
        layout.numel += bucket.size
        buckets.append(bucket)
    return layouts, buckets
