"""Where each chunk lives: static fractions, or automatic eviction by next use.

Policies decide over any sequence of chunk-like objects (:class:`ChunkLike`: G1's ``Chunk``
satisfies it) and never move memory themselves: the chunk manager applies their decisions
and reports every byte to the :class:`~colossal.gemini.memory.budget.DeviceMemoryBudget`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

from colossal.gemini.memory.budget import DeviceMemoryBudget, DeviceMemoryExceeded, Location
from colossal.gemini.memory.stats import MemStats

logger = logging.getLogger(__name__)


@runtime_checkable
class ChunkLike(Protocol):
    """What a placement policy needs to know about a chunk (sizes in bytes)."""

    @property
    def chunk_id(self) -> int: ...  # noqa: D102

    @property
    def payload_bytes(self) -> int: ...  # noqa: D102 - the gathered (full) params

    @property
    def shard_bytes(self) -> int: ...  # noqa: D102 - this rank's low-precision shard

    @property
    def master_bytes(self) -> int: ...  # noqa: D102 - this rank's fp32 master shard

    @property
    def keep_gathered(self) -> bool: ...  # noqa: D102

    @property
    def requires_grad(self) -> bool: ...  # noqa: D102


C = TypeVar("C", bound=ChunkLike)


@dataclass(frozen=True)
class ChunkPlacement:
    """The placement of one chunk.

    Attributes:
        keep_gathered: Keep the full payload on every rank (not sharded).
        shard_location: Where this rank's parameter shard lives.
        master_location: Where the fp32 master shard, its gradient shard and the optimizer
            states live.
    """

    keep_gathered: bool
    shard_location: Location
    master_location: Location


class PlacementPolicy(Protocol):
    """A placement policy: an initial :class:`ChunkPlacement` per chunk."""

    def plan(self, chunks: Sequence[ChunkLike]) -> list[ChunkPlacement]:
        """One placement per chunk, in the same order."""
        ...


def _check_frac(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(value).__name__}")
    if not 0.0 <= value <= 1.0 or math.isnan(value):
        raise ValueError(f"{name}={value!r} is outside [0, 1]; pass a fraction between 0 and 1")


def _leading(sizes: Sequence[int], frac: float) -> list[bool]:
    """Mark the leading items that cover at least ``frac`` of the total size (whole items).

    An item is marked while the bytes before it are below ``frac * total``, so the marked
    bytes are the smallest whole-item prefix reaching the fraction (0 -> none, 1 -> all).
    """
    if frac <= 0.0:
        return [False] * len(sizes)
    if frac >= 1.0:
        return [True] * len(sizes)
    target = frac * sum(sizes)
    marks, before = [], 0
    for size in sizes:
        marks.append(before < target)
        before += size
    return marks


@dataclass(frozen=True)
class StaticPlacement:
    """Fixed fractions of sharding and offload, decided by cumulative bytes in chunk order.

    Each fraction is rounded up to whole chunks: the leading chunks whose bytes reach the
    fraction are chosen.

    Args:
        shard_param_frac: Fraction of the parameter bytes (``payload_bytes``) whose chunks
            are sharded; the remaining chunks are kept gathered. A chunk the manager already
            keeps gathered stays gathered.
        offload_optim_frac: Fraction of the optimizer-side bytes (``master_bytes`` of the
            trainable chunks, ``shard_bytes`` for one without a separate master: master
            shard, gradient shard and optimizer states) on the host.
        offload_param_frac: Fraction of the parameter shards (``shard_bytes``) on the host.
            As in ColossalAI it needs ``shard_param_frac == 1`` and
            ``offload_optim_frac == 1``; otherwise it is ignored with a warning.

    Raises:
        ValueError: A fraction is outside ``[0, 1]``.
        TypeError: A fraction is not a number.
    """

    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self) -> None:
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            _check_frac(name, getattr(self, name))
        if self.offload_param_frac > 0 and not self.offloads_params_allowed:
            msg = (
                f"offload_param_frac={self.offload_param_frac} is ignored: it needs "
                f"shard_param_frac=1.0 and offload_optim_frac=1.0 (got "
                f"{self.shard_param_frac} and {self.offload_optim_frac})"
            )
            warnings.warn(msg, UserWarning, stacklevel=3)
            logger.warning(msg)

    @property
    def offloads_params_allowed(self) -> bool:
        """Whether ``offload_param_frac`` takes effect."""
        return self.shard_param_frac == 1.0 and self.offload_optim_frac == 1.0

    def plan(self, chunks: Sequence[ChunkLike]) -> list[ChunkPlacement]:
        """Place ``chunks`` (in chunk order).

        Returns:
            One :class:`ChunkPlacement` per chunk, in the same order.
        """
        chunks = list(chunks)
        sharded = _leading([c.payload_bytes for c in chunks], self.shard_param_frac)
        trainable = [i for i, c in enumerate(chunks) if c.requires_grad]
        # A chunk without a separate master is optimized on its shard: its optimizer side
        # is as large as the shard (and offloading it gives it a host master copy).
        optim_marks = _leading([chunks[i].master_bytes or chunks[i].shard_bytes
                                for i in trainable], self.offload_optim_frac)
        optim_host = {i for i, m in zip(trainable, optim_marks, strict=True) if m}
        param_frac = self.offload_param_frac if self.offloads_params_allowed else 0.0
        param_host = _leading([c.shard_bytes for c in chunks], param_frac)
        out = []
        for i, chunk in enumerate(chunks):
            keep = chunk.keep_gathered or not sharded[i]
            out.append(
                ChunkPlacement(
                    keep_gathered=keep,
                    shard_location="host" if param_host[i] and not keep else "device",
                    master_location="host" if i in optim_host else "device",
                )
            )
        return out


def _device_bytes(chunk: ChunkLike) -> int:
    """Device bytes an eviction of ``chunk`` frees (its ``device_bytes`` when it has one)."""
    explicit = getattr(chunk, "device_bytes", None)
    if explicit is not None:
        return int(explicit)
    if chunk.keep_gathered or getattr(chunk, "is_gathered", False):
        return chunk.payload_bytes
    return chunk.shard_bytes


@dataclass(frozen=True)
class AutoPlacement:
    """Evict the chunks whose next use is furthest when the device would be over capacity.

    Limits (``capacity`` is the budget's device capacity; unlimited means never evict):

    - steady state (``memstats`` given): model data may use
      ``capacity * steady_cuda_cap_ratio - memstats.non_model_bytes(step)`` (a step beyond
      the trace reserves the trace's peak);
    - warm-up (no ``memstats`` yet): ``capacity * (1 - warmup_non_model_data_ratio)``, i.e.
      ``warmup_non_model_data_ratio`` of the device is reserved for non-model data, as in
      ColossalAI.

    ``memstats`` must track chunks (``MemStats.remap(manager.chunk_of)``): a chunk it does not
    know counts as never used again (evicted first).

    Args:
        warmup_non_model_data_ratio: Share of the device reserved for non-model data while
            there is no trace, in ``[0, 1]``.
        steady_cuda_cap_ratio: Share of the device usable once traced, in ``[0, 1]``.
        memstats: The traced steps, or ``None`` during warm-up.

    Raises:
        ValueError: A ratio is outside ``[0, 1]``.
        TypeError: ``memstats`` is not a :class:`MemStats`.
    """

    warmup_non_model_data_ratio: float = 0.8
    steady_cuda_cap_ratio: float = 0.9
    memstats: MemStats[ChunkLike] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_frac("warmup_non_model_data_ratio", self.warmup_non_model_data_ratio)
        _check_frac("steady_cuda_cap_ratio", self.steady_cuda_cap_ratio)
        if self.memstats is not None and not isinstance(self.memstats, MemStats):
            raise TypeError(
                f"memstats must be a MemStats (from RuntimeMemTracer), got "
                f"{type(self.memstats).__name__}"
            )

    def with_memstats(self, memstats: MemStats[ChunkLike]) -> AutoPlacement:
        """This policy with a trace (end of warm-up)."""
        return AutoPlacement(self.warmup_non_model_data_ratio, self.steady_cuda_cap_ratio,
                             memstats)

    def plan(self, chunks: Sequence[ChunkLike]) -> list[ChunkPlacement]:
        """Initial placement for the auto policy.

        Sharded (unless the manager keeps a chunk gathered), parameter shards on the device,
        fp32 masters and optimizer states of trainable chunks on the host (as ColossalAI's
        auto policy); eviction then moves parameter shards at run time.
        """
        return [
            ChunkPlacement(c.keep_gathered, "device", "host" if c.requires_grad else "device")
            for c in chunks
        ]

    def model_data_limit(self, step: int, budget: DeviceMemoryBudget) -> int | None:
        """Device bytes model data may use at ``step`` (``None`` when unlimited)."""
        if budget.capacity is None:
            return None
        if self.memstats is None:
            return int(budget.capacity * (1.0 - self.warmup_non_model_data_ratio))
        stats = self.memstats
        reserve = stats.non_model_bytes(step) if 0 <= step < len(stats) else (
            stats.peak_non_model_bytes)
        return int(budget.capacity * self.steady_cuda_cap_ratio) - reserve

    def evictions(
        self,
        resident: Sequence[C],
        needed: Sequence[C],
        step: int,
        budget: DeviceMemoryBudget,
        *,
        demand: int | None = None,
        size_of: Callable[[C], int] | None = None,
    ) -> list[C]:
        """Chunks to move to the host so that the device fits ``needed`` at ``step``.

        Args:
            resident: Chunks now on the device that may be evicted (in the warm-up, without a
                next-use table, they are evicted in this order).
            needed: Chunks ``step`` uses; never evicted.
            step: The step about to run (an index into ``memstats``).
            budget: The device budget (its ``used("device")`` is the model data now there).
            demand: Device bytes bringing ``needed`` in will add. Default: each needed chunk's
                ``payload_bytes`` minus what it already holds on the device if resident.
            size_of: Device bytes an eviction frees. Default: the chunk's ``device_bytes``
                if it has one, else ``payload_bytes`` when gathered, else ``shard_bytes``.

        Returns:
            The chunks to evict, furthest next use first (never used again counts as
            furthest), just enough to fit; empty when everything fits.

        Raises:
            DeviceMemoryExceeded: Even evicting every candidate would not fit; the message
                names the demand, the unevictable bytes in use and the limit.
        """
        size = size_of or _device_bytes
        needed_ids = {id(c) for c in needed}
        resident_ids = {id(c) for c in resident}
        if demand is None:
            demand = sum(
                max(0, c.payload_bytes - (size(c) if id(c) in resident_ids else 0))
                for c in needed
            )
        limit = self.model_data_limit(step, budget)
        if limit is None:
            return []
        used = budget.used("device")
        to_free = used + demand - limit
        if to_free <= 0:
            return []
        candidates = [c for c in resident if id(c) not in needed_ids]
        if self.memstats is not None:
            stats = self.memstats

            def distance(c: C) -> float:
                nxt = stats.next_use(c, step)
                return math.inf if nxt is None else nxt

            candidates.sort(key=distance, reverse=True)
        chosen: list[C] = []
        freed = 0
        for chunk in candidates:
            if freed >= to_free:
                break
            chosen.append(chunk)
            freed += size(chunk)
        if freed < to_free:
            evictable = sum(size(c) for c in candidates)
            ids = [c.chunk_id for c in needed]
            raise DeviceMemoryExceeded(
                f"chunks {ids} needed at step {step} (auto placement; every other resident "
                f"chunk evicted)",
                demand,
                used - evictable,
                max(limit, 0),
            )
        logger.debug("step %d: evict chunks %s (%d B) for %d B", step,
                     [c.chunk_id for c in chosen], freed, demand)
        return chosen
