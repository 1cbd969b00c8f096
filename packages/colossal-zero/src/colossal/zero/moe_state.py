"""The state of a :class:`MoeLowLevelZeroOptimizer` as one optimizer's, for checkpoints.

Its two ZeRO parts (dense over dp, experts over moe_dp) number their parameters each from 0.
A checkpoint names states by the wrapped optimizer's parameters, so these functions renumber
the parts' sharded states by the wrapped optimizer's flat indices and split such a state dict
back into the parts. An expert state stays a :class:`StateRef` placed along ``ep`` (the
expert block) then ``dp`` (the moe_dp range), so a writer gathers it from both groups.
"""

from __future__ import annotations

import copy
from typing import Any

from torch.optim.optimizer import StateDict

from colossal.zero.moe import MoeLowLevelZeroOptimizer
from colossal.zero.state_dict import StateRef, sharded_params, sharded_state_dict

__all__ = ["moe_sharded_params", "moe_sharded_state_dict", "split_state_dict"]


def _local_to_flat(opt: MoeLowLevelZeroOptimizer) -> list[list[int]]:
    """Per part, the wrapped optimizer's flat index of each of the part's indices."""
    return [[i for group in groups for i in group] for groups in opt.part_groups]


def moe_sharded_state_dict(opt: MoeLowLevelZeroOptimizer) -> StateDict:
    """Both parts' :func:`sharded_state_dict` as one, keyed by the wrapped optimizer's indices.

    ``param_groups`` are the wrapped optimizer's (its hyper-parameters, which an LR scheduler
    edits); ``loss_scaler`` and ``zero`` are the first part's (both parts share them).
    """
    state: dict[int, dict[str, Any]] = {}
    first: StateDict | None = None
    for part, flat in zip(opt.parts, _local_to_flat(opt), strict=True):
        sd = sharded_state_dict(part)
        first = sd if first is None else first
        for index, entries in sd["state"].items():
            state[flat[int(index)]] = entries
    assert first is not None  # the optimizer has at least one part
    groups = []
    start = 0
    for group in opt.param_groups:
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {
        "state": dict(sorted(state.items())),
        "param_groups": groups,
        "loss_scaler": first["loss_scaler"],
        "zero": first["zero"],
    }


def moe_sharded_params(opt: MoeLowLevelZeroOptimizer) -> dict[int, StateRef]:
    """Every trainable parameter (by the wrapped optimizer's index) as this rank's part of it."""
    out: dict[int, StateRef] = {}
    for part, flat in zip(opt.parts, _local_to_flat(opt), strict=True):
        for index, ref in sharded_params(part).items():
            out[flat[index]] = ref
    return dict(sorted(out.items()))


def split_state_dict(opt: MoeLowLevelZeroOptimizer, sd: StateDict) -> list[StateDict]:
    """A state dict keyed by the wrapped optimizer's indices as one state dict per part.

    Raises:
        ValueError: ``sd`` has another number of param groups or parameters per group.
    """
    saved_groups = sd["param_groups"]
    saved_counts = [len(g.get("params", [])) for g in saved_groups]
    counts = [len(g["params"]) for g in opt.param_groups]
    if saved_counts != counts:
        raise ValueError(
            f"the state dict's param groups hold {saved_counts} parameters, this optimizer's "
            f"{counts}; it was saved for a different model or optimizer"
        )
    # The saved indices of group g are its own list; map the wrapped flat index to them.
    saved_index = [i for g in saved_groups for i in g["params"]]
    states = {int(k): v for k, v in sd["state"].items()}
    parts = []
    for groups, origins in zip(opt.part_groups, opt._origins, strict=True):
        state: dict[int, Any] = {}
        part_groups = []
        local = 0
        for members, origin in zip(groups, origins, strict=True):
            hyper = {k: v for k, v in saved_groups[origin].items() if k != "params"}
            part_groups.append({**hyper, "params": list(range(local, local + len(members)))})
            for flat in members:
                entry = states.get(saved_index[flat])
                if entry is not None:
                    state[local] = entry
                local += 1
        parts.append(
            {
                "state": state,
                "param_groups": part_groups,
                "loss_scaler": sd.get("loss_scaler"),
                "zero": sd.get("zero"),
            }
        )
    return parts
