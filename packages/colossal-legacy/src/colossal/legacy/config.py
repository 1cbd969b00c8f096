"""Config: ColossalAI's configuration, read from a Python file or a dict.

A config file is plain Python; every top-level name that is not a module, a function, a class
or private (``_name``) becomes a key, so ``BATCH_SIZE = 128`` is ``gpc.config.BATCH_SIZE`` and
``fp16 = dict(mode=AMP_TYPE.TORCH)`` is ``gpc.config.fp16.mode``.
"""

from __future__ import annotations

import inspect
import os
import runpy
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

__all__ = ["Config", "load_config"]


class Config(dict[str, object]):
    """A dict whose keys are also attributes; nested dicts become Configs.

    Args:
        config: Initial keys (a mapping), or ``None`` for an empty config.

    Example:
        >>> cfg = Config(dict(parallel=dict(pipeline=2), BATCH_SIZE=8))
        >>> cfg.parallel.pipeline, cfg["BATCH_SIZE"]
        (2, 8)
    """

    def __init__(self, config: Mapping[str, object] | None = None) -> None:
        super().__init__()
        for key, value in (config or {}).items():
            self[key] = value

    def __setitem__(self, key: str, value: object) -> None:
        super().__setitem__(key, _convert(value))

    def __getattr__(self, name: str) -> object:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"the config has no key {name!r} (keys: {sorted(self)}); add `{name} = ...` "
                "to the config file or dict given to launch"
            ) from None

    def __setattr__(self, name: str, value: object) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        del self[name]

    def update(self, other: Mapping[str, object] | None = None, **kwargs: object) -> None:  # type: ignore[override]
        """Merge keys in (nested dicts become Configs)."""
        for key, value in {**(other or {}), **kwargs}.items():
            self[key] = value

    @staticmethod
    def from_file(filename: str | os.PathLike[str]) -> Config:
        """Read a Python config file.

        Raises:
            FileNotFoundError: No such file.
            ValueError: The file is not a ``.py`` file.
        """
        path = Path(filename).expanduser()
        if path.suffix != ".py":
            raise ValueError(
                f"config file {str(path)!r} must be a Python file (.py) defining the settings "
                "as top-level names, e.g. `parallel = dict(pipeline=2)`"
            )
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        namespace = runpy.run_path(str(path))
        return Config({k: v for k, v in namespace.items() if _is_setting(k, v)})


def _is_setting(name: str, value: object) -> bool:
    if name.startswith("_"):
        return False
    return not (
        isinstance(value, ModuleType) or inspect.isfunction(value) or inspect.isclass(value)
    )


def _convert(value: object) -> object:
    if isinstance(value, Mapping) and not isinstance(value, Config):
        return Config(value)
    if isinstance(value, list):
        return [_convert(v) for v in value]
    return value


def load_config(config: Config | Mapping[str, object] | str | os.PathLike[str] | None) -> Config:
    """A :class:`Config` from a dict, a path to a Python file, or ``None`` (empty).

    Raises:
        TypeError: ``config`` is none of these.
    """
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, Mapping):
        return Config(config)
    if isinstance(config, (str, os.PathLike)):
        return Config.from_file(config)
    raise TypeError(
        f"config must be a dict, a Config or a path to a Python file, got {type(config).__name__}"
    )
