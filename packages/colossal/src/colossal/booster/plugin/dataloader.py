"""Distributed dataloaders: a sampler over the data-parallel group and seeded workers."""

from __future__ import annotations

import functools
import random
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["build_dataloader"]


def _seed_worker(worker_id: int, seed: int) -> None:
    worker_seed = seed + worker_id
    torch.manual_seed(worker_seed)
    random.seed(worker_seed)
    try:
        import numpy as np

        np.random.seed(worker_seed % 2**32)
    except ImportError:  # numpy is optional
        pass


def build_dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_replicas: int,
    rank: int,
    shuffle: bool = False,
    seed: int = 1024,
    drop_last: bool = False,
    pin_memory: bool = False,
    num_workers: int = 0,
    sampler_cls: type | None = None,
    **kwargs: Any,
) -> DataLoader:
    """Build a dataloader over this rank's part of ``dataset``.

    Args:
        dataset: A map-style dataset.
        batch_size: Samples per rank per batch.
        num_replicas: Size of the data-parallel group.
        rank: This rank's index in the group.
        shuffle: Shuffle (with ``seed``) every epoch.
        seed: Seed of the shuffle and of the workers.
        drop_last: Drop the last incomplete batch (and the uneven tail of the sampler).
        pin_memory: Pin host memory.
        num_workers: Worker processes.
        sampler_cls: Sampler class taking ``DistributedSampler``'s arguments.
        **kwargs: Further ``DataLoader`` arguments (not ``sampler``/``shuffle``).

    Raises:
        ValueError: ``batch_size`` is not positive, or ``kwargs`` set the sampler.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for key in ("sampler", "batch_sampler", "shuffle"):
        if key in kwargs:
            raise ValueError(
                f"prepare_dataloader sets {key!r} itself; pass shuffle=... and "
                "distributed_sampler_cls=... instead"
            )
    cls = sampler_cls or DistributedSampler
    sampler = cls(
        dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        worker_init_fn=functools.partial(_seed_worker, seed=seed),
        drop_last=drop_last,
        pin_memory=pin_memory,
        num_workers=num_workers,
        generator=generator,
        **kwargs,
    )
