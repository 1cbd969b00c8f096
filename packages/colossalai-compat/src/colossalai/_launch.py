"""``colossalai.launch*`` for both of ColossalAI's call forms.

ColossalAI changed its launchers: the config-era ones take the config first
(``launch(config, rank, world_size, host, port, ...)``, ``launch_from_torch(config, ...)``,
``launch_from_slurm(config, host, port, ...)``), today's ones have no config
(``launch(rank, world_size, host, port, ...)``, ``launch_from_torch(backend=...)``,
``launch_from_slurm(host, port, ...)``). Both forms go to colossal-legacy's launchers, with
``config=None`` for today's form, so ``gpc`` is filled either way.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["launch", "launch_from_openmpi", "launch_from_slurm", "launch_from_torch"]

#: torch.distributed backend names (a string first argument that is one is not a config path).
_BACKENDS = frozenset({"nccl", "gloo", "mpi", "ucc", "hccl", "xccl", "cncl", "smddp"})


def _legacy(name: str) -> Callable[..., None]:
    module = importlib.import_module("colossal.legacy.launch")
    function: Callable[..., None] = getattr(module, name)
    return function


def _is_config(value: object) -> bool:
    """A config as ColossalAI accepted it: a dict (or Config), or the path of a Python file."""
    if isinstance(value, (Mapping, os.PathLike)):
        return True
    return isinstance(value, str) and value not in _BACKENDS and "://" not in value


def _is_port(value: object) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.isdigit())


def _split_config(
    args: tuple[Any, ...], kwargs: dict[str, Any], config_first: bool
) -> tuple[object, tuple[Any, ...]]:
    """``(config, remaining positional args)``; ``kwargs`` loses its ``config`` key."""
    if "config" in kwargs:
        return kwargs.pop("config"), args
    if args and config_first:
        return args[0], args[1:]
    return None, args


def launch(*args: Any, **kwargs: Any) -> None:
    """Start the job: ``launch(config, rank, world_size, host, port, ...)`` or without config.

    Both of ColossalAI's forms (see the module docstring) call
    :func:`colossal.legacy.launch`, so ``gpc`` (``colossalai.core.global_context``) is filled
    either way (with an empty config for today's form).
    """
    config_first = bool(args) and not isinstance(args[0], int)
    config, rest = _split_config(args, kwargs, config_first)
    _legacy("launch")(config, *rest, **kwargs)


def launch_from_torch(*args: Any, **kwargs: Any) -> None:
    """:func:`launch` with rank and world size from torchrun (or ``colossal run``).

    Both forms: ``(config, backend, ...)`` and ``(backend, ...)``; a first positional string
    that is a backend name (``'gloo'``, ``'nccl'``...) is the backend, not a config path.
    """
    config_first = bool(args) and _is_config(args[0])
    config, rest = _split_config(args, kwargs, config_first)
    _legacy("launch_from_torch")(config, *rest, **kwargs)


def _host_port_first(args: tuple[Any, ...]) -> bool:
    """Today's form ``(host, port, ...)``: the second positional argument is a port."""
    return len(args) >= 2 and isinstance(args[0], str) and _is_port(args[1])


def launch_from_slurm(*args: Any, **kwargs: Any) -> None:
    """:func:`launch` with rank and world size from SLURM.

    Both forms: ``(config, host, port, ...)`` and ``(host, port, ...)``.
    """
    config_first = bool(args) and not _host_port_first(args)
    config, rest = _split_config(args, kwargs, config_first)
    _legacy("launch_from_slurm")(config, *rest, **kwargs)


def launch_from_openmpi(*args: Any, **kwargs: Any) -> None:
    """:func:`launch` with rank and world size from Open MPI.

    Both forms: ``(config, host, port, ...)`` and ``(host, port, ...)``.
    """
    config_first = bool(args) and not _host_port_first(args)
    config, rest = _split_config(args, kwargs, config_first)
    _legacy("launch_from_openmpi")(config, *rest, **kwargs)
