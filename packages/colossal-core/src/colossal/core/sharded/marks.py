"""Placements recorded on a tensor: a module marks the parameters it holds a part of.

Tensor-parallel layers (and any other code that splits a parameter) record on the parameter
how it is placed (:func:`mark_sharded`); :func:`sharded_view` then gives that parameter, or
any tensor laid out like it such as its gradient, as a :class:`LocalShard`, so checkpoint IO
and the gradient norm treat it as the part it is without knowing which package split it. A
ZeRO or Gemini shard of such a parameter adds its own placement after the recorded ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from colossal.core.sharded.local import LocalShard, as_placements, check_placements
from colossal.core.sharded.parts import Block, Blocks, FlatRange, check_shape
from colossal.core.sharded.placement import (
    LocalPart,
    Owned,
    Placement,
    Replicate,
    compose,
    level_shapes,
)

__all__ = [
    "ImpliedAxes",
    "ShardSpec",
    "mark_sharded",
    "param_placements",
    "shard_parameter",
    "shard_source",
    "shard_spec",
    "sharded_view",
    "whole_shape",
]

_SPEC_ATTR = "_colossal_shard_spec"
_SOURCE_ATTR = "_colossal_shard_source"


@dataclass(frozen=True)
class ShardSpec:
    """How a marked tensor relates to the whole one (see :func:`mark_sharded`).

    Attributes:
        placements: How it is placed along each parallel axis, outermost first.
        shape: Shape of the whole, unpadded tensor.
    """

    placements: tuple[Placement, ...]
    shape: torch.Size

    @property
    def part(self) -> LocalPart:
        """Which elements of the whole tensor the marked tensor holds."""
        return compose(self.placements, self.shape)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group of the innermost splitting axis (None: the whole job or none)."""
        splitting = [p for p in self.placements if p.splits]
        return splitting[-1].group if splitting else None

    def axis(self, name: str) -> Placement | None:
        """The placement along axis ``name``, if the tensor is placed along it."""
        return next((p for p in self.placements if p.axis == name), None)


def mark_sharded(
    tensor: torch.Tensor,
    part: Block | Blocks | FlatRange | Placement | Sequence[Placement],
    shape: Sequence[int],
    group: dist.ProcessGroup | None = None,
    axis: str = "tp",
) -> torch.Tensor:
    """Record on ``tensor`` (usually a parameter) how it is placed: a part of a whole tensor.

    The record lives on the tensor object: a new tensor made from it (``.detach()``,
    ``state_dict()`` without ``keep_vars``) does not carry it.

    Args:
        tensor: The tensor this rank holds (may be larger than the part with padding).
        part: One part (placed along ``axis`` over ``group``), or the placements.
        shape: Shape of the whole, unpadded tensor.
        group: The ranks of ``axis`` (the whole job when None), with a single part only.
        axis: The axis' name, with a single part only.

    Returns:
        ``tensor`` itself.

    Raises:
        ValueError: a level does not fit the one above or ``tensor`` cannot hold the part.
    """
    whole = torch.Size(check_shape(shape))
    placements = as_placements(part, group, axis)
    check_placements(placements, whole, tensor)
    last = placements[-1] if placements else None
    if last is not None and last.splits and last.local_shape is None:
        above = level_shapes(placements, whole)[-2]
        if tuple(tensor.shape) != last.held_shape(above):  # padded: later levels split it all
            padded = Placement(last.axis, last.part, last.group, tuple(tensor.shape))
            placements = (*placements[:-1], padded)
    setattr(tensor, _SPEC_ATTR, ShardSpec(placements, whole))
    return tensor


@dataclass(frozen=True)
class ImpliedAxes:
    """Axes a parameter lies along without saying so.

    They come from ColossalAI's ``tp_process_group`` and ``pp_process_group`` arguments of
    ``LowLevelZeroOptimizer`` (and of ``GeminiOptimizer``).
    A parameter whose record names no ``"pp"`` axis is owned by this rank's stage of ``pp``;
    one with no record at all is replicated over ``tp``.

    Attributes:
        tp: The tensor-parallel group, or None.
        pp: The pipeline group, or None.
    """

    tp: dist.ProcessGroup | None = None
    pp: dist.ProcessGroup | None = None

    def __bool__(self) -> bool:
        return self.tp is not None or self.pp is not None


