"""Model-level settings policies install in ``postprocess``: loss, attention, tied weights."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["install_vocab_parallel_loss", "set_attention_implementation", "tied_parameters"]

logger = logging.getLogger(__name__)


def install_vocab_parallel_loss(model: nn.Module, process_group: ProcessGroup | None) -> None:
    """Make ``model.loss_function`` the vocab-parallel causal LM loss over ``process_group``.

    Use it when the LM head keeps its logits split over the vocabulary
    (``parallel_output=True``): transformers' own loss would see only this rank's columns.

    Raises:
        TypeError: ``model`` has no settable ``loss_function`` (not a transformers model).
    """
    from colossal.shardformer.layer import causal_lm_loss_fn

    if not hasattr(type(model), "loss_function"):
        raise TypeError(
            f"{type(model).__name__} has no loss_function attribute to replace; the "
            "vocab-parallel loss needs a transformers PreTrainedModel"
        )
    model.loss_function = causal_lm_loss_fn(process_group)  # type: ignore[assignment]  # torch's stub: Module attrs are Tensor | Module
    logger.debug("%s: vocab-parallel causal LM loss installed", type(model).__name__)


def set_attention_implementation(model: nn.Module, name: str) -> None:
    """Switch a transformers model (and its submodels) to the attention implementation ``name``.

    Raises:
        TypeError: ``model`` cannot switch attention implementations.
    """
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise TypeError(
            f"{type(model).__name__} has no set_attn_implementation(); flash attention needs a "
            "transformers PreTrainedModel whose attention uses the AttentionInterface"
        )
    setter(name)
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current != name:
        raise TypeError(
            f"{type(model).__name__} kept attention implementation {current!r} instead of "
            f"{name!r}: its attention does not go through transformers' AttentionInterface; "
            "set enable_flash_attention=False for this model"
        )


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one Parameter object (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return [names for names in owners.values() if len(names) > 1]
