"""What ``GeminiDDP`` (the seeds' ``colossalai.nn.parallel.GeminiDDP``) does with ColoTensors.

Colossal's Gemini packs plain parameter payloads into flat chunks and points each parameter's
``.data`` at a view of them; a DTensor parameter cannot be such a view (its payload is wrapped,
its operators run collectives over the tp ranks, and its gradient is a DTensor), so Gemini
does not chunk tensor-parallel ColoTensors. Decided here:

* tp degree 1 (the tutorial on one device, or pure data parallelism): every parameter is the
  whole tensor, so the ColoParameters become plain parameters in place and Gemini shards them
  over the ProcessGroup's dp ranks, as it does a plain model;
* tp degree > 1: refused with a ValueError naming the supported routes (the ColoTensor model's
  own data parallelism over the ProcessGroup's dp dimension with a plain optimizer, or the
  plain model under ``GeminiPlugin(tp_size=...)``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["plain_for_gemini"]


def _refuse(name: str, param: DTensor) -> ValueError:
    mesh = param.device_mesh
    return ValueError(
        f"GeminiDDP cannot chunk the tensor-parallel ColoTensor parameter {name!r} "
        f"(placements {tuple(param.placements)} on mesh {mesh.mesh_dim_names} of shape "
        f"{tuple(mesh.shape)}): Gemini packs plain payloads. Train the ColoTensor model "
        "without the wrapper (a torch optimizer; the ProcessGroup's dp dimension already "
        "averages gradients over its dp ranks), or build the plain model and use "
        "Booster(plugin=GeminiPlugin(tp_size=...)); with ProcessGroup(tp_degree=1) "
        "GeminiDDP takes the model"
    )


def plain_for_gemini(module: nn.Module) -> dist.ProcessGroup | None:
    """Make a tp-1 ColoTensor model's parameters plain, in place; its dp group (else None).

    Returns ``None`` for a model without DTensor parameters (nothing changed).

    Raises:
        ValueError: A parameter is split over, or lies on a mesh with, more than one tp rank.
    """
    named = list(module.named_parameters(remove_duplicate=False))
    dts = [(n, p) for n, p in named if isinstance(p, DTensor)]
    if not dts:
        return None
    for name, param in dts:
        mesh = param.device_mesh
        if mesh.mesh_dim_names != ("dp", "tp") or mesh.size(1) != 1:
            raise _refuse(name, param)
        if any(not isinstance(p, Replicate) for p in param.placements):
            raise _refuse(name, param)
    group = dts[0][1].device_mesh.get_group("dp")
    plain: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for key, value in list(sub._parameters.items()):
            if isinstance(value, DTensor):
                if id(value) not in plain:
                    local = value.to_local().detach()
                    plain[id(value)] = nn.Parameter(local, requires_grad=value.requires_grad)
                sub._parameters[key] = plain[id(value)]
    return group
