"""CPUAdam: fused Adam/AdamW for CPU params (C++ AVX-512/AVX2/portable kernel, torch fallback)."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import ParamsT

from colossal.kernels.optim._base import AdamBase, AdamFn
from colossal.kernels.optim._functional import torch_adam_step
from colossal.kernels.registry import REGISTRY


class CPUAdam(AdamBase):
    """Adam/AdamW whose CPU update is one fused, vectorised pass per tensor.

    The pass reads the grad (fp32, fp16 or bf16), divides it by ``div_scale``, updates the fp32
    param, ``exp_avg`` and ``exp_avg_sq``, and writes the updated param into an attached
    fp16/bf16 working copy (:meth:`attach_working_params`). The C++ kernel is built on first
    use and cached; without a compiler the same update runs in plain torch (one warning).
    Params on other devices are updated with plain torch ops (use :class:`HybridAdam` for
    fused GPU updates). Mirrors ColossalAI's ``CPUAdam``.

    Args:
        model_params: Params or param groups (fp32 master params).
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Moment decay rates.
        eps: Denominator term.
        weight_decay: Weight decay.
        adamw_mode: Decoupled weight decay (AdamW) when true, L2 (Adam) otherwise.
        nvme_offload_fraction: Fraction (by elements) of the CPU params' optimizer state kept
            on disk and prefetched asynchronously during the step.
        nvme_offload_dir: Directory for the state files (``None``: the system temp dir).
        nvme_direct_io: Offloaded state IO with ``O_DIRECT`` (``None``: when the filesystem
            supports it; see :class:`~colossal.kernels.optim._base.AdamBase`).
        **defaults: Extra per-group defaults.

    Example:
        >>> master = [torch.nn.Parameter(torch.zeros(4))]
        >>> working = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
        >>> opt = CPUAdam(master, lr=0.1)
        >>> opt.attach_working_params({master[0]: working})
        >>> working.grad = torch.ones(4, dtype=torch.bfloat16) * 1024
        >>> _ = opt.step(div_scale=1024.0)   # master and working are now -0.1
    """

    def __init__(
        self, model_params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
        adamw_mode: bool = True, nvme_offload_fraction: float = 0.0,
        nvme_offload_dir: str | None = None, nvme_direct_io: bool | None = None,
        **defaults: Any,
    ) -> None:
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas,
                         eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                         nvme_offload_fraction=nvme_offload_fraction,
                         nvme_offload_dir=nvme_offload_dir, nvme_direct_io=nvme_direct_io,
                         **defaults)

    def _kernel_for(self, device: torch.device) -> AdamFn:
        if device.type == "cpu":
            return REGISTRY.get("cpu_adam", "cpu")
        return torch_adam_step
