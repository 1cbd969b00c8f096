"""convert_to_amp: one call that wraps model, optimizer and criterion for an AMP mode."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.optim import Optimizer

from colossal.core import OptimizerWrapper
from colossal.legacy.amp.amp_type import AMP_TYPE, parse_amp_mode
from colossal.legacy.amp.naive_amp import NaiveAMPOptimizer, convert_to_naive_amp
from colossal.legacy.amp.torch_amp import TorchAMPOptimizer, convert_to_torch_amp

__all__ = ["AMP_CONFIG_KEYS", "check_amp_config", "convert_to_amp"]


def _keywords(cls: type) -> tuple[str, ...]:
    skip = {"optim", "group"}
    return tuple(n for n in inspect.signature(cls).parameters if n not in skip)


#: The keys ``fp16=dict(mode=..., ...)`` accepts besides ``mode``, per mode.
AMP_CONFIG_KEYS: dict[AMP_TYPE, tuple[str, ...]] = {
    AMP_TYPE.TORCH: _keywords(TorchAMPOptimizer),
    AMP_TYPE.NAIVE: _keywords(NaiveAMPOptimizer),
}


def check_amp_config(mode: object, amp_config: Mapping[str, object] | None) -> AMP_TYPE:
    """The parsed mode, after checking ``amp_config`` holds only that mode's keys.

    Raises:
        ValueError: An unsupported mode (APEX is refused with the supported list) or a key
            the mode does not take (the message lists the ones it does).
    """
    parsed = parse_amp_mode(mode)
    unknown = sorted(set(amp_config or {}) - set(AMP_CONFIG_KEYS[parsed]))
    if unknown:
        raise ValueError(
            f"fp16=dict(mode={parsed}) does not take {unknown}; AMP_TYPE.{parsed.name} takes "
            f"{list(AMP_CONFIG_KEYS[parsed])}"
        )
    return parsed


def convert_to_amp(
    model: nn.Module,
    optimizer: Optimizer | OptimizerWrapper,
    criterion: Callable[..., torch.Tensor] | None = None,
    mode: AMP_TYPE | str = AMP_TYPE.TORCH,
    amp_config: Mapping[str, object] | None = None,
) -> tuple[nn.Module, OptimizerWrapper, Callable[..., torch.Tensor] | None]:
    """Wrap ``model``, ``optimizer`` and ``criterion`` for mixed precision ``mode``.

    Usable alone (without ``initialize``), as in the seeds::

        model, optimizer, criterion = convert_to_amp(model, optimizer, criterion,
                                                     AMP_TYPE.TORCH)

    Then call ``optimizer.backward(loss)`` instead of ``loss.backward()``.

    Args:
        model: The model.
        optimizer: Its optimizer (a torch optimizer, or a plain ``OptimizerWrapper``).
        criterion: The loss function, or None.
        mode: :attr:`AMP_TYPE.TORCH` (autocast + loss scaling) or :attr:`AMP_TYPE.NAIVE`
            (fp16 model + fp32 masters + loss scaling).
        amp_config: The mode's settings (the keys of ``fp16=dict(...)`` besides ``mode``).

    Returns:
        ``(model, optimizer, criterion)``; the criterion is unchanged under NAIVE (the model's
        outputs come back in fp32).

    Raises:
        ValueError: APEX or an unknown mode, or a setting the mode does not take.
        TypeError: ``optimizer`` is neither a torch optimizer nor a plain OptimizerWrapper.
    """
    parsed = check_amp_config(mode, amp_config)
    if type(optimizer) is OptimizerWrapper:
        optimizer = optimizer.unwrap()
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"convert_to_amp needs the torch optimizer (or a plain OptimizerWrapper), got "
            f"{type(optimizer).__name__}"
        )
    config = dict(amp_config or {})
    if parsed is AMP_TYPE.TORCH:
        return convert_to_torch_amp(model, optimizer, criterion, config)
    amp_model, amp_optimizer = convert_to_naive_amp(model, optimizer, config)
    return amp_model, amp_optimizer, criterion
