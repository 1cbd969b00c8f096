"""Router losses and the aux-loss-free bias update (formulas in each docstring)."""

from __future__ import annotations

import torch


def load_balancing_loss(
    probs: torch.Tensor, expert_idx: torch.Tensor, num_experts: int
) -> torch.Tensor:
    """Switch/GShard load-balancing loss, normalised so a uniform router gives 1.

    ``loss = E / k * sum_e P_e * f_e`` where ``P_e = mean_t probs[t, e]`` (mean router
    probability) and ``f_e = mean_t count(expert_idx[t, :] == e)`` (fraction of tokens choosing
    ``e`` among their top ``k``, before any capacity drop). For ``k == 1`` this is Switch's
    ``E * sum_e f_e P_e``; ColossalAI's Top2Router divides by 2 likewise.

    With no token (``T == 0``: an empty batch slice on this rank) the loss is defined as 0
    with a zero gradient rather than the NaN of a mean over nothing; the means divide by
    ``max(T, 1)``, so a rank routing no token still joins the backward.

    Args:
        probs: Router probabilities ``[T, E]`` (softmax of the logits).
        expert_idx: Chosen experts ``[T, k]``.
        num_experts: ``E``.
    """
    k = expert_idx.shape[-1]
    denom = max(probs.shape[0], 1)
    chosen = torch.zeros_like(probs).scatter_add_(
        1, expert_idx, torch.ones_like(expert_idx, dtype=probs.dtype)
    )
    frac = chosen.sum(dim=0) / denom
    mean_prob = probs.sum(dim=0) / denom
    return num_experts / k * torch.sum(mean_prob * frac)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``mean_t (logsumexp_e logits[t, e]) ** 2``; 0 when ``T == 0``."""
    return torch.logsumexp(logits.float(), dim=-1).square().sum() / max(logits.shape[0], 1)


def update_balance_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step (DeepSeek-V3), in place on ``bias``.

    ``bias += rate * sign(mean(load) - load)``: an overloaded expert's selection bias drops by
    ``rate``, an underloaded one's rises, one at the mean keeps its bias.

    Args:
        bias: Per-expert selection bias ``[E]`` (added to the scores for top-k choice only).
        load: Tokens routed to each expert ``[E]`` this step.
        rate: The update speed ``gamma``.

    Returns:
        ``bias``.
    """
    load = load.to(bias.dtype)
    with torch.no_grad():
        bias.add_(rate * torch.sign(load.mean() - load))
    return bias
