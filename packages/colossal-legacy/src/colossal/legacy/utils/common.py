"""Small helpers of ColossalAI's ``colossalai.utils``: ranks, devices and the config's layout."""

from __future__ import annotations

import logging

import torch

from colossal.core import get_accelerator
from colossal.legacy.context import ParallelMode
from colossal.legacy.core import gpc

__all__ = [
    "get_current_device",
    "is_dp_rank_0",
    "is_no_pp_or_last_stage",
    "is_tp_rank_0",
    "is_using_ddp",
    "is_using_pp",
    "is_using_sequence",
    "print_rank_0",
]


def get_current_device() -> torch.device:
    """The device this process computes on (the current CUDA device, else the CPU)."""
    return get_accelerator().get_current_device()


def _size(mode: ParallelMode) -> int:
    return gpc.get_world_size(mode) if gpc.is_initialized(mode) else 1


def _local_rank(mode: ParallelMode) -> int:
    return gpc.get_local_rank(mode) if gpc.is_initialized(mode) else 0


def is_using_pp() -> bool:
    """Whether the config asks for pipeline parallelism (``parallel=dict(pipeline=N>1)``)."""
    return _size(ParallelMode.PIPELINE) > 1


def is_using_ddp() -> bool:
    """Whether the job has more than one data-parallel rank."""
    return _size(ParallelMode.DATA) > 1


def is_using_sequence() -> bool:
    """Whether the config asks for sequence parallelism (``tensor=dict(mode='sequence')``)."""
    return _size(ParallelMode.SEQUENCE) > 1


def is_dp_rank_0() -> bool:
    """Whether this rank is first in its data-parallel group (always before launch)."""
    return _local_rank(ParallelMode.DATA) == 0


def is_tp_rank_0() -> bool:
    """Whether this rank is first in its tensor-parallel group (always without one)."""
    return _local_rank(ParallelMode.TENSOR) == 0


def is_no_pp_or_last_stage() -> bool:
    """Whether there is no pipeline or this rank runs its last stage (where losses are)."""
    return gpc.is_pipeline_last_stage(ignore_virtual=True)


def print_rank_0(
    msg: str, logger: logging.Logger | logging.LoggerAdapter[logging.Logger] | None = None
) -> None:
    """Print ``msg`` (or log it at INFO with ``logger``) on global rank 0 only.

    Args:
        msg: The message.
        logger: A logger (e.g. :func:`~colossal.core.get_dist_logger`'s); ``print`` when
            None.
    """
    if gpc.get_global_rank() != 0:
        return
    if logger is None:
        print(msg, flush=True)
    else:
        logger.info(msg)
