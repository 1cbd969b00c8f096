"""The seeds' Gemini entry points (``GeminiDDP``, ``GeminiAdamOptimizer``) on colossal-gemini.

The seeds' placement policies map onto ours:

=========  =================================================================
``cuda``   everything on the device (static, nothing offloaded)
``cpu``    parameters and optimizer states on the host (static, all offloaded)
``const``  parameters on the device, optimizer states on the host (static)
``auto``   the memory tracer decides (auto)
=========  =================================================================
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from colossal.gemini import GeminiDDP as _GeminiDDP
from colossal.gemini import GeminiOptimizer
from colossal.kernels import HybridAdam
from colossal.legacy.tensor.gemini_route import plain_for_gemini

__all__ = ["PLACEMENTS", "GeminiAdamOptimizer", "GeminiDDP", "placement_arguments"]

#: The seeds' placement policy -> GeminiDDP arguments.
PLACEMENTS: Mapping[str, Mapping[str, object]] = {
    "cuda": {"placement_policy": "static", "offload_optim_frac": 0.0, "offload_param_frac": 0.0},
    "cpu": {"placement_policy": "static", "offload_optim_frac": 1.0, "offload_param_frac": 1.0},
    "const": {"placement_policy": "static", "offload_optim_frac": 1.0, "offload_param_frac": 0.0},
    "auto": {"placement_policy": "auto"},
    "static": {"placement_policy": "static"},
}


def placement_arguments(placement_policy: str) -> dict[str, object]:
    """GeminiDDP keyword arguments for one of the seeds' placement policies.

    Raises:
        ValueError: An unknown policy (the message lists them).
    """
    if placement_policy not in PLACEMENTS:
        raise ValueError(
            f"placement_policy={placement_policy!r} is not one of {sorted(PLACEMENTS)} "
            "('cuda': all on the device, 'cpu': all offloaded, 'const': optimizer states "
            "offloaded, 'auto': decided by the memory tracer)"
        )
    return dict(PLACEMENTS[placement_policy])


class GeminiDDP(_GeminiDDP):
    """colossal-gemini's ``GeminiDDP`` with the seeds' constructor.

    Args:
        module: The model.
        device: Accepted for compatibility: the accelerator decides the device.
        placement_policy: ``'cuda'``, ``'cpu'``, ``'const'`` or ``'auto'`` (see the module
            docstring); ours (``'static'``) too.
        pin_memory: Pin host tensors.
        force_outputs_fp32: Cast floating outputs to fp32.
        strict_ddp_mode: Accepted (every parameter is always managed by the chunks).
        search_range_mb: Chunk-size search range (2**20 elements).
        hidden_dim: Chunk-size search step.
        min_chunk_size_mb: Smallest searched chunk size (2**20 elements).
        **kwargs: Any other colossal-gemini ``GeminiDDP`` argument (``precision``...).

    A ColoTensor model (``colossalai.tensor``) is taken at tp degree 1 (its parameters become
    plain, sharded over the ProcessGroup's dp ranks) and refused naming the supported routes
    at tp > 1 (:mod:`colossal.legacy.tensor.gemini_route`).
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str | None = None,
        placement_policy: str = "cuda",
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        search_range_mb: float = 32,
        hidden_dim: int | None = None,
        min_chunk_size_mb: float = 32,
        **kwargs: object,
    ) -> None:
        merged = {**placement_arguments(placement_policy), **kwargs}
        # a ColoTensor model (colossalai.tensor): plain parameters at tp 1, refused at tp > 1
        dp_group = plain_for_gemini(module)
        if dp_group is not None:
            merged.setdefault("process_group", dp_group)
        super().__init__(
            module,
            pin_memory=pin_memory,
            force_outputs_fp32=force_outputs_fp32,
            strict_ddp_mode=strict_ddp_mode,
            search_range_m=search_range_mb,
            hidden_dim=hidden_dim,
            min_chunk_size_m=min_chunk_size_mb,
            **merged,  # type: ignore[arg-type]
        )


_SCALER_KEYS = (
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
    "max_norm",
    "norm_type",
    "verbose",
)


def GeminiAdamOptimizer(model: _GeminiDDP, **defaults: object) -> GeminiOptimizer:  # noqa: N802
    """``HybridAdam`` over a Gemini model's parameters, wrapped in ``GeminiOptimizer``.

    The seeds' ``GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5)``: the loss-scaler
    and clipping keywords go to ``GeminiOptimizer``, the rest to ``HybridAdam``.
    """
    wrapper = {k: defaults.pop(k) for k in list(defaults) if k in _SCALER_KEYS}
    optim = HybridAdam(model.parameters(), **defaults)  # type: ignore[arg-type]
    return GeminiOptimizer(optim, model, **wrapper)  # type: ignore[arg-type]
