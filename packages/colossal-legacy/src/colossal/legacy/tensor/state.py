"""State dicts of ColoTensor models: whole tensors out, plain whole tensors in.

A ColoTensor model's ``state_dict()`` holds its DTensor parameters (each rank its part), which
Colossal's checkpoint IO saves as whole tensors through the DTensor adapter of the
sharded-state protocol (``colossal.core.DTensorShard``): ``CheckpointIO().save_model(model,
path)`` or the Booster's ``save_model`` writes files a plain model loads, and their
``load_model`` reads each rank's part only. Here:

* :func:`full_state_dict`: the whole tensors as plain CPU tensors, on every rank (collective),
  for ``torch.save`` or a plain model's ``load_state_dict``;
* :func:`accept_plain_state`: ``model.load_state_dict(plain_state)`` takes the whole tensors of
  a plain model's state dict, each rank keeping its part (no communication; installed by
  ``attach_colo_io``, so by ``ColoInitContext``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["accept_plain_state", "full_state_dict"]

_ACCEPTS = "_colo_accepts_plain_state"


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor gathered whole, as plain CPU tensors.

    Collective: every rank of the parameters' process group must call it.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = whole.detach().cpu()
    return out


def _slice_plain(
    module: nn.Module,
    state_dict: dict[str, object],
    prefix: str,
    *args: object,
) -> None:
    """Load pre-hook: each plain whole tensor meant for a DTensor becomes this rank's part.

    Raises:
        ValueError: The plain tensor's shape is not the DTensor's global shape.
    """
    head = prefix.rstrip(".")
    targets: dict[str, torch.Tensor] = dict(
        module.named_parameters(prefix=head, remove_duplicate=False)
    )
    targets.update(module.named_buffers(prefix=head, remove_duplicate=False))
    for key, target in targets.items():
        value = state_dict.get(key)
        if not isinstance(target, DTensor) or not isinstance(value, torch.Tensor):
            continue
        if isinstance(value, DTensor):
            continue
        if value.shape != target.shape:
            raise ValueError(
                f"state_dict[{key!r}] has shape {tuple(value.shape)}, the model's tensor "
                f"{tuple(target.shape)}: load the state dict of the same model (whole tensors)"
            )
        state_dict[key] = distribute_tensor(
            value.to(device=target.device, dtype=target.dtype),
            target.device_mesh,
            target.placements,
            src_data_rank=None,  # every rank holds the whole tensor: slice, do not scatter
        )


def accept_plain_state(module: nn.Module) -> nn.Module:
    """Let ``module.load_state_dict`` take plain whole tensors for its DTensors; idempotent."""
    if not getattr(module, _ACCEPTS, False):
        module.register_load_state_dict_pre_hook(_slice_plain)
        setattr(module, _ACCEPTS, True)
    return module
