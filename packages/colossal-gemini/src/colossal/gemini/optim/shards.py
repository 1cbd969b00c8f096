"""The optimizer's view of the chunks: one flat master piece per parameter and rank.

The user's optimizer was built over the model's original parameters. Gemini keeps those
parameters in chunks, and each rank owns one equal shard of every chunk's fp32 master
(``Chunk.optim_shard``). :func:`build_master_views` cuts each trainable parameter's piece of
this rank's master shard out as a 1-D view (a parameter spread over two ranks' shards gives
each rank its own piece; a rank holding none of it gets no view), so the optimizer updates
the masters in place and keeps its states per piece.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import overload

import torch
from torch import nn

from colossal.gemini.chunk import Chunk

logger = logging.getLogger(__name__)

__all__ = ["MasterView", "build_master_views"]


@dataclass
class MasterView:
    """One parameter's piece of this rank's master shard.

    Attributes:
        name: The parameter's name in the model.
        param: The original (model) parameter.
        chunk: Its chunk (``colossal.gemini.Chunk``).
        start: First element of the flattened parameter held here.
        stop: One past the last one.
        view: The 1-D view of the chunk's master shard the optimizer updates (its tensor
            identity stays fixed; :meth:`rebind` re-points it after the master moved).
        base: The master shard tensor ``view`` was cut from.
    """

    name: str
    param: nn.Parameter
    chunk: Chunk
    start: int
    stop: int
    view: torch.Tensor
    base: torch.Tensor

    @property
    def numel(self) -> int:
        """Elements of the piece."""
        return self.stop - self.start

    @overload
    def grad(self, flat: torch.Tensor) -> torch.Tensor: ...
    @overload
    def grad(self, flat: None = None) -> torch.Tensor | None: ...
    def grad(self, flat: torch.Tensor | None = None) -> torch.Tensor | None:
        """The matching piece of the chunk's reduced gradient shard (``None`` without one).

        Args:
            flat: Cut the piece out of this tensor instead (shaped like the gradient shard,
                e.g. an fp32 copy of it).
        """
        if flat is not None:
            offset = self.view.storage_offset() - self.base.storage_offset()
            return flat[offset : offset + self.numel]
        if getattr(self.chunk, "grad_shard", None) is None:
            return None
        _, _, grad = self.chunk.tensor_shard(self.param, source="grad")
        return grad

    def rebind(self) -> bool:
        """Re-point :attr:`view` at the chunk's current master shard if it was replaced.

        ``Chunk.move_master`` replaces the master tensor; the view keeps its identity (the
        optimizer's state is keyed by it) and takes the new storage. Returns whether it moved.
        """
        current = self.chunk.optim_shard
        if current is self.base:
            return False
        _, _, fresh = self.chunk.tensor_shard(self.param, source="master")
        self.view.data = fresh
        self.base = current
        return True


def _named_trainable(
    manager: object, params: Iterable[nn.Parameter]
) -> list[tuple[str, nn.Parameter]]:
    out: list[tuple[str, nn.Parameter]] = []
    for p in params:
        if not p.requires_grad:
            continue  # frozen (e.g. LoRA base weights): never optimized, no state
        try:
            name = manager.name_of(p)  # type: ignore[attr-defined]
        except KeyError:
            raise ValueError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that the Gemini "
                "module does not manage; build the optimizer over the parameters of the "
                "model given to GeminiDDP"
            ) from None
        out.append((name, p))
    return out


def build_master_views(
    manager: object, param_groups: Sequence[dict]
) -> list[list[MasterView]]:
    """This rank's master pieces of every trainable parameter, one list per param group.

    Args:
        manager: The module's ``ChunkManager`` (``chunk_of``, ``name_of``).
        param_groups: The user optimizer's param groups over the original parameters.

    Returns:
        Per group, the views in the group's parameter order (parameters this rank holds
        nothing of are left out).

    Raises:
        ValueError: A parameter is not managed by ``manager``, or appears in two groups.
    """
    seen: dict[int, int] = {}
    groups: list[list[MasterView]] = []
    for g, group in enumerate(param_groups):
        views: list[MasterView] = []
        for name, p in _named_trainable(manager, group["params"]):
            if id(p) in seen:
                raise ValueError(f"parameter {name!r} is in param groups {seen[id(p)]} and {g}; "
                                 "put each parameter in one group")
            seen[id(p)] = g
            chunk = manager.chunk_of(p)  # type: ignore[attr-defined]
            start, stop, view = chunk.tensor_shard(p, source="master")
            if stop <= start:
                continue
            views.append(MasterView(name, p, chunk, start, stop, view, chunk.optim_shard))
        groups.append(views)
    logger.debug("master views per group: %s", [len(v) for v in groups])
    return groups
