"""Sequence parallelism: the layer stack runs on sequence shards.

Modes (``ShardConfig.sequence_parallelism_mode``): ``"split_gather"`` (Megatron SP in the
tensor-parallel group; ``"ring"`` runs as it), ``"all_to_all"`` (Ulysses) and
``"ring_attn"`` (ring attention, zigzag layout) on their own group. Everything before and
after the stack runs as without sequence parallelism; hooks split the hidden states at the
stack's entry and gather them at its exit. Parameters that see only a shard get partial
gradients: call :class:`SequenceParallelGradSync` after the backward. In the attention modes
a causal LM's head and loss run on this rank's tokens too (``parallel_output=True``): its
logits are this rank's tokens in layout order (:func:`token_indices`) and its loss is global.
"""

from colossal.shardformer.sequence.apply import apply_sequence_parallelism
from colossal.shardformer.sequence.grad_sync import (
    SequenceParallelGradSync,
    mark_partial_grad,
    partial_grad_group,
    register_partial_grad_hooks,
)
from colossal.shardformer.sequence.layout import (
    LAYOUTS,
    check_sequence_length,
    gather_sequence,
    split_sequence,
    token_indices,
)
from colossal.shardformer.sequence.sharded_head import (
    HEAD_MODES,
    install_sharded_head,
    sequence_parallel_causal_loss,
    sharded_head_mode,
)
from colossal.shardformer.sequence.stack_hooks import (
    SEQUENCE_KWARGS,
    SequenceParallelState,
    get_sequence_state,
    install_stack_hooks,
    slice_sequence_kwargs,
)

try:  # needs transformers' attention interfaces, imported lazily by the module's functions
    from colossal.shardformer.sequence.attention import (
        install_sequence_attention,
        sequence_layout,
    )
except ImportError:  # pragma: no cover - an installation without the attention module
    install_sequence_attention = None  # type: ignore[assignment]
    sequence_layout = None  # type: ignore[assignment]

__all__ = [
    "HEAD_MODES",
    "LAYOUTS",
    "SEQUENCE_KWARGS",
    "SequenceParallelGradSync",
    "SequenceParallelState",
    "apply_sequence_parallelism",
    "check_sequence_length",
    "gather_sequence",
    "get_sequence_state",
    "install_sequence_attention",
    "install_sharded_head",
    "install_stack_hooks",
    "mark_partial_grad",
    "partial_grad_group",
    "register_partial_grad_hooks",
    "sequence_layout",
    "sequence_parallel_causal_loss",
    "sharded_head_mode",
    "slice_sequence_kwargs",
    "split_sequence",
    "token_indices",
]
