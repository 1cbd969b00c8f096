"""``ComputeSpec.set_output_replicate``: whether a TP1D module's output is made whole over tp.

The seeds' TP1D linear gathers a column-split output (and reduces a row-split one) unless
its weight's compute spec says ``set_output_replicate(False)``, which keeps the output split
for the next layer (the tutorial's ``mlp.c_fc``). Here a forward hook on each module that
holds a ColoParameter with a TP1D compute spec lays a DTensor output whose tp placement is not
``Replicate()`` (``Shard`` or ``Partial``) out as ``Replicate()`` over tp, when every such
parameter of the module says ``output_replicate`` (the default); otherwise the output keeps
DTensor's placement. Differentiable (DTensor's ``redistribute``); the dp placement is kept.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.utils._pytree import tree_map

from colossal.legacy.tensor.compute_spec import ComputePattern, ComputeSpec

__all__ = ["hook_output_specs", "replicates_output"]

_OUT_HOOKED = "_colo_output_hooked"


def _tp1d_specs(module: nn.Module) -> list[ComputeSpec]:
    """The TP1D compute specs of ``module``'s own parameters."""
    out = []
    for param in module.parameters(recurse=False):
        spec = getattr(param, "compute_spec", None)
        if isinstance(spec, ComputeSpec) and spec.compute_pattern is ComputePattern.TP1D:
            out.append(spec)
    return out


def replicates_output(module: nn.Module) -> bool | None:
    """Whether ``module``'s output is made whole over tp (None: it has no TP1D parameter)."""
    specs = _tp1d_specs(module)
    if not specs:
        return None
    return all(s.output_replicate for s in specs)


def _whole_over_tp(x: object) -> object:
    if not isinstance(x, DTensor) or x.device_mesh.ndim != 2:
        return x
    placements: list[Placement] = list(x.placements)
    if isinstance(placements[1], Replicate):
        return x
    placements[1] = Replicate()
    return x.redistribute(x.device_mesh, placements)


def _after_forward(module: nn.Module, args: object, output: object) -> object:
    """Forward hook: the output whole over tp when the module's specs say so."""
    if replicates_output(module):
        return tree_map(_whole_over_tp, output)
    return output


def hook_output_specs(root: nn.Module) -> None:
    """Register :func:`_after_forward` once on each module under ``root`` with a TP1D param."""
    for module in root.modules():
        if not getattr(module, _OUT_HOOKED, False) and _tp1d_specs(module):
            module.register_forward_hook(_after_forward)
            setattr(module, _OUT_HOOKED, True)
