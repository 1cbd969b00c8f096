"""Hooks splitting the sequence on the way into the layer stack and gathering it on the way out.

Nothing before or after the stack changes: embeddings, position ids, rotary tables and the
full-length attention mask come from the model's own forward. A forward pre-hook on the first
held layer keeps this rank's tokens of the hidden states (:func:`~colossal.shardformer.
sequence.layout.split_sequence`) and a forward hook on the last held layer gathers them
back (:func:`~colossal.shardformer.sequence.layout.gather_sequence`); a layer may return a
tensor or a tuple whose first element is the hidden state. When a causal LM's head runs on
local tokens (:mod:`~colossal.shardformer.sequence.sharded_head`, state ``local_exit`` and
``local_head``) the exit does not gather.

In the ``"attention"`` modes (``all_to_all``, ``ring_attn``) each layer also gets a pre-hook
slicing the keyword arguments that carry a sequence dim (:data:`SEQUENCE_KWARGS`: the rotary
``(cos, sin)``, ``position_ids``, ``cache_position``) to this rank's tokens; the attention
mask stays full-length for the sequence-parallel attention function.

The :class:`SequenceParallelState` of a model is set on the stack and on every module inside
it (:func:`get_sequence_state`), so an attention function handed a module finds the group,
the layout and the current token positions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from colossal.shardformer.layer._utils import group_rank, group_size
from colossal.shardformer.sequence.layout import (
    check_sequence_length,
    gather_sequence,
    split_sequence,
    token_indices,
)

__all__ = [
    "SEQUENCE_KWARGS",
    "SequenceParallelState",
    "get_sequence_state",
    "install_stack_hooks",
    "slice_sequence_kwargs",
]

logger = logging.getLogger(__name__)

_STATE_ATTR = "_colossal_sequence_state"

SEQUENCE_KWARGS: dict[str, int] = {
    "position_embeddings": -2,  # (cos, sin), each (batch, seq, head_dim)
    "position_ids": -1,  # (batch, seq), or (3, batch, seq) for multimodal rotary
    "cache_position": -1,  # (seq,)
}
"""Per-layer keyword argument -> its sequence dim, sliced in the ``"attention"`` modes."""


@dataclass(eq=False)
class SequenceParallelState:
    """How one model's layer stack is split, and the current forward's shapes.

    Attributes:
        group: The sequence-parallel process group.
        layout: ``"contiguous"`` or ``"zigzag"``.
        mode: The sequence-parallelism mode (``"split_gather"``, ``"all_to_all"``, ...).
        size: Ranks in ``group``.
        rank: This rank in ``group``.
        seq_len: Full sequence length of the current forward (set at the stack's entry).
        batch_size: Batch size of the current forward (unflattens ``(batch * seq, h)``).
        indices: Global positions of this rank's tokens in the current forward.
        local_exit: The stack's output stays on this rank's tokens (no exit gather) when
            :attr:`local_head` is set: the model's LM head and loss run on local tokens
            (:mod:`~colossal.shardformer.sequence.sharded_head`).
        local_head: Set per forward by the sharded head's model hooks (False outside a
            forward of the whole model, so a direct call of the base model gathers).
        handles: The installed hooks.
    """

    group: Any
    layout: str
    mode: str
    size: int = 1
    rank: int = 0
    seq_len: int | None = None
    batch_size: int | None = None
    indices: torch.Tensor | None = None
    local_exit: bool = False
    local_head: bool = False
    handles: list[RemovableHandle] = field(default_factory=list)

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def get_sequence_state(module: nn.Module) -> SequenceParallelState | None:
    """The sequence-parallel state of ``module`` (the stack, a module inside it, or the model)."""
    return getattr(module, _STATE_ATTR, None)


def _hidden_position(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | str | None:
    """Where the hidden states are in a layer call: ``"hidden_states"``, a position, or None."""
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i
    return None


def _slice(value: Any, dim: int, state: SequenceParallelState) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, dim, state) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if value.shape[dim] != state.seq_len:
        return value  # no sequence dim of this forward's length (already local, or a cache)
    assert state.indices is not None
    return value.index_select(dim, state.indices.to(value.device))


def slice_sequence_kwargs(
    kwargs: dict[str, object], state: SequenceParallelState
) -> dict[str, object]:
    """``kwargs`` with the :data:`SEQUENCE_KWARGS` entries cut to this rank's tokens."""
    if state.seq_len is None or state.size == 1:
        return kwargs
    out = dict(kwargs)
    for name, dim in SEQUENCE_KWARGS.items():
        if name in out and out[name] is not None:
            out[name] = _slice(out[name], dim, state)
    return out


