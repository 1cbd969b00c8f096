"""Optimizer checkpoints of hybrid-parallel layouts: ZeRO shards of tensor-parallel parts.

A rank's optimizer state of a parameter is a ZeRO shard (a flat range, over the data-parallel
group) of the state of this rank's tensor-parallel part of the parameter, and only the
ranks of the parameter's pipeline stage hold it. Saving gathers each state first over the
data-parallel group to the stage's first replica, which then holds the tensor-parallel part
whole, and from there over the job to the rank writing it (:class:`ReplicaState`).
Loading reads a rank's tensor-parallel part of each stored state and keeps its ZeRO range.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from colossal.checkpoint_io import CheckpointError
from colossal.core import Block, FlatRange, LocalShard, ShardedTensor, shard_spec
from colossal.core.comm import all_gather_object

__all__ = [
    "ReplicaState",
    "empty_part",
    "merge_meta",
    "read_held_state",
    "select_groups",
    "whole_shape",
]


def empty_part(shape: Sequence[int], dtype: torch.dtype) -> LocalShard:
    """A rank's empty part of a tensor of ``shape`` (held elsewhere)."""
    if not shape:
        return LocalShard(torch.empty(0, dtype=dtype), FlatRange(0, 0), shape)
    none = (0, *shape[1:])
    return LocalShard(torch.empty(none, dtype=dtype), Block((0,) * len(shape), none), shape)


class ReplicaState:
    """A parameter's optimizer state as this rank's part of it over the whole job.

    Args:
        value: This rank's state (a ZeRO ``StateRef`` or a tensor every replica holds), or
            None when this rank's stage does not hold the parameter.
        param: The parameter (its tensor-parallel mark gives the part), or None.
        shape: The state's whole shape.
        dtype: The state's dtype.
        replica: The global rank of this stage's first data-parallel replica, or None.
    """

    def __init__(self, value: Any, param: torch.Tensor | None, shape: Sequence[int],
                 dtype: torch.dtype, replica: int | None) -> None:
        self.value, self.param, self.replica = value, param, replica
        self._shape, self._dtype = torch.Size(shape), dtype

    @property
    def shape(self) -> torch.Size:
        """The whole state's shape."""
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        """The state's dtype."""
        return self._dtype

    @property
    def part(self) -> Block:
        """Nothing is written in place (always a non-whole block)."""
        return Block((0,) * len(self._shape), (0, *self._shape[1:])) if self._shape \
            else Block((), ())

    def local(self) -> torch.Tensor:
        """Not used: the state is gathered whole by :meth:`gather`."""
        raise NotImplementedError("ReplicaState is only gathered")

    def gather(self, dst: int | None = None) -> torch.Tensor | None:
        """The whole state on global rank ``dst`` (collective over the job)."""
        import torch.distributed as dist

        held = None
        if self.value is not None:
            held = self.value
            if isinstance(held, ShardedTensor) and not isinstance(held, torch.Tensor):
                held = held.gather(self.replica)  # over the data-parallel group
        if held is None or dist.get_rank() != self.replica:
            return empty_part(self._shape, self._dtype).gather(dst)
        spec = shard_spec(self.param) if self.param is not None else None
        if spec is not None and tuple(held.shape) == tuple(self.param.shape):
            return LocalShard(held, spec.part, self._shape).gather(dst)
        return LocalShard(held.reshape(self._shape), Block.whole(self._shape),
                          self._shape).gather(dst)


def whole_shape(param: torch.Tensor, value: Any) -> tuple[int, ...]:
    """The global shape of a state ``value`` of ``param`` (a parameter-shaped state is whole)."""
    spec = shard_spec(param)
    if tuple(value.shape) == tuple(param.shape) and spec is not None:
        return tuple(spec.shape)
    return tuple(value.shape)


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


def read_held_state(
    reader: Any, param: torch.Tensor, layout: Any, key: str
) -> Any:
    """This rank's ZeRO range of its tensor-parallel part of the stored state ``key``.

    Raises:
        CheckpointError: The stored state has another shape than the parameter.
    """
    stored = tuple(reader.shape(key))
    spec = shard_spec(param)
    whole = tuple(spec.shape) if spec is not None else tuple(param.shape)
    if not stored or stored != whole:
        if stored and len(stored) == len(whole):
            raise CheckpointError(
                f"optimizer state {key!r} has shape {stored} in the checkpoint but the "
                f"parameter has {whole}: the checkpoint belongs to another model"
            )
        return reader.read(key)  # scalars (step) and states of their own shape
    if spec is None:
        local = reader.read(key)
    else:  # the tensor-parallel part, in a tensor of the parameter's (maybe padded) shape
        data = reader.read_part(key, spec.part)
        local = torch.zeros(param.shape, dtype=data.dtype)
        real = spec.part.real(local)
        real.copy_(data.reshape(real.shape))
    flat = local.reshape(-1)
    part = layout.part
    return LocalShard(flat[part.start : part.stop], part, layout.shape)


def select_groups(meta: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``meta`` with each param group keeping only ``names`` (a stage loads its own)."""
    keep = set(names)
    groups = [dict(g, params=[n for n in g["params"] if n in keep])
              for g in meta.get("param_groups", [])]
    return {**meta, "param_groups": groups}

