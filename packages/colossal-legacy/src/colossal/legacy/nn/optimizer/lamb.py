"""``Lamb``: layer-wise adaptive moments (You et al., 2019), ColossalAI's ``colossalai.nn.Lamb``.

Per parameter ``w`` with gradient ``g`` at step ``t``::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat, v_hat = m, v                         # or / (1 - beta**t) with bias_correction
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * w
    trust = phi(||w||) / ||r||                  # 1 when either norm is 0, or with adam=True
    w = w - lr * trust * r

``phi`` clamps the weight norm to ``[0, clamp_value]`` as in the paper (ColossalAI's Lamb did
not clamp: ``clamp_value=None``). The norms are per parameter tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.optimizer import ParamsT

__all__ = ["Lamb"]


class Lamb(Optimizer):
    """The LAMB optimizer.

    Args:
        params: Parameters or param groups.
        lr: Learning rate.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        weight_decay: Decoupled weight decay, added to the Adam direction before the trust
            ratio.
        adam: Always use a trust ratio of 1 (Adam with decoupled weight decay).
        bias_correction: Divide the moments by ``1 - beta**t`` (the paper's v3 does not).
        clamp_value: Upper bound of the weight norm in the trust ratio (None: no bound).

    Raises:
        ValueError: A negative ``lr``, ``eps``, ``weight_decay`` or ``clamp_value``, or a
            beta outside ``[0, 1)``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        adam: bool = False,
        bias_correction: bool = False,
        clamp_value: float | None = 10.0,
    ) -> None:
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if value < 0.0:
                raise ValueError(f"Lamb: {name}={value} must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lamb: betas[{i}]={beta} must be in [0, 1)")
        if clamp_value is not None and clamp_value <= 0.0:
            raise ValueError(f"Lamb: clamp_value={clamp_value} must be > 0 (or None)")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            adam=adam,
            bias_correction=bias_correction,
            clamp_value=clamp_value,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One LAMB update of every parameter with a gradient.

        Args:
            closure: Re-evaluates the model and returns the loss.

        Raises:
            RuntimeError: A sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self._update(p, p.grad, group, beta1, beta2)
        return loss

    def _update(
        self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], beta1: float,
        beta2: float,
    ) -> None:  # fmt: skip
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        m, v = exp_avg, exp_avg_sq
        if group["bias_correction"]:
            m = m / (1 - beta1 ** state["step"])
            v = v / (1 - beta2 ** state["step"])
        update = m / v.sqrt().add(group["eps"])
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        norm_dtype = torch.promote_types(p.dtype, torch.float32)  # fp16/bf16: norms in fp32
        weight_norm = torch.linalg.vector_norm(p, dtype=norm_dtype)
        if group["clamp_value"] is not None:
            weight_norm = weight_norm.clamp(max=group["clamp_value"])
        update_norm = torch.linalg.vector_norm(update, dtype=norm_dtype)
        if group["adam"]:
            trust = torch.ones((), dtype=norm_dtype, device=p.device)
        else:
            both = (weight_norm > 0) & (update_norm > 0)
            trust = torch.where(both, weight_norm / update_norm.clamp(min=1e-30), 1.0)
        state["trust_ratio"] = trust
        p.add_(update * trust.to(update.dtype), alpha=-group["lr"])
