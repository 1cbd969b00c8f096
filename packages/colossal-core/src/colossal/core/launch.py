"""Initializing torch.distributed from arguments or from a launcher's environment."""

from __future__ import annotations

import atexit
import logging
import os
import random
import sys
import warnings
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, cast, overload

import torch
import torch.distributed as dist

from colossal.core.accelerator import get_accelerator
from colossal.core.group_lifetime import keep_alive, keep_all_alive, let_workers_finish

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Collectives that wait longer than this fail with an error naming the rank (see launch)."""

LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
"""Environment variables holding the local rank (torchrun, SLURM, OpenMPI), in lookup order."""

# (host, port) of every launch() of this process: their stores live on with their groups.
_used_rendezvous: set[tuple[str, int]] = set()

# The local rank given to (or read from the environment by) the last successful launch() of
# this process; None when launch was not used or got none. A plain int, never a process group.
_launched_local_rank: int | None = None


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(f"timeout must be seconds or a datetime.timedelta, got {timeout!r}")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value}")
    return value


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's random generators."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    get_accelerator().manual_seed(seed)


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int | str,
    backend: str | None = None,
    local_rank: int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    config: object = None,
) -> None:
    """Create the default process group and seed every generator.

    The default group is kept alive until the process exits (see
    :mod:`colossal.core.group_lifetime`), so no teardown order can deadlock on it.

    Args:
        config: ColossalAI's old configuration argument (a dict or a file path). Ignored, with a
            ``DeprecationWarning`` the first time; pass the settings to the plugins instead.
        rank: Global rank of this process, ``0 <= rank < world_size``.
        world_size: Number of processes in the job.
        host: Address of the rank-0 host (the rendezvous TCP store).
        port: Free port on ``host``.
        backend: ``torch.distributed`` backend; the accelerator's (nccl on CUDA, gloo on CPU)
            when ``None``.
        local_rank: Rank on this node; selects the CUDA device (defaults to ``rank`` modulo the
            number of visible devices) and is what :func:`get_local_rank` (and so
            ``DistCoordinator.local_rank``) reports afterwards.
        seed: Seed for python, numpy and torch (the same on every rank).
        verbose: Log a line on rank 0 once the group is up.
        timeout: Seconds (or a ``timedelta``) after which a stuck collective raises instead of
            waiting forever.

    Raises:
        ValueError: Inconsistent rank/world size, bad port or timeout.
        RuntimeError: torch.distributed is already initialized.
    """
    _warn_config(config, "launch")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    try:
        port_num = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"port must be an integer, got {port!r}") from None
    if not 0 < port_num < 65536:
        raise ValueError(f"port must be in 1..65535, got {port_num}")
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized; call launch only once per process "
            "(destroy the old group with torch.distributed.destroy_process_group() first)"
        )
    rendezvous = (str(host), port_num)
    if rendezvous in _used_rendezvous:
        raise ValueError(
            f"port {port_num} on {host} was used by an earlier launch in this process, whose "
            "group (and its rendezvous store) stays alive until the process exits (see "
            "colossal.core.group_lifetime); pass a new port (MASTER_PORT) to launch again"
        )
    accelerator = get_accelerator()
    backend = backend or accelerator.communication_backend
    if accelerator.name != "cpu":
        count = max(accelerator.device_count(), 1)
        accelerator.set_device(rank % count if local_rank is None else local_rank)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{_format_host(host)}:{port_num}",
        rank=rank,
        world_size=world_size,
        timeout=_as_timedelta(timeout),
    )
    keep_alive(dist.group.WORLD)
    _used_rendezvous.add(rendezvous)
    global _launched_local_rank
    _launched_local_rank = local_rank
    _register_exit_hook()
    set_seed(seed)
    if verbose and rank == 0:
        logger.info(
            "distributed environment ready: world_size=%d backend=%s device=%s",
            world_size,
            backend,
            accelerator.get_current_device(),
        )


def destroy() -> None:
    """Destroy every process group of this process (a no-op when none exists).

    Call it at the end of a script, on every rank. :func:`launch` also registers it to run at a
    clean interpreter exit. Every group is first kept alive until the process exits
    (:func:`colossal.core.group_lifetime.keep_all_alive`): torch unregisters and shuts them down
    here, but their native objects are never freed while Python runs, which is what could
    deadlock a gloo worker thread against the main thread.
    """
    global _launched_local_rank
    if dist.is_available() and dist.is_initialized():
        keep_all_alive()
        dist.destroy_process_group()
        let_workers_finish()
    _launched_local_rank = None


def get_local_rank() -> int | None:
    """This process's rank on its node, from the launcher that started it.

    Lookup order: the ``local_rank`` that :func:`launch` received (``launch_from_slurm`` and
    ``launch_from_openmpi`` pass the launcher's value), then the environment variables
    ``LOCAL_RANK`` (torchrun, ``colossal run``), ``SLURM_LOCALID`` (``srun``) and
    ``OMPI_COMM_WORLD_LOCAL_RANK`` (``mpirun``), the first one set.

    Returns:
        The local rank, or ``None`` when no launcher gave one.

    Raises:
        ValueError: The variable found is not an integer (its name and value are given).
    """
    if _launched_local_rank is not None:
        return _launched_local_rank
    for name in LOCAL_RANK_VARIABLES:
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            return int(raw)
        except ValueError:
            raise ValueError(
                f"environment variable {name}={raw!r} is not an integer local rank; unset it "
                "or set it to this process's rank on its node"
            ) from None
    return None


_EXIT_HOOK = False


def _register_exit_hook() -> None:
    global _EXIT_HOOK
    if not _EXIT_HOOK:
        atexit.register(_destroy_on_clean_exit)
        _EXIT_HOOK = True


def _destroy_on_clean_exit() -> None:
    # After an uncaught exception a peer may be stuck in a collective with this rank; tearing
    # the groups down could then wait for the collective timeout, so the process just exits.
    if getattr(sys, "last_value", None) is not None:
        return
    try:
        destroy()
    except Exception as err:  # noqa: BLE001 - exiting anyway; never mask the exit status
        logger.debug("destroying the process groups at exit failed: %r", err)


_config_warned = False

LegacyConfig = Mapping[str, object] | str | os.PathLike[str]
"""ColossalAI's old ``config`` argument: a dict, or the path of a config file (ignored)."""


def _is_legacy_config(value: object) -> bool:
    """A ColossalAI config given where a backend or host is expected: a mapping or a path."""
    return isinstance(value, (Mapping, os.PathLike)) or (
        isinstance(value, str) and value.endswith(".py")
    )


def _warn_config(config: object, where: str) -> None:
    """ColossalAI's ``config`` argument is accepted and ignored, with one warning per process."""
    global _config_warned
    if config is None or _config_warned:
        return
    _config_warned = True
    warnings.warn(
        f"{where}(config=...) is ignored: Colossal takes no global config; pass the settings "
        "to the Booster and its plugin instead (and drop the config argument)",
        DeprecationWarning,
        stacklevel=3,
    )


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _read_env(names: Mapping[str, str], launcher: str, hint: str) -> dict[str, Any]:
    """Read launcher variables: ``{argument of launch: environment variable}``.

    Every value but ``host`` must be an integer.
    """
    missing = [env for env in names.values() if env not in os.environ]
    if missing:
        raise RuntimeError(
            f"{launcher}: environment variable(s) {', '.join(missing)} not set; {hint}"
        )
    values: dict[str, Any] = {}
    for key, env in names.items():
        raw = os.environ[env]
        if key == "host":
            values[key] = raw
            continue
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {env}={raw!r} is not an integer") from None
    return values


def _unshift(
    host: str | LegacyConfig, port: int | str, backend: str | int | None
) -> tuple[str, int | str, str | None, LegacyConfig | None]:
    """``(host, port, backend, config)`` of a launcher called with ``host, port[, backend]``.

    ColossalAI's old form passed ``config, host, port``: a config where the host belongs
    shifts the arguments back by one.
    """
    if _is_legacy_config(host):
        return cast(str, port), cast("int | str", backend), None, host
    return cast(str, host), port, cast("str | None", backend), None


def launch_from_torch(
    backend: str | LegacyConfig | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    config: object = None,
) -> None:
    """:func:`launch` with rank, world size and address set by torchrun or ``colossal run``.

    ``config`` (keyword, or ColossalAI's old first positional argument: a dict or a path) is
    accepted and ignored with a ``DeprecationWarning``.
    """
    if _is_legacy_config(backend):
        backend, config = None, backend
    names = {
        "rank": "RANK",
        "local_rank": "LOCAL_RANK",
        "world_size": "WORLD_SIZE",
        "host": "MASTER_ADDR",
        "port": "MASTER_PORT",
    }
    _warn_config(config, "launch_from_torch")
    hint = "start the script with `torchrun` or `colossal run`, or call launch(...)"
    env = _read_env(names, "launch_from_torch", hint)
    name = cast("str | None", backend)  # a legacy config in its place was moved out above
    launch(**env, backend=name, seed=seed, verbose=verbose, timeout=timeout)


@overload
def launch_from_slurm(
    host: str,
    port: int | str,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    config: object = None,
) -> None: ...


@overload
def launch_from_slurm(
    config: LegacyConfig,
    host: str,
    port: int | str,
    /,
    *,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> None: ...


def launch_from_slurm(
    host: str | LegacyConfig,
    port: int | str,
    backend: str | int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    config: object = None,
) -> None:
    """:func:`launch` with rank and world size from SLURM (``srun``).

    ``config`` is ColossalAI's old argument: accepted (also as the first positional argument)
    and ignored with a ``DeprecationWarning``.
    """
    addr, port, name, legacy = _unshift(host, port, backend)
    config = legacy if legacy is not None else config
    _warn_config(config, "launch_from_slurm")
    names = {"rank": "SLURM_PROCID", "world_size": "SLURM_NPROCS"}
    if "SLURM_NPROCS" not in os.environ and "SLURM_NTASKS" in os.environ:
        names["world_size"] = "SLURM_NTASKS"
    if "SLURM_LOCALID" in os.environ:
        names["local_rank"] = "SLURM_LOCALID"
    env = _read_env(names, "launch_from_slurm", "start the script with `srun`")
    launch(**env, host=addr, port=port, backend=name, seed=seed, verbose=verbose, timeout=timeout)


@overload
def launch_from_openmpi(
    host: str,
    port: int | str,
    backend: str | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    config: object = None,
) -> None: ...


@overload
def launch_from_openmpi(
    config: LegacyConfig,
    host: str,
    port: int | str,
    /,
    *,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
) -> None: ...


def launch_from_openmpi(
    host: str | LegacyConfig,
    port: int | str,
    backend: str | int | None = None,
    seed: int = 1024,
    verbose: bool = True,
    timeout: float | timedelta = DEFAULT_TIMEOUT,
    *,
    config: object = None,
) -> None:
    """:func:`launch` with rank, local rank and world size from OpenMPI (``mpirun``).

    ``config`` is ColossalAI's old argument: accepted (also as the first positional argument)
    and ignored with a ``DeprecationWarning``.
    """
    addr, port, name, legacy = _unshift(host, port, backend)
    config = legacy if legacy is not None else config
    _warn_config(config, "launch_from_openmpi")
    names = {
        "rank": "OMPI_COMM_WORLD_RANK",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
    }
    env = _read_env(names, "launch_from_openmpi", "start the script with `mpirun`")
    launch(**env, host=addr, port=port, backend=name, seed=seed, verbose=verbose, timeout=timeout)


def default_timeout() -> timedelta:
    """Timeout of the default process group (used for groups created later)."""
    if dist.is_initialized():
        try:
            backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
            return backend.options._timeout
        except (AttributeError, RuntimeError):
            pass
    return DEFAULT_TIMEOUT
