"""Choose the chunk size that wastes the fewest elements (as ColossalAI's chunk search).

Sizes given in "m" are multiples of ``2**20`` *elements*. Parameters are taken in
registration order (first use, approximately definition order) and packed greedily into
chunks of each candidate size, from ``min_chunk_size_m`` to ``min_chunk_size_m +
search_range_m`` in steps of ``search_interval`` elements (``hidden_dim`` when given). The
waste of a candidate is the unused tail of every chunk closed because the next parameter did
not fit, plus the padding that makes every chunk (the last one trimmed to its content, and
the own chunks of very large parameters) a multiple of ``dp_size``. Parameters larger than
``mean + 3 std`` of all sizes (with ``filter_exlarge_params``) or larger than the candidate
get chunks of their own. The least waste wins; ties go to the larger chunk. All candidates
are evaluated at once, vectorized over the candidate sizes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["ChunkSearchResult", "ParamSizes", "SizeLike", "search_chunk_configuration"]

SizeLike = torch.Tensor | int | Sequence[int]
"""A parameter's size: the tensor itself, its element count, or its shape."""

ParamSizes = nn.Module | Mapping[str, SizeLike] | Iterable[SizeLike | tuple[str, SizeLike]]
"""What :func:`search_chunk_configuration` sizes: a module, names -> sizes, or sizes/pairs."""

_M = 2**20
_BLOCK = 16384


@dataclass(frozen=True)
class ChunkSearchResult:
    """The chosen chunk configuration.

    Attributes:
        chunk_size: Chunk capacity in elements (a multiple of ``dp_size``).
        total_numel: Elements of all parameters.
        wasted_numel: Elements allocated but unused (see the module docstring).
        wasted_fraction: ``wasted_numel / (total_numel + wasted_numel)``.
        n_chunks: Chunks the packing makes (own chunks of large parameters included).
        large_params: Names of the parameters that get chunks of their own.
    """

    chunk_size: int
    total_numel: int
    wasted_numel: int
    wasted_fraction: float
    n_chunks: int
    large_params: tuple[str, ...]


def _numel_of(value: Any, where: str) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"{where}: negative size {value}")
        return value
    if isinstance(value, (tuple, list, torch.Size)) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        return math.prod(value)
    raise TypeError(
        f"{where}: expected a tensor, an element count or a shape, got {type(value).__name__} "
        f"{value!r}"
    )


def _named_sizes(source: Any) -> list[tuple[str, int]]:
    """``(name, numel)`` for a module, a mapping or an iterable of params/sizes/pairs."""
    if isinstance(source, nn.Module):
        return [(n, p.numel()) for n, p in source.named_parameters()]
    if isinstance(source, Mapping):
        return [(str(k), _numel_of(v, f"entry {k!r}")) for k, v in source.items()]
    if not isinstance(source, Iterable) or isinstance(source, (str, bytes)):
        raise TypeError(
            "model_or_params must be an nn.Module, a mapping name -> tensor/shape, or an "
            "iterable of tensors, shapes or (name, tensor/shape) pairs; got "
            f"{type(source).__name__}"
        )
    out: list[tuple[str, int]] = []
    seen: set[int] = set()
    for i, item in enumerate(source):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, value = item
        else:
            name, value = str(i), item
        if isinstance(value, torch.Tensor):
            if id(value) in seen:  # a tied parameter is stored once
                continue
            seen.add(id(value))
        out.append((name, _numel_of(value, f"parameter {name!r}")))
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check_positive(name: str, value: Any, *, integer: bool, allow_zero: bool = False) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an int" if integer else "a number"
        raise ValueError(f"{name} must be {kind} {bound}, got {value!r}")


