"""Optimizer state layouts: torch-style (keyed by parameter index) <-> the checkpoint's.

The checkpoint stores tensors as ``"<param name>.<state name>"`` plus JSON metadata.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from colossal.checkpoint_io.index import CheckpointError
from colossal.checkpoint_io.sharded import TensorLike
from colossal.core import ShardedTensor

__all__ = ["named_to_indexed", "indexed_to_named"]

SKIP_ON_LOAD = ("master_param",)
"""States a plain optimizer does not keep (ZeRO's fp32 masters); dropped unless wanted."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def indexed_to_named(
    state_dict: dict[str, Any], names: Sequence[str]
) -> tuple[dict[str, TensorLike], dict[str, Any]]:
    """Split a torch-style optimizer state dict into named tensors and JSON metadata.

    Args:
        state_dict: ``{"state": {index: {state: value}}, "param_groups": [...],
            "loss_scaler": ...}``.
        names: Parameter name of each index.

    Returns:
        ``(tensors, meta)``: tensors (or :class:`colossal.core.ShardedTensor` states, left
        for the writer to gather) keyed ``"<param>.<state>"``; meta with ``param_groups``
        (parameters by name, hyper-parameters), ``scalar_states``, ``steps`` and
        ``loss_scaler``.
    """
    tensors: dict[str, TensorLike] = {}
    scalars: dict[str, dict[str, Any]] = {}
    steps = 0
    for index, entries in state_dict.get("state", {}).items():
        name = names[int(index)]
        for key, value in entries.items():
            if isinstance(value, ShardedTensor):  # gathered by whoever writes it
                tensors[f"{name}.{key}"] = value
            elif isinstance(value, torch.Tensor):
                tensors[f"{name}.{key}"] = value.detach()
                if key == "step":
                    steps = max(steps, int(value.item()))
            else:
                scalars.setdefault(name, {})[key] = _jsonable(value)
                if key == "step":
                    steps = max(steps, int(value))
    groups = []
    for group in state_dict.get("param_groups", []):
        hyper = {k: _jsonable(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[int(i)] for i in group["params"]]})
    meta = {
        "param_groups": groups,
        "scalar_states": scalars,
        "steps": steps,
        "loss_scaler": _jsonable(state_dict.get("loss_scaler")),
    }
    return tensors, meta


def named_to_indexed(
    meta: dict[str, Any],
    weight_map: dict[str, str],
    names: Sequence[str],
    read: Callable[[str, str], object],
    keep: Sequence[str] = (),
) -> dict[str, Any]:
    """Rebuild a torch-style state dict for an optimizer whose parameters are ``names``.

    Args:
        meta: The checkpoint's optimizer metadata.
        weight_map: Tensor key -> file.
        names: This optimizer's parameter names, in index order.
        read: ``read(param_name, key)`` returns the tensor stored under ``key``.
        keep: States of :data:`SKIP_ON_LOAD` to keep (e.g. ``"master_param"`` for ZeRO).

    Raises:
        CheckpointError: The checkpoint's parameters differ from this optimizer's.
    """
    saved_groups = meta.get("param_groups", [])
    saved_names = [n for g in saved_groups for n in g["params"]]
    if sorted(saved_names) != sorted(names) or len(saved_names) != len(names):
        missing = sorted(set(names) - set(saved_names))[:5]
        extra = sorted(set(saved_names) - set(names))[:5]
        raise CheckpointError(
            "the optimizer checkpoint was saved for different parameters (another model?): "
            f"missing {missing}, unexpected {extra}; load a checkpoint of this model"
        )
    position = {n: i for i, n in enumerate(names)}
    by_param: dict[str, list[str]] = {}
    for key in weight_map:
        param, _, state_name = key.rpartition(".")
        by_param.setdefault(param, []).append(state_name)
    state: dict[int, dict[str, Any]] = {}
    for name in names:
        entries: dict[str, Any] = {}
        for key in by_param.get(name, []):
            if key in SKIP_ON_LOAD and key not in keep:
                continue
            entries[key] = read(name, f"{name}.{key}")
        for key, value in meta.get("scalar_states", {}).get(name, {}).items():
            entries[key] = copy.deepcopy(value)
        if entries:
            state[position[name]] = entries
    groups = []
    for group in saved_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        if "betas" in hyper and isinstance(hyper["betas"], list):
            hyper["betas"] = tuple(hyper["betas"])
        groups.append({**hyper, "params": [position[n] for n in group["params"]]})
    return {"state": state, "param_groups": groups, "loss_scaler": meta.get("loss_scaler")}