def param_placements(param: torch.Tensor, implied: ImpliedAxes | None = None
                     ) -> tuple[Placement, ...]:
    """The placements of ``param``: its record, with the implied axes it does not name."""
    spec = shard_spec(param)
    own = spec.placements if spec is not None else ()
    if not implied:
        return own
    extra: list[Placement] = []
    if implied.pp is not None and not any(p.axis == "pp" for p in own):
        coordinate = dist.get_rank(implied.pp)
        extra.append(Placement("pp", Owned(coordinate), implied.pp))
    if implied.tp is not None and spec is None:
        extra.append(Placement("tp", Replicate(), implied.tp))
    return (*extra, *own)


def shard_spec(tensor: torch.Tensor) -> ShardSpec | None:
    """The :class:`ShardSpec` :func:`mark_sharded` recorded on ``tensor``, else None."""
    return getattr(tensor, _SPEC_ATTR, None)


def whole_shape(tensor: torch.Tensor) -> torch.Size:
    """Shape of the whole tensor ``tensor`` is a part of (its own shape when unmarked)."""
    spec = shard_spec(tensor)
    return torch.Size(spec.shape) if spec is not None else tensor.shape


def sharded_view(tensor: torch.Tensor, like: torch.Tensor | None = None) -> LocalShard | None:
    """``tensor`` as a :class:`LocalShard` when it (or ``like``) was marked, else None.

    Args:
        tensor: The values (a marked parameter, or its gradient or optimizer state).
        like: The marked tensor ``tensor`` is laid out like (``tensor`` itself when None).
    """
    spec = shard_spec(tensor if like is None else like)
    if spec is None:
        return None
    return LocalShard(tensor, spec.placements, spec.shape)


def shard_parameter(
    source: torch.Tensor,
    part: Block | Blocks,
    group: dist.ProcessGroup | None = None,
    local_shape: Sequence[int] | None = None,
    requires_grad: bool | None = None,
    axis: str = "tp",
) -> nn.Parameter:
    """A parameter holding ``part`` of ``source`` (the whole tensor), marked sharded.

    The local tensor has ``local_shape`` (default: the part's own shape); a larger shape adds
    zero padding after the real elements (:meth:`Block.real`). When ``source`` is on the
    ``meta`` device (built under a lazy-init context) the parameter is a ``meta`` tensor too,
    and remembers ``source`` (:func:`shard_source`) so a materializer can build the whole
    tensor once, keep only this part and drop the rest.

    Args:
        source: The whole, unpadded tensor (a module's native weight).
        part: Which of its elements this rank keeps.
        group: The ranks of ``axis`` (the whole job when None).
        local_shape: Shape of the local tensor, at least the part's (padding after it).
        requires_grad: Whether the parameter requires grad (default: ``source``'s flag).
        axis: The axis' name.

    Raises:
        ValueError: ``part`` does not fit ``source`` or ``local_shape`` cannot hold it.
    """
    if not isinstance(part, Block | Blocks):
        raise TypeError(f"shard_parameter needs a Block or Blocks part, got {type(part).__name__}")
    part.check(source.shape)
    shape = tuple(part.sizes) if local_shape is None else check_shape(local_shape)
    grad = source.requires_grad if requires_grad is None else requires_grad
    with torch.no_grad():
        if source.is_meta:
            local = torch.empty(shape, dtype=source.dtype, device="meta")
        else:
            local = torch.zeros(shape, dtype=source.dtype, device=source.device)
            part.real(local).copy_(part.take(source))
    param = nn.Parameter(local, requires_grad=grad)
    padded = shape if shape != tuple(part.sizes) else None
    mark_sharded(param, Placement(axis, part, group, padded), source.shape)
    if source.is_meta:
        setattr(param, _SOURCE_ATTR, source)
    return param


def shard_source(tensor: torch.Tensor) -> torch.Tensor | None:
    """The whole ``meta`` tensor a :func:`shard_parameter` result was cut from, else None."""
    return getattr(tensor, _SOURCE_ATTR, None)
