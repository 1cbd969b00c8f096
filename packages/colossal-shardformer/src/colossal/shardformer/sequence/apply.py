"""``apply_sequence_parallelism``: the one entry ``ShardFormer.optimize`` calls per model chunk."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from colossal.shardformer.sequence.grad_sync import mark_partial_grad
from colossal.shardformer.sequence.sharded_head import (
    install_sharded_head,
    install_tied_embedding_grad_scale,
    sharded_head_mode,
)
from colossal.shardformer.sequence.split_gather import install_split_gather
from colossal.shardformer.sequence.stack_hooks import SequenceParallelState, install_stack_hooks
from colossal.shardformer.shard.stack import find_layer_stack

if TYPE_CHECKING:
    from colossal.shardformer.policies.base_policy import Policy
    from colossal.shardformer.shard.config import ShardConfig

__all__ = ["apply_sequence_parallelism"]

logger = logging.getLogger(__name__)

_ATTENTION_MODULE = "colossal.shardformer.sequence.attention"


def apply_sequence_parallelism(
    model: nn.Module, config: ShardConfig, policy: Policy | None = None
) -> None:
    """Split ``model``'s layer stack along the sequence as ``config`` asks (in place).

    ``"split_gather"`` / ``"ring"`` (group kind ``"tensor"``): Megatron sequence parallelism
    in the tensor-parallel group (:mod:`~colossal.shardformer.sequence.split_gather`).
    ``"all_to_all"`` / ``"ring_attn"`` (kind ``"attention"``): the sequence-parallel attention
    implementation (``install_sequence_attention``), the stack split in the layout the
    attention asks for (``sequence_layout``: ``"zigzag"`` for causal ring attention, else
    ``"contiguous"``), the per-layer position keyword
    arguments sliced to this rank's tokens, and every parameter of the stack marked for
    :class:`~colossal.shardformer.sequence.grad_sync.SequenceParallelGradSync`. A causal
    LM with ``config.parallel_output`` (or the pipeline chunk holding its head) also runs its
    LM head and loss on this rank's tokens and returns this rank's logits
    (:mod:`~colossal.shardformer.sequence.sharded_head`); other heads get the gathered
    sequence as without sequence parallelism.

    Args:
        model: The model (or pipeline chunk), already tensor-parallel when asked.
        config: The shard config; nothing happens when sequence parallelism is off.
        policy: The policy sharding ``model`` (its ``loss`` attribute, when it has one, says
            whether the head is a causal LM's); None decides from the model.

    Raises:
        ValueError: The model has no layer stack, or the mode does not fit the model.
        NotImplementedError: The sequence-parallel attention is not available.
    """
    kind = config.sequence_parallel_group_kind
    if kind is None:
        return
    stack_path, layers = find_layer_stack(model)
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
    head_mode = sharded_head_mode(model, config, stack_path, policy)
    if head_mode is not None:
        install_sharded_head(model, state, head_mode, stack_path)
    install_tied_embedding_grad_scale(model, state)
