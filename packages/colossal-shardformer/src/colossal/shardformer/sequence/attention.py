"""The attention of the ``"attention"`` sequence-parallel modes, behind transformers' interface.

:func:`install_sequence_attention` registers an attention function bound to the
sequence-parallel group (Ulysses for ``"all_to_all"``, ring attention for ``"ring_attn"``)
with transformers' ``AttentionInterface`` under a name of its own, together with the mask
builder of the ``"colossal"`` attention (``AttentionMaskInterface``: the model builds the
full-length mask, a ``[B, S]`` padding mask for plain padded causal batches, else SDPA's),
and switches the model to it. No model code is replaced: the attention modules compute q/k/v
of this rank's tokens (rotary applied with this rank's positions) and call the function.

Refused: families whose attention does not go through the interface (Bloom's ALiBi, or any
model that does not switch implementation), and for Ulysses head counts (after the
tensor-parallel split) that the sequence-parallel size does not divide.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from colossal.shardformer.shard.config import ShardConfig

__all__ = [
    "MODE_LAYOUTS",
    "install_sequence_attention",
    "local_head_counts",
    "sequence_layout",
]

logger = logging.getLogger(__name__)

MODE_LAYOUTS = {"all_to_all": "contiguous", "ring_attn": "zigzag"}
"""The token layout each attention sequence-parallel mode splits a causal model's sequence
with (see :func:`sequence_layout`)."""

_REFUSED = {
    "bloom": "Bloom's ALiBi attention does not go through transformers' AttentionInterface",
}
_names = itertools.count()


def local_head_counts(model: nn.Module, tp_size: int) -> tuple[int, int]:
    """``(query heads, key/value heads)`` of one attention module after the TP split.

    Raises:
        ValueError: The model config names no head count.
    """
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(
            f"{type(model).__name__}'s config has no num_attention_heads; the sequence-parallel "
            "attention needs it"
        )
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads // tp_size, kv // tp_size


def _is_causal(model: nn.Module) -> bool:
    """Whether any attention module of ``model`` is causal (``is_causal``; True if none says)."""
    flags = [
        m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    return any(flags) or not flags


def sequence_layout(model: nn.Module, mode: str) -> str:
    """The token layout ``model``'s sequence is split with in ``mode``.

    ``"contiguous"`` for Ulysses. Ring attention: ``"zigzag"`` for causal models (every rank
    then has the same share of unmasked blocks); ``"contiguous"`` for bidirectional ones
    (BERT, ViT), where every block is visible, contiguous is as balanced and any length
    divisible by the size splits (ViT's patches + [CLS] never split in 2P chunks).

    Raises:
        ValueError: ``mode`` is not an attention sequence-parallel mode.
    """
    if mode not in MODE_LAYOUTS:
        raise ValueError(f"sequence_layout serves the modes {tuple(MODE_LAYOUTS)}, got {mode!r}")
    if mode == "ring_attn" and not _is_causal(model):
        return "contiguous"
    return MODE_LAYOUTS[mode]


def _check_family(model: nn.Module, mode: str) -> None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    reason = _REFUSED.get(str(kind))
    if reason is None and getattr(config, "alibi", False):
        reason = f"{kind} uses ALiBi, which the sequence-parallel attention does not apply"
    if reason is not None:
        raise ValueError(
            f"sequence_parallelism_mode={mode!r} is not supported for {type(model).__name__}: "
            f"{reason}; use sequence_parallelism_mode='split_gather' (with tensor parallelism) "
            "for this model"
        )


def _check_heads(model: nn.Module, config: Any, size: int) -> None:
    tp = config.tensor_parallel_size if config.enable_tensor_parallelism else 1
    heads, kv = local_head_counts(model, tp)
    if heads % size or kv % size:
        raise ValueError(
            f"sequence_parallelism_mode='all_to_all' splits the attention heads over the "
            f"{size} sequence-parallel ranks, but {type(model).__name__} has {heads} query and "
            f"{kv} key/value heads per tensor-parallel rank (tensor-parallel size {tp}); use a "
            f"sequence-parallel size dividing both, or sequence_parallelism_mode='ring_attn'"
        )


def _ulysses(group: Any, size: int, layout: str) -> Any:
    from colossal.shardformer.sequence.layout import token_indices
    from colossal.shardformer.sequence.ulysses import ulysses_attention_forward

    def forward(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        positions = None
        if layout != "contiguous":
            s = query.shape[2] * size
            positions = torch.cat([token_indices(s, r, size, layout) for r in range(size)])
        return ulysses_attention_forward(
            module, query, *args, group=group, positions=positions, **kwargs
        )

    return forward


def install_sequence_attention(model: nn.Module, config: ShardConfig) -> None:
    """Make ``model``'s attention the sequence-parallel attention of ``config``'s mode.

    Args:
        model: A transformers model whose layers run on sequence shards.
        config: The ``ShardConfig`` (mode ``"all_to_all"`` or ``"ring_attn"``).

    Raises:
        ValueError: Another mode, a family that cannot support the mode, or (Ulysses) head
            counts the sequence-parallel size does not divide.
        TypeError: The model's attention does not switch implementation.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from colossal.shardformer.attention import colossal_mask
    from colossal.shardformer.sequence.ring import ring_attention_forward
    from colossal.shardformer.shard.model_hooks import set_attention_implementation

    mode = config.sequence_parallelism_mode
    if mode not in MODE_LAYOUTS:
        raise ValueError(
            f"install_sequence_attention serves the modes {tuple(MODE_LAYOUTS)}, got {mode!r}"
        )
    _check_family(model, mode)
    group = config.sequence_parallel_group
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    layout = sequence_layout(model, mode)
    if mode == "all_to_all":
        _check_heads(model, config, size)
        fn = _ulysses(group, size, layout)
    else:
        fn = functools.partial(ring_attention_forward, group=group, layout=layout)
    name = f"colossal_{mode}_{next(_names)}"
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, colossal_mask)
    try:
        set_attention_implementation(model, name)
    except TypeError as exc:
        raise TypeError(
            f"sequence_parallelism_mode={mode!r} needs {type(model).__name__}'s attention to "
            "go through transformers' AttentionInterface, and it does not switch "
            f"implementation ({exc}); use sequence_parallelism_mode='split_gather' for it"
        ) from exc
    logger.info(
        "%s: %s attention over %d sequence-parallel ranks (%s layout) as %r",
        type(model).__name__,
        mode,
        size,
        layout,
        name,
    )
