"""``apply_sequence_parallelism``: the one entry ``ShardFormer.optimize`` calls per model chunk."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from colossal.shardformer.sequence.grad_sync import mark_partial_grad
from colossal.shardformer.sequence.split_gather import install_split_gather
from colossal.shardformer.sequence.stack_hooks import SequenceParallelState, install_stack_hooks
from colossal.shardformer.shard.stack import find_layer_stack

if TYPE_CHECKING:
    from colossal.shardformer.shard.config import ShardConfig

__all__ = ["apply_sequence_parallelism"]

logger = logging.getLogger(__name__)

_ATTENTION_MODULE = "colossal.shardformer.sequence.attention"


def apply_sequence_parallelism(model: nn.Module, config: ShardConfig) -> None:
    """Split ``model``'s layer stack along the sequence as ``config`` asks (in place).

    ``"split_gather"`` / ``"ring"`` (group kind ``"tensor"``): Megatron sequence parallelism
    in the tensor-parallel group (:mod:`~colossal.shardformer.sequence.split_gather`).
    ``"all_to_all"`` / ``"ring_attn"`` (kind ``"attention"``): the sequence-parallel attention
    implementation (``install_sequence_attention``), the stack split in the layout the
    attention asks for (``sequence_layout``: ``"zigzag"`` for causal ring attention, else
    ``"contiguous"``), the per-layer position keyword
    arguments sliced to this rank's tokens, and every parameter of the stack marked for
    :class:`~colossal.shardformer.sequence.grad_sync.SequenceParallelGradSync`.

    Args:
        model: The model (or pipeline chunk), already tensor-parallel when asked.
        config: The shard config; nothing happens when sequence parallelism is off.

    Raises:
        ValueError: The model has no layer stack, or the mode does not fit the model.
        NotImplementedError: The sequence-parallel attention is not available.
    """
    kind = config.sequence_parallel_group_kind
    if kind is None:
        return
    _, layers = find_layer_stack(model)
    group = config.sequence_parallel_group
    if kind == "tensor":
        install_split_gather(model, layers, group)
        return
    mode = config.sequence_parallelism_mode
    assert mode is not None
    try:
        from colossal.shardformer.sequence.attention import (
            install_sequence_attention,
            sequence_layout,
        )
    except ModuleNotFoundError as exc:
        if exc.name != _ATTENTION_MODULE:
            raise
        raise NotImplementedError(
            f"sequence_parallelism_mode={mode!r} needs {_ATTENTION_MODULE}, which this "
            "installation lacks; use 'split_gather' with tensor parallelism"
        ) from exc
    install_sequence_attention(model, config)
    layout = sequence_layout(model, mode)  # ring_attn: zigzag when causal, else contiguous
    state = SequenceParallelState(group=group, layout=layout, mode=mode)
    install_stack_hooks(model, layers, state, slice_kwargs=True)
    for param in layers.parameters():
        mark_partial_grad(param, group)
