"""ColossalAI model zoo's ViT parts, with its names and arguments, on ``torch.nn``.

``init_method='torch'`` keeps PyTorch's initialization; ``'jax'`` uses the JAX ViT's (Xavier
uniform weights, zero biases, truncated-normal class token and positions). ``checkpoint=True``
recomputes a block's activations in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

__all__ = ["VisionTransformer", "ViTBlock", "ViTEmbedding", "ViTHead", "_create_vit_model"]


def _init_linear(module: nn.Linear, init_method: str) -> None:
    if init_method == "jax":
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif init_method != "torch":
        raise ValueError(f"init_method={init_method!r} must be 'torch' or 'jax'")


class ViTEmbedding(nn.Module):
    """Patches, class token and positions: ``(B, C, H, W)`` -> ``(B, 1 + patches, dim)``."""

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        in_chans: int,
        embedding_dim: int,
        dropout: float,
        dtype: torch.dtype | None = None,
        flatten: bool = True,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        if not flatten:
            raise ValueError("ViTEmbedding(flatten=False) is not supported by this stand-in")
        num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_chans, embedding_dim, patch_size, stride=patch_size, dtype=dtype)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embedding_dim, dtype=dtype))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, embedding_dim, dtype=dtype))
        self.dropout = nn.Dropout(dropout)
        if init_method == "jax":
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
            nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        return self.dropout(x + self.pos_embed)


class _SelfAttention(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, attention_dropout: float, dropout: float,
        bias: bool, dtype: torch.dtype | None, init_method: str,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.query_key_value = nn.Linear(dim, 3 * dim, bias=bias, dtype=dtype)
        self.dense = nn.Linear(dim, dim, bias=bias, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        for linear in (self.query_key_value, self.dense):
            _init_linear(linear, init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.query_key_value(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        drop = self.attention_dropout if self.training else 0.0
        x = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=drop)
        return self.dropout(self.dense(x.transpose(1, 2).reshape(b, n, c)))


class _MLP(nn.Module):
    def __init__(
        self, dim: int, mlp_ratio: float, activation: Callable[[torch.Tensor], torch.Tensor],
        dropout: float, bias: bool, dtype: torch.dtype | None, init_method: str,
    ) -> None:  # fmt: skip
        super().__init__()
        self.dense_1 = nn.Linear(dim, int(dim * mlp_ratio), bias=bias, dtype=dtype)
        self.activation = activation
        self.dense_2 = nn.Linear(int(dim * mlp_ratio), dim, bias=bias, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        for linear in (self.dense_1, self.dense_2):
            _init_linear(linear, init_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(self.activation(self.dense_1(x)))
        return self.dropout(self.dense_2(x))


class ViTBlock(nn.Module):
    """Pre-norm transformer block (attention, then MLP, each with a residual)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.gelu,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        layernorm_epsilon: float = 1e-6,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        checkpoint: bool = False,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        if drop_path:
            raise ValueError("ViTBlock(drop_path>0) is not supported by this stand-in")
        self.norm1 = nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.attn = _SelfAttention(
            dim, num_heads, attention_dropout, dropout, bias, dtype, init_method
        )
        self.norm2 = nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.mlp = _MLP(dim, mlp_ratio, activation, dropout, bias, dtype, init_method)
        self.checkpoint = checkpoint

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and self.training and torch.is_grad_enabled():
            out: torch.Tensor = recompute(self._forward, x, use_reentrant=False)
            return out
        return self._forward(x)


class ViTHead(nn.Module):
    """The class token's logits (through an optional tanh representation layer)."""

    def __init__(
        self,
        dim: int,
        num_classes: int,
        representation_size: int | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        self.representation: nn.Module = nn.Identity()
        if representation_size:
            dense = nn.Linear(dim, representation_size, bias=bias, dtype=dtype)
            _init_linear(dense, init_method)
            self.representation = nn.Sequential(dense, nn.Tanh())
            dim = representation_size
        self.dense = nn.Linear(dim, num_classes, bias=bias, dtype=dtype)
        if init_method == "jax":
            nn.init.zeros_(self.dense.weight)
            nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.representation(x[:, 0]))


class VisionTransformer(nn.Module):
    """Embedding, ``depth`` blocks, LayerNorm and head in one ``nn.Sequential``."""

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        depth: int = 12,
        num_heads: int = 12,
        dim: int = 768,
        mlp_ratio: float = 4,
        attention_dropout: float = 0.0,
        dropout: float = 0.1,
        drop_path: float = 0.0,
        layernorm_epsilon: float = 1e-6,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.gelu,
        representation_size: int | None = None,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        checkpoint: bool = False,
        init_method: str = "torch",
    ) -> None:
        super().__init__()
        embed = ViTEmbedding(
            img_size, patch_size, in_chans, dim, dropout, dtype, init_method=init_method
        )
        blocks = [
            ViTBlock(
                dim,
                num_heads,
                mlp_ratio,
                activation,
                attention_dropout,
                dropout,
                drop_path,
                layernorm_epsilon,
                dtype,
                bias,
                checkpoint,
                init_method,
            )
            for _ in range(depth)
        ]
        norm = nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        head = ViTHead(dim, num_classes, representation_size, dtype, bias, init_method)
        self.layers = nn.Sequential(embed, *blocks, norm, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _create_vit_model(**model_kwargs: object) -> VisionTransformer:
    """A :class:`VisionTransformer` from keyword arguments (the model zoo's factory)."""
    return VisionTransformer(**model_kwargs)  # type: ignore[arg-type]
