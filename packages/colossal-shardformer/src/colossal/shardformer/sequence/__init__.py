"""Sequence parallelism: the layer stack runs on sequence shards.

Modes (``ShardConfig.sequence_parallelism_mode``): ``"split_gather"`` (Megatron SP in the
tensor-parallel group; ``"ring"`` runs as it), ``"all_to_all"`` (Ulysses) and
``"ring_attn"`` (ring attention, zigzag layout) on their own group. Everything before and
after the stack runs as without sequence parallelism; hooks split the hidden states at the
stack's entry and gather them at its exit. Parameters that see only a shard get partial
gradients: call :class:`SequenceParallelGradSync` after the backward.
"""

from colossal.shardformer.sequence.apply import apply_sequence_parallelism
from colossal.shardformer.sequence.grad_sync import (
    SequenceParallelGradSync,
    mark_partial_grad,
    partial_grad_group,
)
from colossal.shardformer.sequence.layout import (
    LAYOUTS,
    check_sequence_length,
    gather_sequence,
    split_sequence,
    token_indices,
)
from colossal.shardformer.sequence.stack_hooks import (
    SEQUENCE_KWARGS,
    SequenceParallelState,
    get_sequence_state,
    install_stack_hooks,
    slice_sequence_kwargs,
)

__all__ = [
    "LAYOUTS",
    "SEQUENCE_KWARGS",
    "SequenceParallelGradSync",
    "SequenceParallelState",
    "apply_sequence_parallelism",
    "check_sequence_length",
    "gather_sequence",
    "get_sequence_state",
    "install_stack_hooks",
    "mark_partial_grad",
    "partial_grad_group",
    "slice_sequence_kwargs",
    "split_sequence",
    "token_indices",
]
