"""``split_gather``: Megatron sequence parallelism inside the tensor-parallel group.

Between the parallel linears of the layer stack (norms, dropout, residual adds) every rank
holds its contiguous slice of the sequence instead of the whole, replicated sequence:

* the stack's entry keeps this rank's slice, its exit all-gathers the sequence
  (:mod:`~colossal.shardformer.sequence.stack_hooks`);
* each tensor-parallel region entry (the attention and MLP blocks hooked by
  ``enter_tp_region``) and every column-parallel linear inside the stack not fed by one
  all-gathers the sequence (backward: reduce-scatter), in place of Megatron's ``f``;
* every row-parallel linear inside the stack reduce-scatters its partial output along the
  sequence (backward: all-gather), in place of the all-reduce ``g``.

Per layer and rank that is two all-gathers and two reduce-scatters of ``batch * seq * hidden``
elements forward, the same backward: the all-reduce volume of tensor parallelism, with the
activations between the linears ``1 / P`` the size. Modules outside the stack (vocabulary
embedding, LM head) keep their tensor-parallel behaviour. Parameters inside the stack that are
not split by tensor parallelism (norms, row-parallel biases) see only this rank's tokens:
they are marked for :class:`~colossal.shardformer.sequence.grad_sync.SequenceParallelGradSync`.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import shard_spec
from colossal.shardformer.layer.dropout import DropoutForParallelInput, DropoutForReplicatedInput
from colossal.shardformer.layer.linear import Linear1D_Col, Linear1D_Row
from colossal.shardformer.layer.region import has_tp_region_entry, set_region_sequence_parallel
from colossal.shardformer.sequence.grad_sync import mark_partial_grad
from colossal.shardformer.sequence.stack_hooks import SequenceParallelState, install_stack_hooks

__all__ = ["install_split_gather"]

logger = logging.getLogger(__name__)

_RANK_STRIDE = 1_000_003  # the per-rank seed offset of DropoutForParallelInput


def _sees_whole_sequence(module: nn.Module) -> bool:
    """A replicated module fed by a column-parallel output (``ReplicatedGradAllReduce``).

    It reads the gathered sequence (this rank's heads) and already sums its gradient over the
    tensor-parallel group, so its gradient is complete.
    """
    return hasattr(module, "process_group") and not isinstance(
        module, (Linear1D_Col, Linear1D_Row)
    )


def _switch_dropout(module: DropoutForReplicatedInput) -> None:
    """Make a replicated-input dropout draw per-rank masks: its input is now a sequence shard."""
    module.seed = module.seed + module.tp_rank * _RANK_STRIDE
    module._generators.clear()
    module.__class__ = DropoutForParallelInput  # type: ignore[assignment]  # same state, per-rank masks


def install_split_gather(
    model: nn.Module, layers: nn.ModuleList, group: ProcessGroup | None
) -> None:
    """Switch ``model``'s layer stack to Megatron sequence parallelism over ``group``.

    Args:
        model: The tensor-parallel model (sharded by the policy already).
        layers: Its held layer stack.
        group: The tensor-parallel group (the sequence is split over it).

    Raises:
        ValueError: A column-parallel linear inside the stack gathers its output, or a
            row-parallel one takes a replicated input (neither fits a sequence-sharded
            stack), or the stack has no parallel linear (the policy did not shard it).
    """
    state = SequenceParallelState(group=group, layout="contiguous", mode="split_gather")
    switched = 0
    for name, module in layers.named_modules():
        if isinstance(module, Linear1D_Col):
            if module.gather_output:
                raise ValueError(
                    f"split_gather: {name} ({type(module).__name__}) inside the layer stack "
                    "gathers its output; sequence parallelism needs gather_output=False there"
                )
            module.sequence_parallel = state
            switched += 1
        elif isinstance(module, Linear1D_Row):
            if not module.parallel_input:
                raise ValueError(
                    f"split_gather: {name} ({type(module).__name__}) inside the layer stack "
                    "takes a replicated input; sequence parallelism needs parallel_input=True"
                )
            module.sequence_parallel = state
            switched += 1
        elif isinstance(module, DropoutForReplicatedInput):
            _switch_dropout(module)
        if has_tp_region_entry(module):
            set_region_sequence_parallel(module, state)
    if switched == 0:
        raise ValueError(
            f"split_gather: {type(model).__name__}'s layer stack has no tensor-parallel linear; "
            "split_gather needs tensor parallelism of the layers (enable_tensor_parallelism "
            "and a policy that shards them), or use 'all_to_all' / 'ring_attn'"
        )
    partial = 0
    for module in layers.modules():
        if _sees_whole_sequence(module):
            continue
        for param in module.parameters(recurse=False):
            if shard_spec(param) is None:
                mark_partial_grad(param, group)
                partial += 1
    install_stack_hooks(model, layers, state, slice_kwargs=False)
    logger.info(
        "%s: split_gather over %d ranks, %d parallel linears switched, %d parameters with "
        "partial gradients (sum them with SequenceParallelGradSync)",
        type(model).__name__,
        state.size,
        switched,
        partial,
    )
