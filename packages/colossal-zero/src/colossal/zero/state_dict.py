"""World-size-agnostic optimizer state: gather slices into full per-parameter tensors and back."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import StateDict

from colossal.core import FlatRange, Placed, Placement, ShardedTensor, whole_shape
from colossal.core.comm import all_gather, broadcast, recv, send
from colossal.zero.layout import Bucket, ParamSlot
from colossal.zero.placements import slice_placements

if TYPE_CHECKING:
    from colossal.zero.optimizer import LowLevelZeroOptimizer

MASTER_KEY = "master_param"

__all__ = [
    "MASTER_KEY",
    "StateRef",
    "gather_param_state",
    "gather_state_dict",
    "scatter_state_dict",
    "sharded_params",
    "sharded_state_dict",
]


class StateRef(Placed):
    """One parameter's sharded optimizer state: a :class:`colossal.core.ShardedTensor`.

    :func:`sharded_state_dict` puts these where :func:`gather_state_dict` puts full tensors;
    :meth:`gather` (or :func:`gather_param_state`) turns one into the full tensor when (and
    where) it is needed. Its placements are the parameter's own (a tensor-parallel block, a
    pipeline stage, ...) followed by this rank's :class:`~colossal.core.FlatRange` of the
    parameter's local tensor along the data-parallel axis: the elements of its bucket slice.

    Args:
        bucket: The bucket holding the parameter.
        slot: The parameter's place in the bucket.
        name: The state's name (``"exp_avg"``, ``"master_param"``, ...).
        shard: This rank's slice of the whole bucket's state.
        optimizer: The optimizer whose state it is.
    """

    def __init__(self, bucket: Bucket, slot: ParamSlot, name: str, shard: torch.Tensor,
                 optimizer: LowLevelZeroOptimizer) -> None:
        self.bucket, self.slot, self.name, self.shard = bucket, slot, name, shard
        self.optimizer = optimizer
        self._placements = slice_placements(bucket, slot, optimizer.rank, optimizer.world_size,
                                            optimizer.dp_group, optimizer._implied)

    @property
    def shape(self) -> torch.Size:
        """Shape of the whole state (the whole parameter's shape)."""
        return whole_shape(self.slot.param)

    @property
    def dtype(self) -> torch.dtype:
        """The state's dtype."""
        return self.shard.dtype

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The parameter's placements, then this rank's flat range along ``"dp"``."""
        return self._placements

    @property
    def flat(self) -> FlatRange:
        """The elements of the flattened local parameter this rank holds (may be empty)."""
        part = self._placements[-1].part
        assert isinstance(part, FlatRange)
        return part

    def local(self) -> torch.Tensor:
        """This rank's elements of the state (1-D, a view into the bucket's shard)."""
        opt = self.optimizer
        lo, _ = self.bucket.shard_range(opt.rank, opt.world_size)
        flat = self.flat
        at = self.slot.offset + flat.start - lo
        return self.shard[at : at + flat.numel]

    def gather_inner(self, leader: int | None) -> torch.Tensor | None:
        """The parameter's local state (CPU) on global rank ``leader``, over the bucket's group.

        Raises:
            ValueError: ``leader`` is not in the optimizer's data-parallel group.
        """
        ranks = list(self.optimizer._dp_ranks)
        if leader is not None and leader not in ranks:
            raise ValueError(
                f"dst={leader} is not a rank of the optimizer's data-parallel group {ranks}"
            )
        return gather_param_state(
            self.optimizer, self, None if leader is None else ranks.index(leader)
        )

    def __repr__(self) -> str:
        return (f"StateRef({self.name!r}, index={self.slot.index}, shape={tuple(self.shape)}, "
                f"placements={list(self._placements)})")


def _is_sharded(value: Any, shard_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard_numel


def _shards(opt: LowLevelZeroOptimizer, bucket: Bucket, master: torch.Tensor) -> list[Any]:
    """``(name, value, sharded)`` of every state of ``bucket``'s master, sorted by name."""
    entries = dict(opt.optim.state.get(master, {}))
    if not opt._master_is_view:
        entries[MASTER_KEY] = master
    n = bucket.shard_size(opt.world_size)
    return [(k, v, _is_sharded(v, n)) for k, v in sorted(entries.items())]


def _param_groups(opt: LowLevelZeroOptimizer) -> list[dict[str, Any]]:
    groups = []
    start = 0
    for group, layout in zip(opt.optim.param_groups, opt.layouts, strict=True):
        count = _group_param_count(opt, layout.index)
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    return groups


