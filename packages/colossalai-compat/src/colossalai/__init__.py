"""colossalai-compat: ``import colossalai`` served by Colossal's packages.

Scripts written for ColossalAI (its Booster API and its config-era API) import ``colossalai``
and its submodules; this package answers those imports from one name table
(:mod:`colossalai._table`) with Colossal's own objects, never copies:

    >>> import colossalai
    >>> from colossalai.booster import Booster           # colossal.booster.Booster
    >>> from colossalai.core import global_context as gpc  # colossal.legacy's gpc

Importing this package puts one finder first on ``sys.meta_path``; it answers only for
``colossalai.*`` names. A ColossalAI path the table does not serve raises an ImportError
naming our equivalent, or saying it is not implemented in Colossal and which issue to watch.

It is opt-in (no Colossal distribution depends on it) and it conflicts with the real
ColossalAI, which has the same import name: install one or the other.
"""

from __future__ import annotations

import sys

from colossalai.__about__ import __version__
from colossalai._alias import attribute, public_names
from colossalai._finder import install
from colossalai._launch import launch, launch_from_openmpi, launch_from_slurm, launch_from_torch
from colossalai._table import TOP_LEVEL

__all__ = [
    "__version__",
    "get_default_parser",
    "initialize",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]

install()


def __getattr__(name: str) -> object:
    """Lazy top-level names (``initialize``, ``get_default_parser``) and submodules."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    from colossalai._alias import _from_import

    value = attribute(__name__, TOP_LEVEL, None, name, _from_import(sys._getframe(1)))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(public_names(__name__, TOP_LEVEL, None)))
