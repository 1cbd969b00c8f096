"""Which tokens each sequence-parallel rank holds, and the split / gather between layouts.

Two layouts of a sequence of ``s`` tokens over ``P`` ranks:

* ``"contiguous"``: rank ``r`` holds tokens ``[r * s / P, (r + 1) * s / P)``;
* ``"zigzag"`` (ring attention's load balance under a causal mask): the sequence is cut in
  ``2P`` equal chunks and rank ``r`` holds chunks ``r`` and ``2P - 1 - r``, in that order.

:func:`split_sequence` keeps this rank's tokens of a replicated ``(batch, seq, ...)`` tensor
(backward: all-gather of the gradient, since every rank's part of the full gradient comes
from its own tokens); :func:`gather_sequence` is its inverse (backward: keep this rank's
tokens of the gradient, which every rank computes whole from the same head and loss). They
communicate only through :mod:`colossal.core.comm`, so the comm tracker counts them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from colossal.shardformer.layer._primitives import gather_seq
from colossal.shardformer.layer._utils import group_rank, group_size

__all__ = [
    "LAYOUTS",
    "check_sequence_length",
    "gather_sequence",
    "split_sequence",
    "token_indices",
]

LAYOUTS = ("contiguous", "zigzag")
"""Layout names :func:`token_indices` accepts."""


def _check_kind(kind: str) -> None:
    if kind not in LAYOUTS:
        raise ValueError(f"sequence layout must be one of {LAYOUTS}, got {kind!r}")


def check_sequence_length(seq_len: int, size: int, kind: str) -> None:
    """Raise ValueError unless a ``seq_len``-token sequence splits evenly in layout ``kind``.

    Args:
        seq_len: Tokens in the (full) sequence.
        size: The sequence-parallel size ``P``.
        kind: ``"contiguous"`` (needs ``seq_len % P == 0``) or ``"zigzag"``
            (``seq_len % 2P == 0``).

    Raises:
        ValueError: The length does not split, naming it, the size and the multiple to pad to.
    """
    _check_kind(kind)
    multiple = size * (2 if kind == "zigzag" else 1)
    if seq_len % multiple != 0:
        raise ValueError(
            f"sequence parallelism ({kind} layout over {size} ranks): sequence length "
            f"{seq_len} is not divisible by {multiple}; pad the inputs to a multiple of "
            f"{multiple} (e.g. tokenizer(..., padding=True, pad_to_multiple_of={multiple}))"
        )


def token_indices(
    seq_len: int, rank: int, size: int, kind: str, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in local order.

    Args:
        seq_len: Tokens in the full sequence.
        rank: The rank in the sequence-parallel group.
        size: The sequence-parallel size.
        kind: ``"contiguous"`` or ``"zigzag"``.
        device: Where to put the indices (default CPU).

    Returns:
        A 1-D ``torch.long`` tensor of ``seq_len / size`` positions.

    Raises:
        ValueError: Unknown layout, a rank outside ``[0, size)``, or a length that does not
            split (see :func:`check_sequence_length`).
    """
    check_sequence_length(seq_len, size, kind)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside the sequence-parallel group of {size} ranks")
    if kind == "contiguous":
        per = seq_len // size
        return torch.arange(rank * per, (rank + 1) * per, device=device)
    chunk = seq_len // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    mirror = 2 * size - 1 - rank
    second = torch.arange(mirror * chunk, (mirror + 1) * chunk, device=device)
    return torch.cat([first, second])


def _gather_order(seq_len: int, size: int, kind: str, device: torch.device) -> torch.Tensor:
    """Index turning the rank-order concatenation of every rank's tokens into global order."""
    order = torch.cat([token_indices(seq_len, r, size, kind, device) for r in range(size)])
    return torch.argsort(order)


def _gather(x: torch.Tensor, group: ProcessGroup | None, kind: str, dim: int) -> torch.Tensor:
    moved = x.movedim(dim, 1) if dim != 1 else x
    full = gather_seq(moved, group)
    if kind == "zigzag":
        size = group_size(group)
        full = full.index_select(1, _gather_order(full.shape[1], size, kind, full.device))
    return full.movedim(1, dim) if dim != 1 else full


def _split(x: torch.Tensor, group: ProcessGroup | None, kind: str, dim: int) -> torch.Tensor:
    size, rank = group_size(group), group_rank(group)
    index = token_indices(x.shape[dim], rank, size, kind, x.device)
    if kind == "contiguous":
        return x.narrow(dim, int(index[0]), index.numel()).contiguous()
    return x.index_select(dim, index)


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, kind: str, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.kind, ctx.dim = group, kind, dim
        return _split(x, group, kind, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.group, ctx.kind, ctx.dim), None, None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: ProcessGroup | None, kind: str, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.kind, ctx.dim = group, kind, dim
        return _gather(x, group, kind, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _split(grad, ctx.group, ctx.kind, ctx.dim), None, None, None


def split_sequence(
    x: torch.Tensor, group: ProcessGroup | None, kind: str = "contiguous", dim: int = 1
) -> torch.Tensor:
    """Keep this rank's tokens of the replicated ``x`` (backward: all-gather of the gradient).

    Args:
        x: The full tensor, the same on every rank of ``group``.
        group: The sequence-parallel group (the whole job when None).
        kind: The layout, ``"contiguous"`` or ``"zigzag"``.
        dim: The sequence dim (1 for batch-first activations).

    Raises:
        ValueError: The sequence length does not split in the layout.
    """
    _check_kind(kind)
    size = group_size(group)
    check_sequence_length(x.shape[dim], size, kind)
    if size == 1:
        return x
    return _SplitSequence.apply(x, group, kind, dim)


def gather_sequence(
    x: torch.Tensor, group: ProcessGroup | None, kind: str = "contiguous", dim: int = 1
) -> torch.Tensor:
    """All ranks' tokens in global order (backward: keep this rank's tokens of the gradient).

    Args:
        x: This rank's tokens in layout ``kind`` (as :func:`split_sequence` returns them).
        group: The sequence-parallel group (the whole job when None).
        kind: The layout, ``"contiguous"`` or ``"zigzag"``.
        dim: The sequence dim (1 for batch-first activations).
    """
    _check_kind(kind)
    if group_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, kind, dim)