def sharded_state_dict(opt: LowLevelZeroOptimizer) -> StateDict:
    """:func:`gather_state_dict` without communication: sharded states stay :class:`StateRef`.

    Same keys and order as :func:`gather_state_dict`; every tensor that would be gathered is
    a :class:`StateRef` instead, so a checkpoint writer can gather each one (collectively,
    with :func:`gather_param_state`) only when the rank that writes it needs it.
    """
    opt.gatherer.wait_all()
    state: dict[int, dict[str, Any]] = {}
    for bucket, master in zip(opt.buckets, opt.masters, strict=True):
        for name, value, sharded in _shards(opt, bucket, master):
            for slot in bucket.slots:
                entry = (
                    StateRef(bucket, slot, name, value, opt) if sharded else copy.deepcopy(value)
                )
                state.setdefault(slot.index, {})[name] = entry
    return {
        "state": state,
        "param_groups": _param_groups(opt),
        "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "zero": {"stage": opt.config.stage, "precision": opt.precision.value},
    }


def gather_param_state(opt: LowLevelZeroOptimizer, ref: StateRef, dst: int | None = None
                       ) -> torch.Tensor | None:
    """The full, unpadded CPU tensor of one parameter's state (collective over the group).

    Moves only that parameter's elements: a broadcast from the one rank holding them, or an
    all-gather padded to the largest rank's part when the parameter straddles ranks. With
    ``dst`` (a rank of the optimizer's group, counted within it), only that rank receives the
    state: the ranks holding parts send them to it point to point, and the others get
    ``None`` (nothing is allocated or moved for them).
    """
    bucket, slot, world = ref.bucket, ref.slot, opt.world_size
    spans = [bucket.slot_shard_range(slot, r, world) for r in range(world)]
    lengths = [stop - start for start, stop in spans]
    lo, _ = bucket.shard_range(opt.rank, world)
    start, stop = spans[opt.rank]
    mine = ref.shard[slot.offset + start - lo : slot.offset + stop - lo].to(opt.device)
    owners = [r for r, n in enumerate(lengths) if n]
    if dst is not None and not 0 <= dst < world:
        raise ValueError(f"dst={dst!r} is not a rank of the optimizer's group of {world}")
    if world == 1 or not owners:
        full = mine.clone()
    elif dst is not None:
        if opt.rank != dst:
            if lengths[opt.rank]:
                send(mine.contiguous(), dst=opt._dp_ranks[dst], group=opt.dp_group)
            return None
        full = mine.new_empty(slot.numel)
        for r in owners:  # in rank order: each sender sends one part per parameter
            part = full[spans[r][0] : spans[r][1]]
            if r == dst:
                part.copy_(mine)
            else:
                recv(part, src=opt._dp_ranks[r], group=opt.dp_group)
    elif len(owners) == 1:
        src = owners[0]
        full = mine.clone() if src == opt.rank else mine.new_empty(slot.numel)
        broadcast(full, src=opt._dp_ranks[src], group=opt.dp_group)
    else:
        width = max(lengths)
        padded = mine.new_zeros(width)
        padded[: mine.numel()].copy_(mine)
        out = mine.new_empty(width * world)
        all_gather(out, padded, group=opt.dp_group)
        full = torch.cat([out[r * width : r * width + n] for r, n in enumerate(lengths)])
    return full.view(slot.param.shape).cpu()


def sharded_params(opt: LowLevelZeroOptimizer) -> dict[int, StateRef]:
    """Every trainable parameter (by optimizer index) as the part of it this rank keeps.

    Each value is the :class:`StateRef` of the parameter's master weights; all its optimizer
    states are sharded the same way, so a loader reads ``ref.part`` of each stored state
    and passes it to :func:`scatter_state_dict` (as a :class:`colossal.core.LocalShard`).
    """
    opt.gatherer.wait_all()
    return {
        slot.index: StateRef(bucket, slot, MASTER_KEY, master, opt)
        for bucket, master in zip(opt.buckets, opt.masters, strict=True)
        for slot in bucket.slots
    }


def gather_state_dict(opt: LowLevelZeroOptimizer) -> StateDict:
    """Build ``{"state", "param_groups", "loss_scaler", "zero"}`` with full tensors (collective)."""
    state: dict[int, dict[str, Any]] = {}
    for bucket, master in zip(opt.buckets, opt.masters, strict=True):
        for name, value, sharded in _shards(opt, bucket, master):
            if sharded:
                full = torch.empty(bucket.size, dtype=value.dtype, device=opt.device)
                if opt.world_size > 1:
                    all_gather(full, value.to(opt.device), group=opt.dp_group)
                else:
                    full.copy_(value)
                full = full.cpu()
                for slot in bucket.slots:
                    lo = slot.offset - bucket.start
                    state.setdefault(slot.index, {})[name] = (
                        full[lo : lo + slot.numel].view(slot.param.shape).clone()
                    )
            else:
                for slot in bucket.slots:
                    state.setdefault(slot.index, {})[name] = copy.deepcopy(value)
    return {
        "state": state,
        "param_groups": _param_groups(opt),
        "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "zero": {"stage": opt.config.stage, "precision": opt.precision.value},
    }


