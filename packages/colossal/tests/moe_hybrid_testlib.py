"""A tiny Mixtral, a tiny MoE net, batches and the one-process reference (MoE plugin tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import sharded_view
from colossal.shardformer.moe import GroupedExperts, MoeLayer, TopKRouter
from colossal.zero import is_expert_param

VOCAB, SEQ, ROWS, EXPERTS = 128, 6, 4, 4
MAX_NORM = 0.05  # below the reference's gradient norms: every step is clipped
RTOL = 1e-5


def mixtral() -> nn.Module:
    """Mixtral LM, 2 layers, 4 heads (2 KV), 4 experts top-2, untied (seed 0)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        max_position_embeddings=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(config)


NET_HIDDEN, NET_FFN = 8, 12


class MoeNet(nn.Module):
    """``fc_out(h + moe(h))`` with ``h = sigmoid(fc_in(x))``: ``EXPERTS`` gated experts
    (``GroupedExperts`` over ``ep_group``), top-2 dropless routing, hidden ``NET_HIDDEN``."""

    def __init__(self, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        h = NET_HIDDEN
        self.fc_in = nn.Linear(h, h)
        experts = GroupedExperts(EXPERTS, h, NET_FFN, ep_group, gated=True)
        self.moe = MoeLayer(h, EXPERTS, TopKRouter(2, capacity_factor_train=None), experts)
        self.fc_out = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The net's output for ``x`` ``[T, NET_HIDDEN]``."""
        h = torch.sigmoid(self.fc_in(x))  # positive: a forced gate picks the same experts
        out: torch.Tensor = self.fc_out(h + self.moe(h))
        return out


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: ``ROWS`` sequences, labels equal to the inputs."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def rows(whole: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    """The ``index``-th of ``parts`` equal row blocks of every tensor of ``whole``."""
    n = ROWS // parts
    return {k: v[index * n : (index + 1) * n] for k, v in whole.items()}


def reference(
    build: Callable[[], nn.Module],
    steps: int,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    max_norm: float = MAX_NORM,
) -> tuple[list[float], list[float], nn.Module]:
    """Losses, gradient norms and the model after ``steps`` clipped steps on the global batch."""
    model = build()
    opt = make_optimizer(model)
    losses, norms = [], []
    for step in range(steps):
        loss = model(**batch(step)).loss
        opt.zero_grad()
        loss.backward()
        params = [p for p in model.parameters() if p.requires_grad]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (lr 1e-2, weight decay 0.1)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def expected_part(
    param: torch.Tensor, whole: torch.Tensor, ep_group: dist.ProcessGroup
) -> torch.Tensor:
    """What this rank should hold of ``whole``: its ep block for an expert, else all of it."""
    if not is_expert_param(param):
        return whole
    ep, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    n = whole.shape[0] // ep
    return whole[rank * n : (rank + 1) * n]


def held_whole(param: torch.Tensor) -> torch.Tensor:
    """A dense parameter whole (tensor-parallel parts gathered: collective over tp), fp32.

    Expert parameters are returned as held (their ep block).
    """
    if is_expert_param(param):
        return param.detach().float()
    view = sharded_view(param)
    return (param.detach() if view is None else view.gather()).float()


def mean_over(value: float, group: dist.ProcessGroup) -> float:
    """Mean of ``value`` over ``group``."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
