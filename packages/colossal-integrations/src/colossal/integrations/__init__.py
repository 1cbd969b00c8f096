"""Colossal plugins inside the trainers users already run.

* :class:`ColossalTrainer` (``colossal.integrations.hf_trainer``): Hugging Face ``Trainer``
  on a plugin (extra ``[hf]``: transformers and accelerate).
* :class:`ColossalStrategy` (``colossal.integrations.lightning_strategy``): a ``lightning.Trainer``
  strategy (extra ``[lightning]``).

Names load lazily: importing this package imports neither transformers nor lightning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colossal.integrations.__about__ import __version__

if TYPE_CHECKING:
    from colossal.integrations.hf_trainer import ColossalTrainer
    from colossal.integrations.lightning_strategy import ColossalStrategy

__all__ = ["ColossalStrategy", "ColossalTrainer", "__version__"]

_LAZY = {
    "ColossalTrainer": "colossal.integrations.hf_trainer",
    "ColossalStrategy": "colossal.integrations.lightning_strategy",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'colossal.integrations' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