def search_chunk_configuration(
    model_or_params: ParamSizes,
    search_range_m: float = 32,
    search_interval: int = 1024,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    dp_size: int = 1,
    hidden_dim: int | None = None,
    verbose: bool = False,
) -> ChunkSearchResult:
    """Find the chunk size with the least wasted elements.

    Args:
        model_or_params: An ``nn.Module`` (its ``named_parameters`` order, tied weights once),
            a mapping ``name -> tensor/shape/numel``, or an iterable of tensors, shapes,
            element counts or ``(name, tensor/shape/numel)`` pairs, in registration order.
        search_range_m: Width of the searched range, in ``2**20`` elements.
        search_interval: Step between candidates, in elements.
        min_chunk_size_m: Smallest candidate, in ``2**20`` elements.
        filter_exlarge_params: Give parameters above ``mean + 3 std`` of the sizes their own
            chunks.
        dp_size: Data-parallel size; every chunk is padded to a multiple of it.
        hidden_dim: When given, the step between candidates (instead of
            ``search_interval``).
        verbose: Log the result.

    Returns:
        The chosen configuration. When all parameters together are no larger than the
        minimum chunk size, one chunk of their total (rounded up to ``dp_size``).

    Raises:
        ValueError: A size argument is not positive.
        TypeError: ``model_or_params`` is not one of the accepted forms.
    """
    _check_positive("search_range_m", search_range_m, integer=False, allow_zero=True)
    _check_positive("search_interval", search_interval, integer=True)
    _check_positive("min_chunk_size_m", min_chunk_size_m, integer=False)
    _check_positive("dp_size", dp_size, integer=True)
    if hidden_dim is not None:
        _check_positive("hidden_dim", hidden_dim, integer=True)
    named = [(n, s) for n, s in _named_sizes(model_or_params) if s > 0]
    sizes = [s for _, s in named]
    total = sum(sizes)
    min_size = max(1, int(min_chunk_size_m * _M))
    step = hidden_dim if hidden_dim is not None else search_interval

    if total <= min_size:
        size = _round_up(max(total, 1), dp_size)
        result = ChunkSearchResult(size, total, size - total, (size - total) / size, 1, ())
        _log(result, verbose)
        return result

    large: set[int] = set()
    if filter_exlarge_params and len(sizes) > 1:
        t = torch.tensor(sizes, dtype=torch.float64)
        threshold = (t.mean() + 3 * t.std(unbiased=False)).item()
        large = {i for i, s in enumerate(sizes) if s > threshold}
    fixed_waste = sum(_round_up(sizes[i], dp_size) - sizes[i] for i in large)

    hi = min_size + int(search_range_m * _M)
    candidates = torch.arange(min_size, hi + 1, step, dtype=torch.int64)
    cap = (candidates + dp_size - 1) // dp_size * dp_size
    # Blocks below torch's intra-op grain size stay single-threaded: on a busy machine the
    # thread pool costs far more than these element-wise ops.
    parts = [
        _pack(sizes, large, block, dp_size, fixed_waste) for block in cap.split(_BLOCK)
    ]
    waste = torch.cat([w for w, _ in parts])
    n_chunks = torch.cat([n for _, n in parts])

    best = int(waste.min().item())
    index = int(torch.nonzero(waste == best).max().item())  # ties: the larger chunk
    size = int(cap[index].item())
    large_names = {named[i][0] for i in large}
    large_names.update(n for n, s in named if s > size)
    result = ChunkSearchResult(
        chunk_size=size,
        total_numel=total,
        wasted_numel=best,
        wasted_fraction=best / (total + best),
        n_chunks=int(n_chunks[index].item()),
        large_params=tuple(n for n, _ in named if n in large_names),
    )
    _log(result, verbose)
    return result


def _pack(
    sizes: list[int], large: set[int], cap: torch.Tensor, dp_size: int, fixed_waste: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy packing for every capacity in ``cap``: (wasted elements, chunks) per capacity."""
    fill = torch.zeros_like(cap)
    waste = torch.full_like(cap, fixed_waste)
    n_chunks = torch.full_like(cap, len(large))
    for i, s in enumerate(sizes):
        if i in large:
            continue
        own = s > cap  # larger than the candidate: a chunk of its own, padded
        fits = ~own & (fill + s <= cap)
        closes = ~own & ~fits
        waste += torch.where(own, _round_up(s, dp_size) - s, 0)
        waste += torch.where(closes, cap - fill, 0)
        n_chunks += (own | closes).long()
        fill = torch.where(fits, fill + s, torch.where(closes, s, fill))
    # The last open chunk is trimmed to its content, padded to dp_size.
    waste += (fill + dp_size - 1) // dp_size * dp_size - fill
    n_chunks += (fill > 0).long()
    return waste, n_chunks


def _log(result: ChunkSearchResult, verbose: bool) -> None:
    level = logging.INFO if verbose else logging.DEBUG
    logger.log(
        level,
        "chunk search: size %d elements (%.2f m), %d chunks, %d of %d elements wasted (%.2f%%)",
        result.chunk_size,
        result.chunk_size / _M,
        result.n_chunks,
        result.wasted_numel,
        result.total_numel,
        100 * result.wasted_fraction,
    )
