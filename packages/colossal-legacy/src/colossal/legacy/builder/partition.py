"""Splitting a list of layers over pipeline stages (and model chunks).

A part is ``(start, end)``, ``end`` excluded. With ``num_chunks`` model chunks per stage
(the interleaved schedule), slice ``c * stages + s`` is chunk ``c`` of stage ``s``, so a stage
holds every ``stages``-th slice. ``start == 0`` marks the first stage's first chunk and
``end == num_items`` the last stage's last chunk, as the seeds' GPT example relies on.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from colossal.pipeline import distribute_layers

__all__ = ["Parts", "partition_balanced", "partition_uniform"]

#: ``parts[stage]`` is that stage's list of ``(start, end)``, one per model chunk.
Parts = list[list[tuple[int, int]]]


def _to_parts(counts: Sequence[int], stages: int, num_chunks: int) -> Parts:
    bounds = [0, *itertools.accumulate(counts)]
    parts: Parts = [[] for _ in range(stages)]
    for chunk in range(num_chunks):
        for stage in range(stages):
            k = chunk * stages + stage
            parts[stage].append((bounds[k], bounds[k + 1]))
    return parts


def partition_uniform(num_items: int, pipeline_parallel_size: int, num_chunks: int = 1) -> Parts:
    """Split ``num_items`` layers into equal contiguous slices, one per stage and chunk.

    When they do not divide evenly, the middle slices take one layer more (the first stage
    also embeds and the last also computes the loss).

    Raises:
        ValueError: Fewer layers than slices, or a non-positive size.
    """
    counts = distribute_layers(num_items, pipeline_parallel_size, num_chunks)
    return _to_parts(counts, pipeline_parallel_size, num_chunks)


def partition_balanced(
    weights: Sequence[float], pipeline_parallel_size: int, num_chunks: int = 1
) -> Parts:
    """Split weighted layers (e.g. by parameter count) into contiguous, balanced slices.

    Each slice gets at least one layer and the heaviest slice is as light as possible
    (binary search over the bound, greedy fill).

    Raises:
        ValueError: Fewer layers than slices, a negative weight, or a non-positive size.
    """
    slices = pipeline_parallel_size * num_chunks
    if pipeline_parallel_size < 1 or num_chunks < 1:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} and num_chunks={num_chunks} "
            "must be positive"
        )
    if len(weights) < slices:
        raise ValueError(
            f"cannot split {len(weights)} layers into {pipeline_parallel_size} stages x "
            f"{num_chunks} chunks = {slices} slices; use fewer stages or chunks"
        )
    if any(w < 0 for w in weights):
        raise ValueError(f"layer weights must be non-negative, got {list(weights)}")
    counts = _balanced_counts([float(w) for w in weights], slices)
    return _to_parts(counts, pipeline_parallel_size, num_chunks)


def _fits(weights: list[float], slices: int, bound: float) -> list[int] | None:
    """Slice sizes with every slice at most ``bound``, or ``None`` if there are none.

    Greedy: each slice takes layers while it stays under the bound and leaves one layer for
    every later slice; if that cannot place every layer, no split under the bound exists.
    """
    counts: list[int] = []
    i, n = 0, len(weights)
    for s in range(slices):
        rest = slices - s - 1
        total, size = 0.0, 0
        while i < n - rest and (size == 0 or total + weights[i] <= bound):
            total += weights[i]
            size += 1
            i += 1
        if total > bound:
            return None
        counts.append(size)
    return counts if i == n else None


def _balanced_counts(weights: list[float], slices: int) -> list[int]:
    prefix = [0.0, *itertools.accumulate(weights)]
    n = len(weights)
    # The optimal bound is the weight of some contiguous run: search over those.
    candidates = sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    best = _fits(weights, slices, candidates[hi])
    assert best is not None
    while lo < hi:
        mid = (lo + hi) // 2
        found = _fits(weights, slices, candidates[mid])
        if found is None:
            lo = mid + 1
        else:
            best, hi = found, mid
    return best
