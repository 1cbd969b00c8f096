"""Optimizer checkpoints of hybrid-parallel layouts: ZeRO shards of tensor-parallel parts.

A rank's optimizer state of a parameter is ZeRO's ``StateRef``: placed along the pipeline
axis (its stage owns it), the tensor-parallel axis (its block, or replicated) and the
data-parallel axis (its flat range). Saving gathers it axis by axis to the rank writing it
(:func:`stage_state`: the other stages join as :class:`colossal.core.Absent`); loading reads
the part the placements compose to and keeps its ZeRO range (:func:`read_held_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from colossal.checkpoint_io import CheckpointError, TensorReader
from colossal.checkpoint_io.sharded import TensorLike
from colossal.core import (
    Absent,
    Block,
    FlatRange,
    LocalShard,
    Owned,
    Placed,
    Placement,
    Replicated,
    ShardedTensor,
)
from colossal.core.comm import all_gather_object

__all__ = [
    "empty_part",
    "merge_meta",
    "read_held_state",
    "select_groups",
    "stage_state",
]


def empty_part(shape: Sequence[int], dtype: torch.dtype) -> LocalShard:
    """A rank's empty part of a tensor of ``shape`` (held elsewhere)."""
    if not shape:
        return LocalShard(torch.empty(0, dtype=dtype), FlatRange(0, 0), shape)
    none = (0, *shape[1:])
    return LocalShard(torch.empty(none, dtype=dtype), Block((0,) * len(shape), none), shape)


def stage_state(
    value: TensorLike | None,
    owner: int,
    pp_group: dist.ProcessGroup | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    mine: bool,
) -> Placed:
    """A state as the save sees it: owned by pipeline stage ``owner`` along ``"pp"``.

    This rank's ZeRO state (a ``StateRef``, placed along tp and dp as its parameter) when its
    stage is the owner; otherwise an :class:`colossal.core.Absent` that joins the gather. A
    tied weight's copy on another stage counts as absent: the owner's copy is saved.

    Args:
        value: This rank's state of the parameter: a tensor, or a placed sharded state
            (ZeRO's ``StateRef``); None when it holds none.
        owner: The pipeline coordinate of the stage whose copy is saved.
        pp_group: The pipeline group (None without pipeline parallelism).
        shape: The state's whole shape.
        dtype: Its dtype.
        mine: Whether this rank's stage is ``owner``.

    Raises:
        RuntimeError: Without a pipeline, this rank holds none of the state.
        TypeError: ``value`` is a sharded tensor that does not describe its placements
            (ZeRO's states do).
    """
    if value is not None and not isinstance(value, torch.Tensor | Placed):
        raise TypeError(
            f"a {type(value).__name__} optimizer state cannot be placed along the pipeline "
            "axis; expected a tensor or a colossal.core.Placed state (ZeRO's StateRef)"
        )
    if pp_group is None:  # no pipeline: every rank holds its part of every state
        if value is None:
            raise RuntimeError(
                "without pipeline parallelism every rank holds its part of every optimizer "
                f"state, but this rank holds none of a state of shape {tuple(shape)}"
            )
        return value if isinstance(value, Placed) else Replicated(value)
    along = Placement("pp", Owned(owner), pp_group)
    if not mine or value is None:
        return Absent(shape, dtype, (along,))
    if isinstance(value, Placed):
        return value.along(along)
    return LocalShard(value.reshape(shape), (along,), shape)  # a whole, replicated state


def merge_meta(meta: dict[str, Any], shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """Every rank's optimizer metadata merged (param groups and shapes of every stage)."""
    everyone = all_gather_object({"meta": meta, "shapes": dict(shapes)})
    groups = [dict(g, params=[]) for g in everyone[0]["meta"]["param_groups"]]
    scalars: dict[str, Any] = {}
    merged_shapes: dict[str, Any] = {}
    for item in everyone:
        for group, theirs in zip(groups, item["meta"]["param_groups"], strict=True):
            group["params"] += [n for n in theirs["params"] if n not in group["params"]]
        scalars.update(item["meta"]["scalar_states"])
        merged_shapes.update(item["shapes"])
    steps = max(item["meta"]["steps"] for item in everyone)
    return {**meta, "param_groups": groups, "scalar_states": scalars, "steps": steps,
            "param_shapes": {n: list(s) for n, s in merged_shapes.items()}}


def read_held_state(reader: TensorReader, ref: ShardedTensor, key: str) -> TensorLike:
    """This rank's part of the stored state ``key``, laid out as ZeRO's ``ref`` keeps it.

    Reads only the part the ref's placements compose to (its tensor-parallel block, then its
    flat range; scalars and states of their own shape whole).

    Raises:
        CheckpointError: The stored state has another shape than the parameter.
    """
    stored, whole = tuple(reader.shape(key)), tuple(ref.shape)
    if not stored or stored != whole:
        if stored and len(stored) == len(whole):
            raise CheckpointError(
                f"optimizer state {key!r} has shape {stored} in the checkpoint but the "
                f"parameter has {whole}: the checkpoint belongs to another model"
            )
        return reader.read(key)  # scalars (step) and states of their own shape
    return LocalShard(reader.read_part(key, ref.part).reshape(-1), ref.placements, ref.shape)


def select_groups(meta: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``meta`` with each param group keeping only ``names`` (a stage loads its own)."""
    keep = set(names)
    groups = [dict(g, params=[n for n in g["params"] if n in keep])
              for g in meta.get("param_groups", [])]
    return {**meta, "param_groups": groups}

