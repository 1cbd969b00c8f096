"""A small WideNet ("Go Wider Instead of Deeper"): one transformer block shared by every layer.

Every layer applies the same attention and the same MoE feed-forward (``MoeLayer`` over
shared ``Experts`` and a shared ``Top2Router``, built as the seeds' page builds them); only
the layer norms are per layer. The patch embedding, class token and head are a ViT's.
"""

import torch
from colossalai.global_variables import moe_env
from colossalai.nn.layer.moe import Experts, MoeLayer, NormalNoiseGenerator, Top2Router
from torch import nn


class VanillaFFN(nn.Module):
    """One expert: ``Linear -> GELU -> Dropout -> Linear``."""

    def __init__(self, d_model: int, d_ff: int, drop_rate: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Dropout(drop_rate), nn.Linear(d_ff, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Widenet(nn.Module):
    """WideNet for ``img_size`` square one-channel images.

    Args:
        num_experts: Experts of the shared MoE layer (a multiple of the MoE size).
        capacity_factor: The router's training capacity factor.
        img_size, patch_size, d_model, d_ff, depth, num_heads, num_classes: The ViT's sizes.
        drop_rate: Dropout inside the experts.
    """

    def __init__(
        self,
        num_experts: int,
        capacity_factor: float,
        img_size: int = 8,
        patch_size: int = 2,
        d_model: int = 32,
        d_ff: int = 64,
        depth: int = 4,
        num_heads: int = 4,
        num_classes: int = 10,
        drop_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, d_model, patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, d_model) * 0.02)
        # the page's construction: noise, a shared router, shared experts, one MoE layer
        noisy_func = NormalNoiseGenerator(num_experts)
        shared_router = Top2Router(capacity_factor, noisy_func=noisy_func)
        shared_experts = Experts(
            expert=VanillaFFN, num_experts=num_experts, d_model=d_model, d_ff=d_ff,
            drop_rate=drop_rate,
        )  # fmt: skip
        self.ffn = MoeLayer(
            dim_model=d_model, num_experts=num_experts, router=shared_router,
            experts=shared_experts,
        )  # fmt: skip
        self.attn = nn.MultiheadAttention(d_model, num_heads, batch_first=True)
        self.norm1 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(depth))
        self.norm2 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(depth))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        moe_env.reset_loss()  # this forward's auxiliary losses only (ColossalAI's model zoo)
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for norm1, norm2 in zip(self.norm1, self.norm2, strict=True):
            h = norm1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            x = x + self.ffn(norm2(x))
        return self.head(self.norm(x[:, 0]))
