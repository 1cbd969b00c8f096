"""Top-k routers with capacity (token dropping) or dropless routing, noise and balancing.

ColossalAI's argument names: ``capacity_factor_train`` / ``capacity_factor_eval``,
``min_capacity``, ``noisy_func`` (applied to the logits in training) and ``drop_tks`` (False:
dropless in evaluation). A capacity factor of None routes dropless.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import comm
from colossal.shardformer.moe.losses import load_balancing_loss, router_z_loss, update_balance_bias

__all__ = ["RoutingResult", "Top1Router", "Top2Router", "TopKRouter", "expert_capacity"]


@dataclass
class RoutingResult:
    """Where each token goes.

    Attributes:
        expert_idx: Chosen global experts ``[T, k]`` (int64).
        weights: Combine weight of each choice ``[T, k]``, zero where dropped.
        keep: Which choices survive the capacity ``[T, k]`` (all True when dropless).
        probs: Router probabilities ``[T, E]``.
        num_experts: ``E``.
    """

    expert_idx: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    probs: torch.Tensor
    num_experts: int

    def load(self) -> torch.Tensor:
        """Choices kept per expert ``[E]`` (int64)."""
        kept = self.expert_idx[self.keep]
        return torch.bincount(kept, minlength=self.num_experts)


def expert_capacity(
    k: int, capacity_factor: float, num_tokens: int, num_experts: int, min_capacity: int
) -> int:
    """ColossalAI's capacity: ``floor(k * cf * T / E)`` rounded up to even, >= ``min_capacity``."""
    capacity = math.floor(k * capacity_factor * num_tokens / num_experts)
    capacity += capacity % 2
    return max(capacity, min_capacity, 1)


