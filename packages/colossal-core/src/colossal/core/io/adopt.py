"""Loaded optimizer states moved into memory the optimizer owns.

Tensors read from a safetensors file (``safe_open``) are views of a private memory map of
that file. An optimizer that keeps them as its states (``torch.optim.Optimizer.load_state_dict``
keeps a tensor whose dtype and device already match) then works on the checkpoint file's
pages: the first step copies every page on write, the file's page cache stays pinned, and
truncating the file under a running job (``cp new old``) kills it with SIGBUS. A save that
reads those states also pays a page fault per page.

:func:`adopt_optimizer_state` copies each loaded tensor into the optimizer's current state
tensor of the same shape, dtype and device (no new memory), or else into a fresh tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import StateDict

if TYPE_CHECKING:
    from colossal.core.interface import OptimizerWrapper

__all__ = ["adopt_optimizer_state", "adopt_tensors"]


def adopt_tensors(
    current: Mapping[str, object] | None, loaded: Mapping[str, object]
) -> dict[str, object]:
    """``loaded`` with its tensors in owned memory (other values passed through unchanged).

    A tensor is copied into ``current``'s tensor of the same key when that has the same
    shape, dtype and device, else cloned (contiguous).
    """
    current = current or {}
    adopted: dict[str, object] = {}
    for key, value in loaded.items():
        if not isinstance(value, torch.Tensor):
            adopted[key] = value
            continue
        into = current.get(key)
        if (
            isinstance(into, torch.Tensor)
            and into.shape == value.shape
            and into.dtype == value.dtype
            and into.device == value.device
        ):
            with torch.no_grad():
                into.copy_(value)
            adopted[key] = into
        else:
            adopted[key] = value.detach().clone(memory_format=torch.contiguous_format)
    return adopted


def adopt_optimizer_state(
    optimizer: Optimizer | OptimizerWrapper, state_dict: StateDict
) -> StateDict:
    """``state_dict`` with its tensors in memory ``optimizer`` owns, for its ``load_state_dict``.

    ``state_dict`` has torch's layout (``state`` by parameter index, ``param_groups``).
    Indices map to ``optimizer``'s parameters as torch's ``load_state_dict`` maps them: the
    saved groups' ``params`` in order against the optimizer's groups' parameters. Wrappers
    exposing the torch optimizer as ``.optim`` are unwrapped for the current states.
    """
    inner = optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optim"):
        inner = inner.optim
    by_index: dict[Any, torch.Tensor] = {}
    if isinstance(inner, torch.optim.Optimizer):
        saved_ids = itertools.chain.from_iterable(
            g.get("params", []) for g in state_dict.get("param_groups", []))
        params = itertools.chain.from_iterable(g["params"] for g in inner.param_groups)
        by_index = dict(zip(saved_ids, params, strict=False))
    state = {
        index: adopt_tensors(
            inner.state.get(by_index[index]) if index in by_index else None, values)
        if isinstance(values, Mapping) else values
        for index, values in state_dict.get("state", {}).items()
    }
    return {**state_dict, "state": state}
