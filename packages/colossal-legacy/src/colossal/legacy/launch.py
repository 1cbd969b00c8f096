"""launch(config=...): the default group, the config and every parallel mode's groups.

ColossalAI's config-era entry points. Each reads the config (a dict or a Python file),
validates its ``parallel`` section against the world size *before* joining the rendezvous,
creates the default group through :func:`colossal.core.launch`, then the groups of every
mode the config uses, and fills ``gpc``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from colossal.core import launch as core_launch
from colossal.legacy.config import Config, load_config
from colossal.legacy.constants import INITIALIZER_MAPPING
from colossal.legacy.context.initializer import GroupInfo
from colossal.legacy.context.parallel_config import ParallelSettings, parse_parallel
from colossal.legacy.context.parallel_context import global_context as gpc
from colossal.legacy.registry import DIST_GROUP_INITIALIZER

__all__ = [
    "ConfigLike",
    "get_default_parser",
    "init_context",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]

logger = logging.getLogger(__name__)

#: What ``config=`` accepts: a dict, a :class:`Config`, a path to a ``.py`` file, or None.
ConfigLike = Config | Mapping[str, object] | str | os.PathLike[str] | None


def get_default_parser() -> argparse.ArgumentParser:
    """An argument parser with the launch arguments.

    ``--config``, ``--host``, ``--port``, ``--world_size``, ``--rank``, ``--local_rank`` and
    ``--backend``; add your own with ``parser.add_argument``.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=str, help="path to the config file")
    parser.add_argument("--host", type=str, help="the master address for distributed training")
    parser.add_argument("--port", type=int, help="the master port for distributed training")
    parser.add_argument("--world_size", type=int, help="world size for distributed training")
    parser.add_argument("--rank", type=int, help="rank for the default process group")
    parser.add_argument("--local_rank", type=int, help="local rank on the node")
    parser.add_argument(
        "--backend", type=str, default=None, help="backend for distributed communication"
    )
    return parser


def _settings(config: Config) -> ParallelSettings:
    parallel = config.get("parallel")
    if parallel is not None and not isinstance(parallel, Mapping):
        raise ValueError(
            f"parallel must be a dict like dict(pipeline=2, tensor=dict(size=4, mode='2d')), "
            f"got {parallel!r}"
        )
    return parse_parallel(parallel, tuple(INITIALIZER_MAPPING))


def init_context(config: ConfigLike = None, seed: int = 1024, verbose: bool = True) -> None:
    """Fill ``gpc`` for a job whose default process group already exists.

    What :func:`launch` does after creating the default group; call it directly when
    something else (torchrun with ``dist.init_process_group``, a test harness) created it.

    Raises:
        RuntimeError: torch.distributed is not initialized, or ``gpc`` is filled already.
        ValueError: The config's ``parallel`` section is invalid for this world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("init_context needs torch.distributed initialized; use launch(...)")
    cfg = load_config(config)
    settings = _settings(cfg)
    dims = settings.to_dims(dist.get_world_size())
    custom = _custom_groups(cfg, settings, dims.dp)
    gpc._install(cfg, settings, dims, custom)
    gpc.set_seed(seed)
    if verbose and dist.get_rank() == 0:
        logger.info(
            "config-era context ready: data=%d pipeline=%d tensor=%d mode=%s",
            dims.dp,
            settings.pipeline,
            settings.tensor,
            settings.mode,
        )


def _custom_groups(cfg: Config, settings: ParallelSettings, dp: int) -> dict[object, GroupInfo]:
    name = INITIALIZER_MAPPING.get(settings.mode or "")
    if name is None:
        return {}
    factory = DIST_GROUP_INITIALIZER.get_module(name)
    initializer = factory(  # type: ignore[operator]
        dist.get_rank(),
        dist.get_world_size(),
        cfg,
        dp,
        settings.pipeline,
        settings.tensor,
        **settings.tensor_kwargs,
    )
    made = initializer.init_dist_group()
    found = made if isinstance(made, list) else [made]
    groups: dict[object, GroupInfo] = {}
    for item in found:
        if item is None:
            continue
        info = item if isinstance(item, GroupInfo) else GroupInfo(*item)
        groups[info.mode] = info
    return groups


def launch(
    config: ConfigLike,
    rank: int,
    world_size: int,
    host: str,
    port: int | str,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """Create the default group and the groups the config asks for, and fill ``gpc``.

    Args:
        config: A dict, :class:`Config`, path to a Python config file, or ``None``.
        rank: Global rank of this process.
        world_size: Processes in the job.
        host: Address of the rank-0 host.
        port: Free port on ``host``.
        backend: ``torch.distributed`` backend (the accelerator's when ``None``; ColossalAI
            defaulted to ``'nccl'``, which a CPU machine cannot run).
        local_rank: Rank on this node (selects the device).
        seed: Seed of every generator, the same on every rank.
        verbose: Log on rank 0 when ready.
        timeout: Seconds (or a timedelta) after which a stuck collective raises; core's
            default (10 minutes) when ``None``.

    Raises:
        ValueError: The config's ``parallel`` section is invalid or does not fit
            ``world_size`` (raised before any rendezvous).
    """
    cfg = load_config(config)
    _settings(cfg).to_dims(world_size)  # validate before waiting for the other ranks
    extra = {} if timeout is None else {"timeout": timeout}
    core_launch(rank, world_size, host, port, backend, local_rank, seed, verbose, **extra)
    init_context(cfg, seed, verbose)


def _env_int(name: str, hint: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise RuntimeError(f"environment variable {name} is not set: {hint}")
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={raw!r} is not an integer") from None


def launch_from_torch(
    config: ConfigLike = None,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """:func:`launch` with rank, world size and address from torchrun or ``colossal run``."""
    hint = "start the script with torchrun or `colossal run`"
    local = os.environ.get("LOCAL_RANK")
    launch(
        config,
        _env_int("RANK", hint),
        _env_int("WORLD_SIZE", hint),
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        _env_int("MASTER_PORT", hint),
        backend,
        int(local) if local is not None and local.isdigit() else None,
        seed,
        verbose,
        timeout,
    )


def launch_from_slurm(
    config: ConfigLike,
    host: str,
    port: int | str,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """:func:`launch` with rank and world size from SLURM (``srun``)."""
    hint = "start the script with srun"
    size_name = "SLURM_NPROCS" if "SLURM_NPROCS" in os.environ else "SLURM_NTASKS"
    local = os.environ.get("SLURM_LOCALID")
    launch(
        config,
        _env_int("SLURM_PROCID", hint),
        _env_int(size_name, hint),
        host,
        port,
        backend,
        int(local) if local is not None and local.isdigit() else None,
        seed,
        verbose,
        timeout,
    )


def launch_from_openmpi(
    config: ConfigLike,
    host: str,
    port: int | str,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta | None = None,
) -> None:
    """:func:`launch` with rank and world size from Open MPI (``mpirun``)."""
    hint = "start the script with mpirun"
    launch(
        config,
        _env_int("OMPI_COMM_WORLD_RANK", hint),
        _env_int("OMPI_COMM_WORLD_SIZE", hint),
        host,
        port,
        backend,
        _env_int("OMPI_COMM_WORLD_LOCAL_RANK", hint),
        seed,
        verbose,
        timeout,
    )
