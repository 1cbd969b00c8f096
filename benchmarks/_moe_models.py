"""Models of ``benchmarks/moe.py``: one Mixtral-style stack, three ways to run its experts.

A block is ``x + moe(rmsnorm(x))`` (attention-free) where ``moe`` is a top-2 SwiGLU mixture
of ``E`` experts with a linear fp32 gate; the training loss is the mean squared error of the
last RMSNorm's output against a target plus ``AUX_WEIGHT`` times the summed load-balancing
losses (``E / k * sum_e P_e f_e``, the Switch/GShard formula). The three MoE variants hold the
same weights (built from one seed) and compute the same function:

* ``ours``: :class:`colossal.shardformer.moe.MoeLayer` with ``TopKRouter(2, None)`` (dropless)
  and ``GroupedExperts(gated=True)`` sharded over the ep group;
* ``torch_ep``: :class:`TorchEpMoe`, expert parallelism written plainly in torch the way
  torchtitan's ``expert_parallel.py`` dispatches: sort the choices by expert, one
  ``all_to_all_single`` of the per-expert counts, ``all_to_all_single`` of the tokens with
  split sizes (autograd: ``_functional_collectives.all_to_all_single_autograd``, as
  torchtitan), regroup by
  local expert, a loop over the local experts, the reverse permutation and all-to-all, and a
  weighted ``index_add`` back to the tokens;
* ``dp``: :class:`TorchEpMoe` without a group: every rank holds every expert;
* ``ours_loop`` (diagnostic): ``MoeLayer`` with ColossalAI's ``Experts`` of one
  :class:`SwiGLUExpert` module per local expert instead of ``GroupedExperts``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.nn import functional

from colossal.shardformer.moe import Experts, GroupedExperts, MoeLayer, TopKRouter

AUX_WEIGHT = 0.01
TOP_K = 2


class TorchEpMoe(nn.Module):
    """Top-2 SwiGLU mixture with torchtitan-style expert parallelism over ``group``.

    Parameters: ``gate_weight`` ``[E, H]``, ``w1`` ``[E/ep, H, 2F]`` (``[gate | up]``),
    ``w2`` ``[E/ep, F, H]`` (the layout of :class:`GroupedExperts`, so weights copy over).
    """

    def __init__(
        self, hidden: int, ffn: int, experts: int, group: dist.ProcessGroup | None
    ) -> None:
        super().__init__()
        self.group = group
        self.ep = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.num_experts = experts
        self.local = experts // self.ep
        self.hidden = hidden
        self.gate_weight = nn.Parameter(torch.randn(experts, hidden) / math.sqrt(hidden))
        self.w1 = nn.Parameter(torch.randn(self.local, hidden, 2 * ffn) / math.sqrt(hidden))
        self.w2 = nn.Parameter(torch.randn(self.local, ffn, hidden) / math.sqrt(ffn))
        self.aux_loss = torch.zeros(())

    def _experts(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, part in enumerate(torch.split(tokens, counts)):
            gate, up = (part @ self.w1[e]).chunk(2, dim=-1)
            outs.append((functional.silu(gate) * up) @ self.w2[e])
        return torch.cat(outs, dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mixture output of ``x`` ``[T, H]``; sets ``aux_loss``."""
        num_tokens = x.shape[0]
        probs = torch.softmax(functional.linear(x.float(), self.gate_weight.float()), dim=-1)
        top_w, top_i = torch.topk(probs, TOP_K, dim=-1)
        flat = top_i.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        frac = counts.to(probs.dtype) / max(num_tokens, 1)
        mean_prob = probs.sum(dim=0) / max(num_tokens, 1)
        self.aux_loss = self.num_experts / TOP_K * torch.sum(mean_prob * frac)
        order = torch.argsort(flat, stable=True)
        token_of = order // TOP_K
        routed = x[token_of]
        if self.group is None:
            out = self._experts(routed, counts.tolist())
        else:
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=self.group)
            recv_grid = recv_counts.view(self.ep, self.local)
            send_splits = counts.view(self.ep, self.local).sum(dim=1).tolist()
            recv_splits = recv_grid.sum(dim=1).tolist()
            received = funcol.all_to_all_single_autograd(
                routed, recv_splits, send_splits, self.group
            )
            received = funcol.wait_tensor(received)
            labels = torch.arange(self.local).repeat(self.ep).repeat_interleave(recv_grid.view(-1))
            perm = torch.argsort(labels, stable=True)
            expert_out = self._experts(received[perm], recv_grid.sum(dim=0).tolist())
            unperm = expert_out.new_empty(expert_out.shape).index_copy(0, perm, expert_out)
            out = funcol.all_to_all_single_autograd(unperm, send_splits, recv_splits, self.group)
            out = funcol.wait_tensor(out)
        weighted = out * top_w.reshape(-1)[order].to(out.dtype)[:, None]
        return x.new_zeros((num_tokens, self.hidden)).index_add(0, token_of, weighted)


