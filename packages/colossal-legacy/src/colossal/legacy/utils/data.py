"""``get_dataloader``: a DataLoader whose sampler splits the data over the data-parallel ranks."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from colossal.core import get_accelerator
from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc

__all__ = ["get_dataloader"]


class _SeedWorker:
    """Seeds python, numpy and torch in a worker process (picklable, unlike a closure)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, worker_id: int) -> None:
        seed = self.seed + worker_id
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)


def get_dataloader(
    dataset: Dataset,
    shuffle: bool = False,
    seed: int = 1024,
    add_sampler: bool = True,
    drop_last: bool = False,
    pin_memory: bool = False,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader over ``dataset`` that gives each data-parallel rank its own share.

    With more than one data-parallel rank (``gpc``'s DATA group) and ``add_sampler``, a
    :class:`~torch.utils.data.DistributedSampler` over that group picks the samples: the
    ranks' shares are disjoint and together cover the dataset (without ``drop_last`` the
    last samples are repeated to even the shares out, as torch's sampler does). Call
    ``loader.sampler.set_epoch(epoch)`` for a new shuffle each epoch (the Trainer does).

    Args:
        dataset: A map-style dataset.
        shuffle: Shuffle the samples (by the sampler when there is one).
        seed: Seed of the shuffle and of the worker processes.
        add_sampler: Split over the data-parallel ranks (when there are several).
        drop_last: Drop the samples that would make the shares (and the last batch) uneven.
        pin_memory: Pin host batches (only where the accelerator can use pinned memory).
        num_workers: Worker processes.
        **kwargs: Other DataLoader arguments (``batch_size``, ``collate_fn``...).

    Raises:
        ValueError: ``kwargs`` holds ``sampler`` together with ``add_sampler=True`` on
            several data-parallel ranks.
    """
    dp = gpc.get_world_size(ParallelMode.DATA) if gpc.is_initialized(ParallelMode.DATA) else 1
    pin = pin_memory and get_accelerator().supports_pin_memory
    common: dict[str, Any] = dict(
        worker_init_fn=_SeedWorker(seed),
        drop_last=drop_last,
        pin_memory=pin,
        num_workers=num_workers,
        **kwargs,
    )
    if add_sampler and dp > 1:
        if "sampler" in kwargs:
            raise ValueError(
                "get_dataloader: pass either sampler=... or add_sampler=True (the "
                "data-parallel sampler), not both; use add_sampler=False with your own"
            )
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=dp,
            rank=gpc.get_local_rank(ParallelMode.DATA),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        return DataLoader(dataset, sampler=sampler, **common)
    generator = torch.Generator()
    generator.manual_seed(seed)
    common.setdefault("generator", generator)
    return DataLoader(dataset, shuffle=shuffle, **common)