def _group_param_count(opt: LowLevelZeroOptimizer, group: int) -> int:
    return opt._group_sizes[group]


def scatter_state_dict(opt: LowLevelZeroOptimizer, sd: StateDict) -> None:
    """Load full per-parameter states into this rank's slices (no communication).

    Raises:
        ValueError: the state dict does not fit this optimizer (group count, parameter
            indices or shapes), naming the first mismatch.
    """
    for key in ("state", "param_groups"):
        if key not in sd:
            raise ValueError(
                f"optimizer state dict lacks {key!r}; was it saved by "
                "LowLevelZeroOptimizer.state_dict()?"
            )
    if len(sd["param_groups"]) != len(opt.optim.param_groups):
        raise ValueError(
            f"state dict has {len(sd['param_groups'])} param groups, this optimizer has "
            f"{len(opt.optim.param_groups)}; it was saved for a different model or optimizer"
        )
    for g, saved in enumerate(sd["param_groups"]):
        expected = _group_param_count(opt, g)
        if len(saved.get("params", [])) != expected:
            raise ValueError(
                f"saved param group {g} has {len(saved.get('params', []))} parameters, "
                "this one has "
                f"{expected}; it was saved for a different model"
            )
    states: dict[int, dict[str, Any]] = {int(k): v for k, v in sd["state"].items()}
    # Build everything first so that a mismatch leaves the optimizer untouched.
    loaded = [
        _bucket_state(opt, bucket, master, states)
        for bucket, master in zip(opt.buckets, opt.masters, strict=True)
    ]
    for saved, group in zip(sd["param_groups"], opt.optim.param_groups, strict=True):
        group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})
    for master, (new_state, master_shard) in zip(opt.masters, loaded, strict=True):
        if master_shard is not None and not opt._master_is_view:
            master.copy_(master_shard)
        if new_state:
            opt.optim.state[master] = new_state
    if sd.get("loss_scaler") is not None and opt.scaler is not None:
        opt.scaler.load_state_dict(sd["loss_scaler"])


def _is_tensor_state(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0
    return isinstance(value, ShardedTensor)


def _bucket_state(
    opt: LowLevelZeroOptimizer, bucket: Any, master: torch.Tensor, states: dict[int, dict[str, Any]]
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """This rank's slice of every state of ``bucket``, and of the saved master weights.

    Values are full per-parameter tensors or :class:`colossal.core.ShardedTensor` parts
    (a :class:`colossal.core.FlatRange` covering this rank's elements).
    """
    names = sorted({n for s in bucket.slots for n in states.get(s.index, {})})
    lo, hi = bucket.shard_range(opt.rank, opt.world_size)
    new_state: dict[str, Any] = {}
    master_shard = None
    for name in names:
        sample = next(
            states[s.index][name] for s in bucket.slots if name in states.get(s.index, {})
        )
        if not _is_tensor_state(sample):
            new_state[name] = copy.deepcopy(sample)
            continue
        shard = torch.zeros(hi - lo, dtype=sample.dtype)
        for slot in bucket.slots:
            value = states.get(slot.index, {}).get(name)
            if value is None:
                continue
            # a sharded state is described whole (its placements give this rank's part)
            expected = whole_shape(slot.param) if isinstance(value, ShardedTensor) \
                else slot.param.shape
            if tuple(value.shape) != tuple(expected):
                raise ValueError(
                    f"state {name!r} of parameter {slot.index} has shape {tuple(value.shape)}, "
                    f"the parameter has {tuple(expected)}; "
                    "the checkpoint belongs to another model"
                )
            start, stop = bucket.slot_shard_range(slot, opt.rank, opt.world_size)
            if start == stop:
                continue
            if isinstance(value, ShardedTensor):
                part = _covering(value, name, slot.index, start, stop)
            else:
                part = value.reshape(-1)[start:stop]
            at = slot.offset + start - lo
            shard[at : at + stop - start].copy_(part)
        if name == MASTER_KEY:
            master_shard = shard
        else:
            new_state[name] = shard.to(device=master.device, dtype=sample.dtype)
    return new_state, master_shard


def _covering(value: ShardedTensor, name: str, index: int, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened state from a part that must cover them."""
    held = value.placements[-1].part if value.placements else value.part
    if not isinstance(held, FlatRange) or held.start > start or held.stop < stop:
        raise ValueError(
            f"state {name!r} of parameter {index} holds {held} but this rank needs "
            f"FlatRange({start}, {stop}); read the part sharded_params() reports"
        )
    return held.real(value.local())[start - held.start : stop - held.start]


if TYPE_CHECKING:  # a type checker verifies that these implement the protocol

    def _implements(tensor: StateRef) -> ShardedTensor:
        return tensor