class SwiGLUExpert(nn.Module):
    """One SwiGLU expert ``(silu(x Wg) * x Wu) W2`` with ``w1 = [Wg | Wu]`` ``[H, 2F]``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(hidden, 2 * ffn))
        self.w2 = nn.Parameter(torch.empty(ffn, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The expert's output of ``x`` ``[N, H]``."""
        gate, up = (x @ self.w1).chunk(2, dim=-1)
        out: torch.Tensor = (functional.silu(gate) * up) @ self.w2
        return out


class OursMoe(nn.Module):
    """:class:`MoeLayer` with the aux loss exposed; experts fused (:class:`GroupedExperts`,
    SwiGLU) or, with ``loop``, ColossalAI's :class:`Experts` of :class:`SwiGLUExpert`."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        group: dist.ProcessGroup | None,
        loop: bool = False,
    ) -> None:
        super().__init__()
        block: GroupedExperts | Experts
        if loop:
            block = Experts(SwiGLUExpert, experts, group, hidden=hidden, ffn=ffn)
        else:
            block = GroupedExperts(
                experts, hidden, ffn, group, activation=functional.silu, gated=True
            )
        self.layer = MoeLayer(hidden, experts, TopKRouter(TOP_K, None), block)

    @property
    def aux_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss."""
        loss = self.layer.router.aux_loss
        assert loss is not None
        return loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mixture output of ``x`` ``[T, H]``."""
        out: torch.Tensor = self.layer(x)
        return out


class Stack(nn.Module):
    """``layers`` attention-free Mixtral-style blocks ``x + moe(rmsnorm(x))`` and a norm."""

    def __init__(
        self,
        kind: str,
        hidden: int,
        ffn: int,
        experts: int,
        layers: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        if kind not in ("ours", "ours_loop", "torch"):
            raise ValueError(f"kind must be 'ours', 'ours_loop' or 'torch', got {kind!r}")
        self.norms = nn.ModuleList(nn.RMSNorm(hidden) for _ in range(layers))
        self.moes = nn.ModuleList(
            TorchEpMoe(hidden, ffn, experts, group)
            if kind == "torch"
            else OursMoe(hidden, ffn, experts, group, loop=kind == "ours_loop")
            for _ in range(layers)
        )
        self.final = nn.RMSNorm(hidden)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """MSE of the output against ``target`` plus ``AUX_WEIGHT`` times the aux losses."""
        aux = x.new_zeros(())
        for norm, moe in zip(self.norms, self.moes, strict=True):
            assert isinstance(moe, OursMoe | TorchEpMoe)
            x = x + moe(norm(x))
            aux = aux + moe.aux_loss
        return functional.mse_loss(self.final(x), target) + AUX_WEIGHT * aux

    def expert_params(self) -> list[nn.Parameter]:
        """The expert weights (sharded over ep, or replicated for ``dp``)."""
        out: list[nn.Parameter] = []
        for moe in self.moes:
            out += [p for pair in _expert_pairs(moe) for p in pair]
        return out

    def dense_params(self) -> list[nn.Parameter]:
        """Every other parameter (replicated: gradients all-reduced over the world)."""
        experts = {id(p) for p in self.expert_params()}
        return [p for p in self.parameters() if id(p) not in experts]


def _expert_pairs(moe: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """``(w1, w2)`` of a layer's expert block: one fused pair, or one pair per expert."""
    if isinstance(moe, TorchEpMoe):
        return [(moe.w1, moe.w2)]
    assert isinstance(moe, OursMoe)
    block = moe.layer.experts
    if isinstance(block, GroupedExperts):
        return [(block.w1, block.w2)]
    experts = [e for e in block.experts if isinstance(e, SwiGLUExpert)]
    return [(e.w1, e.w2) for e in experts]


def copy_weights(dst: Stack, src: Stack, experts: int, group_rank: int, ep: int) -> None:
    """Give ``dst`` ``src``'s weights (``src`` holds every expert; ``dst`` its ep slice)."""
    local = experts // ep
    lo = group_rank * local
    with torch.no_grad():
        for d, s in zip(dst.dense_params(), src.dense_params(), strict=True):
            d.copy_(s)
        for dmoe, smoe in zip(dst.moes, src.moes, strict=True):
            ((w1, w2),) = _expert_pairs(smoe)
            pairs = _expert_pairs(dmoe)
            if len(pairs) == 1:
                pairs[0][0].copy_(w1[lo : lo + local])
                pairs[0][1].copy_(w2[lo : lo + local])
            else:
                for i, (d1, d2) in enumerate(pairs):
                    d1.copy_(w1[lo + i])
                    d2.copy_(w2[lo + i])
