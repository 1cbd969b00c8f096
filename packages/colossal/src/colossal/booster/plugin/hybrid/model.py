"""The model side of the hybrid-parallel plugin: the wrapper, input casting, tied weights.

Sharding and pointing the optimizer at the sharded parameters live in
:mod:`colossal.booster.plugin.sharding` (shared with Gemini's tensor parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import (
    ModelWrapper,
    Placement,
    Replicate,
    mark_sharded,
    shard_spec,
    whole_shape,
)

if TYPE_CHECKING:
    from colossal.booster.plugin.hybrid.lora import HybridLoraSource

__all__ = ["HybridParallelModel", "cast_floats", "mark_tied"]


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with floating-point tensors (also in dicts, lists, tuples) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(cast_floats(v, dtype) for v in value)
    return value


def mark_tied(pairs: Sequence[tuple[torch.Tensor, ProcessGroup]]) -> None:
    """Record each weight tied across pipeline stages as replicated over its stages.

    The gradient norm then counts it on its first stage only (its copies hold the same
    gradient after the schedule sums them); its other placements (a tensor-parallel block)
    are kept.
    """
    for param, group in pairs:
        spec = shard_spec(param)
        own = tuple(p for p in spec.placements if p.axis != "pp") if spec is not None else ()
        mark_sharded(param, (Placement("pp", Replicate(), group), *own), whole_shape(param))


class HybridParallelModel(ModelWrapper):
    """This rank's sharded model (or its pipeline chunks as an ``nn.ModuleList``).

    Calling it runs the whole forward when there is no pipeline; floating-point inputs are
    cast to the model's dtype. Under a pipeline, run batches with
    ``booster.execute_pipeline``.

    Args:
        module: The sharded model, or this stage's chunks.
        dtype: The training precision.
        pipelined: Whether ``module`` is a pipeline stage.

    Attributes:
        lora_source: Set (by the plugin) only on a boosted ``PeftModel``: its full adapter.
    """

    lora_source: HybridLoraSource

    def __init__(self, module: nn.Module, dtype: torch.dtype, pipelined: bool) -> None:
        super().__init__(module)
        self.dtype = dtype
        self.pipelined = pipelined

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, inputs cast (no pipeline only).

        Raises:
            RuntimeError: The model is a pipeline stage.
        """
        if self.pipelined:
            raise RuntimeError(
                "this model is a pipeline stage; run batches with booster.execute_pipeline("
                "data_iter, model, criterion, optimizer)"
            )
        return self.module(*cast_floats(args, self.dtype), **cast_floats(kwargs, self.dtype))