def install_stack_hooks(
    model: nn.Module, layers: nn.ModuleList, state: SequenceParallelState, slice_kwargs: bool
) -> SequenceParallelState:
    """Split at the first held layer, gather after the last; optionally slice layer kwargs.

    Args:
        model: The model (it and every module of the stack get ``state``).
        layers: The held layer stack (``find_layer_stack(model)[1]``).
        state: The group and layout; its per-forward fields are filled by the hooks.
        slice_kwargs: Slice :data:`SEQUENCE_KWARGS` for every layer (the ``"attention"``
            modes).

    Returns:
        ``state`` with its hook handles.

    Raises:
        ValueError: The stack already has sequence-parallel hooks, or holds no layer.
    """
    if get_sequence_state(layers) is not None:
        raise ValueError(
            f"{type(model).__name__}'s layer stack already has sequence-parallel hooks; "
            "apply sequence parallelism once per model"
        )
    held = list(layers)
    if not held:
        raise ValueError(f"{type(model).__name__}'s layer stack holds no layer")
    state.size, state.rank = group_size(state.group), group_rank(state.group)

    def enter(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        where = _hidden_position(args, kwargs)
        if where is None:
            raise TypeError(
                f"sequence parallelism: {type(mod).__name__} was called without a hidden-state "
                "tensor to split"
            )
        x = kwargs[where] if isinstance(where, str) else args[where]
        if x.dim() < 2:
            raise ValueError(
                f"sequence parallelism needs (batch, seq, ...) hidden states, got shape "
                f"{tuple(x.shape)}"
            )
        seq_len = int(x.shape[1])
        check_sequence_length(seq_len, state.size, state.layout)
        state.seq_len, state.batch_size = seq_len, int(x.shape[0])
        state.indices = token_indices(seq_len, state.rank, state.size, state.layout, x.device)
        x = split_sequence(x, state.group, state.layout)
        if isinstance(where, str):
            return args, {**kwargs, where: x}
        return (*args[:where], x, *args[where + 1 :]), kwargs

    def slice_layer_kwargs(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, slice_sequence_kwargs(kwargs, state)

    def leave(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        if state.local_exit and state.local_head:
            return output  # the head and loss run on this rank's tokens
        if isinstance(output, torch.Tensor):
            return gather_sequence(output, state.group, state.layout)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (gather_sequence(output[0], state.group, state.layout), *output[1:])
        raise TypeError(
            f"sequence parallelism: {type(mod).__name__} returned {type(output).__name__}; "
            "the last layer must return a tensor or a tuple whose first element is the hidden "
            "states"
        )

    state.handles.append(held[0].register_forward_pre_hook(enter, with_kwargs=True))
    if slice_kwargs:
        for layer in held:
            state.handles.append(
                layer.register_forward_pre_hook(slice_layer_kwargs, with_kwargs=True)
            )
    state.handles.append(held[-1].register_forward_hook(leave, with_kwargs=True))
    setattr(model, _STATE_ATTR, state)
    for module in layers.modules():
        setattr(module, _STATE_ATTR, state)
    logger.debug(
        "%s: %s sequence parallelism over %d ranks (%s layout) on %d layers",
        type(model).__name__,
        state.mode,
        state.size,
        state.layout,
        len(held),
    )
    return state
