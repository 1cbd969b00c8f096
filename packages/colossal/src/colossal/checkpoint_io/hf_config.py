"""Hugging Face config export: the ``config.json`` files saved next to a model's weights."""

from __future__ import annotations

import os
from typing import Any

from torch import nn

__all__ = ["CONFIG_FILE", "GENERATION_CONFIG_FILE", "hf_config_files"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"


def hf_config_files(module: nn.Module) -> dict[str, str]:
    """The Hugging Face config files of ``module``: file name -> JSON text (empty if none).

    Duck-typed, without importing transformers: ``module.config`` with ``to_json_string()``
    (or only ``save_pretrained``) gives ``config.json``, with ``architectures`` filled in as
    ``save_pretrained`` does; a non-None ``module.generation_config`` with
    ``to_json_string()`` gives ``generation_config.json``. The text is taken now, so later
    changes to the configs do not reach an async save.
    """
    out: dict[str, str] = {}
    config: Any = getattr(module, "config", None)
    text = None
    if callable(getattr(config, "to_json_string", None)):
        text = config.to_json_string()
    elif callable(getattr(config, "save_pretrained", None)):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            config.save_pretrained(tmp)
            file = os.path.join(tmp, CONFIG_FILE)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as handle:
                    text = handle.read()
    if isinstance(text, str):
        out[CONFIG_FILE] = _with_architectures(text, module)
    generation = getattr(module, "generation_config", None)
    if generation is not None and callable(getattr(generation, "to_json_string", None)):
        text = generation.to_json_string()
        if isinstance(text, str):
            out[GENERATION_CONFIG_FILE] = text
    return out


def _with_architectures(text: str, module: nn.Module) -> str:
    """``text`` with ``architectures`` set to the model's class when it is not set."""
    import json

    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return text
    if not isinstance(config, dict) or config.get("architectures"):
        return text
    # Skip wrapper classes made by torch (FSDP2 turns ``Net`` into ``FSDPNet``).
    cls = next(
        (c for c in type(module).__mro__ if not c.__module__.startswith("torch.")), type(module)
    )
    config["architectures"] = [cls.__name__]
    return json.dumps(config, indent=2, sort_keys=True) + "\n"
