"""FusedAdam: a multi-tensor Adam/AdamW for accelerator params (Triton)."""

from __future__ import annotations

import torch
from torch.optim.optimizer import ParamsT

from colossal.kernels.optim._base import AdamBase, AdamFn
from colossal.kernels.registry import REGISTRY


class FusedAdam(AdamBase):
    """Adam/AdamW updating all params of a group with one Triton multi-tensor launch per dtype.

    Same ``step(div_scale=...)`` contract, working copies and state dict as
    :class:`~colossal.kernels.CPUAdam`. Without Triton (or on the CPU) the update runs in
    plain torch ops. Mirrors ColossalAI's ``FusedAdam``.

    Args:
        params: Params or param groups (fp32).
        lr: Learning rate.
        bias_correction: Apply Adam's bias correction.
        betas: Moment decay rates.
        eps: Denominator term.
        adamw_mode: Decoupled weight decay (AdamW) when true, L2 (Adam) otherwise.
        weight_decay: Weight decay.
        amsgrad: Not supported (must be ``False``).
        set_grad_none: Accepted for compatibility (``zero_grad`` sets grads to ``None``).

    Raises:
        ValueError: ``amsgrad=True``.
    """

    def __init__(
        self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adamw_mode: bool = True,
        weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedAdam does not support amsgrad=True; use torch.optim.AdamW")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=adamw_mode)
        self.set_grad_none = set_grad_none

    def _kernel_for(self, device: torch.device) -> AdamFn:
        return REGISTRY.get("fused_adam", device)