def _capacity_keep(expert_idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """First-come keep mask: every token's first choice before any second choice, token order."""
    t, k = expert_idx.shape
    slot_major = expert_idx.t().reshape(-1)  # [k*T]: choice slot major, token minor
    onehot = nn.functional.one_hot(slot_major, num_experts)
    position = (onehot.cumsum(dim=0) - 1).gather(1, slot_major[:, None]).squeeze(1)
    return (position < capacity).reshape(k, t).t()


class TopKRouter(nn.Module):
    """Route each token to its top ``k`` experts of ``softmax(logits)``.

    The router's input is the gate logits ``[T, E]`` (fp32 recommended). After ``forward`` it
    holds ``aux_loss`` (:func:`~colossal.shardformer.moe.losses.load_balancing_loss`),
    ``z_loss`` (:func:`~colossal.shardformer.moe.losses.router_z_loss`) and ``last_load``.

    Args:
        k: Experts per token.
        capacity_factor_train: Capacity factor in training; None: dropless.
        capacity_factor_eval: Capacity factor in evaluation; None: dropless.
        min_capacity: Least capacity of an expert.
        noisy_func: Applied to the logits in training (e.g. :class:`NormalNoiseGenerator`).
        drop_tks: False: dropless in evaluation (ColossalAI).
        num_experts: Needed with ``bias_update_rate`` (size of the bias buffer).
        bias_update_rate: Enables aux-loss-free balancing (DeepSeek-V3): a per-expert bias
            added to the probabilities for the top-k choice only, moved by
            :meth:`update_bias`.
        normalize_weights: Rescale the kept top-k probabilities of a token to sum to 1.
        select_policy: Which tokens an expert over capacity keeps: ``"first"`` (token order)
            or ``"random"`` (a random order of the tokens).
    """

    def __init__(
        self,
        k: int,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
        num_experts: int | None = None,
        bias_update_rate: float | None = None,
        normalize_weights: bool = False,
        select_policy: str = "first",
    ) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"k must be positive, got {k}")
        self.k = k
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.min_capacity = min_capacity
        self.noisy_func = noisy_func
        self.drop_tks = drop_tks
        self.normalize_weights = normalize_weights
        if select_policy not in ("first", "random"):
            raise ValueError(f"select_policy must be 'first' or 'random', got {select_policy!r}")
        self.select_policy = select_policy
        self.bias_update_rate = bias_update_rate
        self.expert_bias: torch.Tensor | None
        if bias_update_rate is not None:
            if num_experts is None:
                raise ValueError("bias_update_rate needs num_experts")
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None

    @property
    def k_value(self) -> int:
        """ColossalAI's name of ``k``."""
        return self.k

    def capacity(self, num_tokens: int, num_experts: int) -> int | None:
        """This mode's capacity per expert for ``num_tokens`` local tokens; None: dropless."""
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        if factor is None or (not self.training and not self.drop_tks):
            return None
        return expert_capacity(self.k, factor, num_tokens, num_experts, self.min_capacity)

    def forward(self, logits: torch.Tensor) -> RoutingResult:
        """Route ``logits`` ``[T, E]``; sets ``aux_loss``, ``z_loss`` and ``last_load``."""
        num_tokens, num_experts = logits.shape
        if self.k > num_experts:
            raise ValueError(f"k={self.k} exceeds the {num_experts} experts")
        self.z_loss = router_z_loss(logits)
        if self.noisy_func is not None and self.training:
            logits = self.noisy_func(logits)
        probs = torch.softmax(logits.float(), dim=-1)
        scores = probs.detach()
        if self.expert_bias is not None:
            scores = scores + self.expert_bias
        expert_idx = torch.topk(scores, self.k, dim=-1).indices
        self.aux_loss = load_balancing_loss(probs, expert_idx, num_experts)
        capacity = self.capacity(num_tokens, num_experts)
        if capacity is None:
            keep = torch.ones_like(expert_idx, dtype=torch.bool)
        else:
            keep = self._keep(expert_idx, num_experts, capacity)
        weights = probs.gather(1, expert_idx) * keep
        if self.normalize_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
        result = RoutingResult(expert_idx, weights, keep, probs, num_experts)
        self.last_load = torch.bincount(expert_idx.reshape(-1), minlength=num_experts)
        return result

    def _keep(self, expert_idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
        if self.select_policy == "first":
            return _capacity_keep(expert_idx, num_experts, capacity)
        order = torch.randperm(expert_idx.shape[0], device=expert_idx.device)
        keep = torch.empty_like(expert_idx, dtype=torch.bool)
        keep[order] = _capacity_keep(expert_idx[order], num_experts, capacity)
        return keep

    def update_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Apply ``bias += rate * sign(mean(load) - load)`` with the last step's load.

        The load (choices per expert before any drop) is summed over ``group`` first so every
        rank moves its bias alike; pass the group the tokens are split over (None: no sum).
        """
        if self.expert_bias is None or self.bias_update_rate is None:
            raise RuntimeError("update_bias needs a router built with bias_update_rate")
        if self.last_load is None:
            raise RuntimeError("update_bias before any forward")
        load = self.last_load.clone()
        if group is not None and dist.is_initialized():
            comm.all_reduce(load, group=group)
        update_balance_bias(self.expert_bias, load, self.bias_update_rate)

    def pop_routing_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss, cleared (ColossalAI's name)."""
        if self.aux_loss is None:
            raise RuntimeError("no routing loss: call the router first")
        loss, self.aux_loss = self.aux_loss, None
        return loss


class Top1Router(TopKRouter):
    """Switch-style top-1 router with ColossalAI's arguments (see :class:`TopKRouter`).

    ``select_policy``: ``"first"`` keeps the first tokens up to the capacity, ``"random"`` a
    random subset of them.
    """

    def __init__(
        self,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        select_policy: str = "first",
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
    ) -> None:
        super().__init__(
            1,
            capacity_factor_train,
            capacity_factor_eval,
            min_capacity,
            noisy_func,
            drop_tks,
            select_policy=select_policy,
        )


class Top2Router(TopKRouter):
    """GShard-style top-2 router with ColossalAI's arguments (see :class:`TopKRouter`)."""

    def __init__(
        self,
        capacity_factor_train: float | None = 1.25,
        capacity_factor_eval: float | None = 2.0,
        min_capacity: int = 4,
        noisy_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        drop_tks: bool = True,
    ) -> None:
        super().__init__(
            2, capacity_factor_train, capacity_factor_eval, min_capacity, noisy_func, drop_tks
        )
