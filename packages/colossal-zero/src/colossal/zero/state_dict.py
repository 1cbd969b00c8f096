"""World-size-agnostic optimizer state: gather slices into full per-parameter tensors and back."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from colossal.core.comm import all_gather

if TYPE_CHECKING:
    from colossal.zero.optimizer import LowLevelZeroOptimizer

MASTER_KEY = "master_param"


def _is_sharded(value: Any, shard_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard_numel


def gather_state_dict(opt: LowLevelZeroOptimizer) -> dict[str, Any]:
    """Build ``{"state", "param_groups", "loss_scaler", "zero"}`` with full tensors (collective)."""
    state: dict[int, dict[str, Any]] = {}
    for bucket, master in zip(opt.buckets, opt.masters, strict=True):
        entries = dict(opt.optim.state.get(master, {}))
        if not opt._master_is_view:
            entries[MASTER_KEY] = master
        n = bucket.shard_size(opt.world_size)
        for name, value in sorted(entries.items()):
            if _is_sharded(value, n):
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
    groups = []
    start = 0
    for group, layout in zip(opt.optim.param_groups, opt.layouts, strict=True):
        count = _group_param_count(opt, layout.index)
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    return {
        "state": state,
        "param_groups": groups,
        "loss_scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        "zero": {"stage": opt.config.stage, "precision": opt.precision.value},
    }


def _group_param_count(opt: LowLevelZeroOptimizer, group: int) -> int:
    return opt._group_sizes[group]


def scatter_state_dict(opt: LowLevelZeroOptimizer, sd: dict[str, Any]) -> None:
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


def _bucket_state(
    opt: LowLevelZeroOptimizer, bucket: Any, master: torch.Tensor, states: dict[int, dict[str, Any]]
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """This rank's slice of every state of ``bucket``, and of the saved master weights."""
    names = sorted({n for s in bucket.slots for n in states.get(s.index, {})})
    lo, hi = bucket.shard_range(opt.rank, opt.world_size)
    new_state: dict[str, Any] = {}
    master_shard = None
    for name in names:
        sample = next(
            states[s.index][name] for s in bucket.slots if name in states.get(s.index, {})
        )
        if not (isinstance(sample, torch.Tensor) and sample.dim() > 0):
            new_state[name] = copy.deepcopy(sample)
            continue
        full = torch.zeros(bucket.size, dtype=sample.dtype)
        for slot in bucket.slots:
            value = states.get(slot.index, {}).get(name)
            if value is None:
                continue
            if tuple(value.shape) != tuple(slot.param.shape):
                raise ValueError(
                    f"state {name!r} of parameter {slot.index} has shape {tuple(value.shape)}, "
                    f"the parameter has {tuple(slot.param.shape)}; "
                    "the checkpoint belongs to another model"
                )
            full[slot.offset - bucket.start : slot.end - bucket.start].copy_(value.reshape(-1))
        shard = full[lo - bucket.start : hi - bucket.start]
        if name == MASTER_KEY:
            master_shard = shard
        else:
            new_state[name] = shard.to(device=master.device, dtype=sample.dtype).clone()
    return new_state, master_shard
