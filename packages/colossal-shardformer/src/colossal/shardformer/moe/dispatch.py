"""Expert-parallel dispatch and combine (functional core of :class:`MoeLayer`).

``dispatch`` sorts the kept (token, expert) choices by expert, exchanges the per-expert counts
with one all-to-all and sends the tokens with one uneven all-to-all; the receiving rank
regroups them by local expert. ``combine`` reverses that and sums each token's expert outputs
times its routing weights. Global expert ``e`` lives on rank ``e // (E / ep)`` of the group.
Every rank joins every collective even when it sends or receives no token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from colossal.shardformer.moe.primitives import all_to_all_uneven, exchange_counts
from colossal.shardformer.moe.routing import RoutingResult

__all__ = ["DispatchState", "combine", "dispatch", "ep_size", "moe_apply"]

#: A local expert block: tokens grouped by local expert and the rows per expert -> outputs.
ExpertFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


def ep_size(group: dist.ProcessGroup | None) -> int:
    """Ranks of the expert-parallel ``group``; 1 when None or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


@dataclass
class DispatchState:
    """What :func:`combine` needs to bring expert outputs back to their tokens.

    Attributes:
        token_ids: Source token of each sent row (sorted by global expert).
        weights: Routing weight of each sent row.
        send_splits: Rows sent to each rank of the group (None: no communication).
        recv_splits: Rows received from each rank.
        regroup: Permutation that sorted the received rows by local expert (None: none).
        local_counts: Rows each local expert got.
        num_tokens: Tokens of this rank.
        group: The expert-parallel group.
    """

    token_ids: torch.Tensor
    weights: torch.Tensor
    send_splits: list[int] | None
    recv_splits: list[int] | None
    regroup: torch.Tensor | None
    local_counts: list[int]
    num_tokens: int
    group: dist.ProcessGroup | None


def dispatch(
    x: torch.Tensor, routing: RoutingResult, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, DispatchState]:
    """Send this rank's tokens to their experts.

    Args:
        x: Tokens ``[T, H]``.
        routing: The router's result for ``x``.
        group: Expert-parallel group (None: every expert is local).

    Returns:
        The tokens this rank's experts process, grouped by local expert, and the state for
        :func:`combine` (its ``local_counts`` gives the rows per local expert).
    """
    num_tokens, k = routing.expert_idx.shape
    keep = routing.keep.reshape(-1)
    token_ids = torch.arange(num_tokens, device=x.device).repeat_interleave(k)[keep]
    experts = routing.expert_idx.reshape(-1)[keep]
    weights = routing.weights.reshape(-1)[keep]
    order = torch.argsort(experts, stable=True)
    token_ids, experts, weights = token_ids[order], experts[order], weights[order]
    counts = torch.bincount(experts, minlength=routing.num_experts)
    ep = ep_size(group)
    if ep == 1:
        state = DispatchState(
            token_ids, weights, None, None, None, counts.tolist(), num_tokens, group
        )
        return x[token_ids], state
    if routing.num_experts % ep:
        raise ValueError(f"{routing.num_experts} experts do not split over an ep group of {ep}")
    local = routing.num_experts // ep
    recv = exchange_counts(counts, group)  # [ep, local]
    send_splits = counts.reshape(ep, local).sum(dim=1).tolist()
    recv_splits = recv.sum(dim=1).tolist()
    received = all_to_all_uneven(x[token_ids], recv_splits, send_splits, group)
    labels = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(recv.reshape(-1))
    regroup = torch.argsort(labels, stable=True)
    local_counts = recv.sum(dim=0).tolist()
    state = DispatchState(
        token_ids, weights, send_splits, recv_splits, regroup, local_counts, num_tokens, group
    )
    return received[regroup], state


def combine(expert_out: torch.Tensor, state: DispatchState) -> torch.Tensor:
    """Return expert outputs to their tokens: ``y[t] = sum_j w[t, j] * expert_j(x[t])``.

    Args:
        expert_out: Outputs ``[N, H']`` in the order :func:`dispatch` gave the tokens.
        state: :func:`dispatch`'s state.

    Returns:
        ``[T, H']``; a token with every choice dropped gets zeros.
    """
    if (
        state.regroup is not None
        and state.send_splits is not None
        and state.recv_splits is not None
    ):
        # undo the regrouping: row i of expert_out came from received row regroup[i]
        back = torch.empty_like(expert_out).index_copy(0, state.regroup, expert_out)
        expert_out = all_to_all_uneven(back, state.send_splits, state.recv_splits, state.group)
    weighted = expert_out * state.weights.to(expert_out.dtype)[:, None]
    out = expert_out.new_zeros((state.num_tokens, *expert_out.shape[1:]))
    return out.index_add(0, state.token_ids, weighted)


def moe_apply(
    x: torch.Tensor,
    routing: RoutingResult,
    experts: ExpertFn,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``combine(experts(*dispatch(...)))``: the routed expert mixture of ``x`` ``[T, H]``."""
    tokens, state = dispatch(x, routing, group)
    return combine(experts(tokens, state.local_counts), state)
