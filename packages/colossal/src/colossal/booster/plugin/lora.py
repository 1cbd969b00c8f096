"""LoRA adapters (Hugging Face ``peft``) for the Booster's plugins.

:func:`enable_lora` adds adapters to a model before ``boost``: the base weights are frozen
(``requires_grad=False``) and only the adapter weights train. Build the optimizer after it,
from ``model.parameters()``: optimizers skip parameters that never get a gradient, and
``LowLevelZeroOptimizer`` neither shards nor keeps master weights for frozen ones.
:func:`save_lora_as_pretrained` writes the adapter as ``peft`` does (``adapter_config.json``
plus ``adapter_model.safetensors`` or ``adapter_model.bin``) from full tensors (FSDP2's
DTensor shards are gathered first, the hybrid plugin's pipeline stages exchanged), so
``peft.PeftModel.from_pretrained(base, directory)`` loads it.

``peft`` is imported only when these functions run (``pip install "colossal[lora]"``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from colossal.booster.plugin.base import find_module
from colossal.core import ModelWrapper
from colossal.core.comm import barrier

if TYPE_CHECKING:
    from peft import PeftConfig

    from colossal.checkpoint_io import CheckpointIO

logger = logging.getLogger(__name__)

__all__ = ["enable_lora", "save_lora_as_pretrained"]


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is a declared extra
        raise ImportError(
            "LoRA needs the peft package: pip install 'colossal[lora]' (or pip install peft)"
        ) from exc
    return peft


def enable_lora(
    model: nn.Module,
    pretrained_dir: str | None = None,
    lora_config: PeftConfig | None = None,
    bnb_quantization_config: object = None,
    quantize: bool = False,
) -> nn.Module:
    """Add LoRA adapters to ``model`` (call before ``boost``).

    Args:
        model: The plain (not boosted) model.
        pretrained_dir: A directory saved by ``save_lora_as_pretrained`` or
            ``PeftModel.save_pretrained``: its adapter is loaded, trainable.
        lora_config: A ``peft.LoraConfig`` (or another ``peft.PeftConfig``) for new adapters;
            ignored (with a warning) when ``pretrained_dir`` is given.
        bnb_quantization_config: Refused (needs bitsandbytes and CUDA).
        quantize: Refused when True (needs bitsandbytes and CUDA).

    Returns:
        The ``peft.PeftModel``: boost it, and build the optimizer from its parameters.

    Raises:
        ValueError: Quantization is asked, neither ``lora_config`` nor ``pretrained_dir`` is
            given, ``pretrained_dir`` is not a directory, or the model is boosted already or
            has adapters already.
        TypeError: ``lora_config`` is not a peft config.
    """
    if quantize or bnb_quantization_config is not None:
        raise ValueError(
            "enable_lora(quantize=True / bnb_quantization_config=...) (QLoRA) needs "
            "bitsandbytes and CUDA, which Colossal does not support; pass quantize=False and "
            "bnb_quantization_config=None to train LoRA adapters on full-precision weights"
        )
    if isinstance(model, ModelWrapper):
        raise ValueError(
            f"enable_lora got a boosted model ({type(model).__name__}); call "
            "booster.enable_lora(model, ...) first and boost the model it returns"
        )
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        raise ValueError(
            "the model has peft adapters already; pass the base model to enable_lora (or use "
            "the PeftModel as it is)"
        )
    if pretrained_dir is not None:
        if not os.path.isdir(pretrained_dir):
            raise ValueError(
                f"pretrained_dir={pretrained_dir!r} is not a directory; give one written by "
                "booster.save_lora_as_pretrained (or PeftModel.save_pretrained)"
            )
        if lora_config is not None:
            logger.warning(
                "enable_lora: lora_config is ignored, the adapter config of %s is used",
                pretrained_dir,
            )
        return peft.PeftModel.from_pretrained(model, pretrained_dir, is_trainable=True)
    if lora_config is None:
        raise ValueError(
            "enable_lora needs lora_config=peft.LoraConfig(target_modules=[...], ...) for new "
            "adapters, or pretrained_dir=... to load saved ones"
        )
    if not isinstance(lora_config, peft.PeftConfig):
        raise TypeError(f"lora_config must be a peft.LoraConfig, got {type(lora_config).__name__}")
    return peft.get_peft_model(model, lora_config)


def _full(value: Any) -> Any:
    """The full CPU tensor of a DTensor shard (collective); others pass through."""
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _adapter_state(
    peft_model: nn.Module, state: dict[str, Any] | None = None, full: Any = _full
) -> dict[str, Any]:
    """The state dict entries ``peft`` saves, as full tensors, under their model names.

    ``get_peft_model_state_dict`` chooses (and renames) the entries; they are matched back
    to their model names by identity so that only they are gathered (``full``, in the same
    order on every rank). ``state``: the model's entries when not ``peft_model.state_dict()``.
    """
    peft = _peft()
    state = peft_model.state_dict() if state is None else state
    chosen = peft.get_peft_model_state_dict(peft_model, state_dict=state)
    by_id = {id(v): k for k, v in state.items()}
    names: list[str] = []
    for value in chosen.values():
        name = by_id.get(id(value))
        if name is None:  # a value peft built itself: gather everything it may read
            names = list(state)
            break
        names.append(name)
    return {name: full(state[name]) for name in names}


def save_lora_as_pretrained(
    model: nn.Module,
    checkpoint: str,
    use_safetensors: bool = False,
    group: dist.ProcessGroup | None = None,
    reader: CheckpointIO | None = None,
) -> None:
    """Save the LoRA adapter of a boosted model as a peft directory (collective).

    Args:
        model: A model boosted after ``enable_lora``.
        checkpoint: The directory (created if needed; other files in it are kept).
        use_safetensors: Write ``adapter_model.safetensors`` instead of ``adapter_model.bin``.
        group: The ranks that save together; its first rank writes.
        reader: The plugin's checkpoint IO when the model's tensors must be read through it
            (``Plugin.lora_reader``: Gemini's chunks); None reads them from the model.

    Raises:
        ValueError: The model has no LoRA adapter.
    """
    peft = _peft()
    source = getattr(model, "lora_source", None)  # a hybrid-parallel model: see hybrid_lora
    peft_model = find_module(model, peft.PeftModel) if source is None else source.peft_model
    if peft_model is None:
        raise ValueError(
            f"save_lora_as_pretrained: {type(model).__name__} has no LoRA adapter; call "
            "booster.enable_lora(model, lora_config=...) before boost"
        )
    if source is not None:
        state = source.adapter_state()
    elif reader is None:
        state = _adapter_state(peft_model)
    else:
        state = _adapter_state(peft_model, reader.model_state(model),
                               lambda v: _full(reader.to_full(v)))
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    if not distributed or dist.get_rank(group) == 0:
        peft_model.save_pretrained(checkpoint, safe_serialization=use_safetensors, state_dict=state)
        logger.info("saved the LoRA adapter (%d tensors) to %s", len(state), checkpoint)
    if distributed:
        barrier(group)
