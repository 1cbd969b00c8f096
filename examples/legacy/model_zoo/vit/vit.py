"""ColossalAI model zoo's ViT parts, with its names and arguments, on ``colossalai.nn``.

As in ColossalAI's zoo, the layers are ``colossalai.nn``'s mode-dispatched ones
(``PatchEmbedding``, ``Linear``, ``LayerNorm``, ``Classifier``, ``Dropout``): torch's modules
without tensor parallelism, the 1D/2D/2.5D/3D layers under ``tensor=dict(mode=...)``. The
attention's fused ``query_key_value`` output is laid out head by head (each head's q, k and
v side by side), so a rank's part of it holds whole heads in every mode; layers are built in
the order the forward runs them (the 1D and 3D layers follow the previous one).

``init_method='torch'`` keeps PyTorch's initialization; ``'jax'`` uses the JAX ViT's (Xavier
uniform weights, zero biases, truncated-normal positions). ``checkpoint=True`` recomputes a
block's activations in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import colossalai.nn as col_nn
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

__all__ = ["VisionTransformer", "ViTBlock", "ViTEmbedding", "ViTHead", "_create_vit_model"]


def _xavier(tensor: torch.Tensor, fan_in: int, fan_out: int) -> None:
    nn.init.xavier_uniform_(tensor)


def _zeros(tensor: torch.Tensor, fan_in: int, fan_out: int | None = None) -> None:
    nn.init.zeros_(tensor)


def _trunc_normal(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
    nn.init.trunc_normal_(tensor, std=0.02)


def _linear_init(init_method: str) -> dict[str, object]:
    """The colossalai.nn initializers of a Linear for ``init_method``."""
    if init_method == "jax":
        return dict(weight_initializer=_xavier, bias_initializer=_zeros)
    if init_method != "torch":
        raise ValueError(f"init_method={init_method!r} must be 'torch' or 'jax'")
    return {}


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
        init = dict(position_embed_initializer=_trunc_normal) if init_method == "jax" else {}
        self.patch_embed = col_nn.PatchEmbedding(
            img_size, patch_size, in_chans, embedding_dim, dtype=dtype, **init
        )
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.patch_embed(x))


class _SelfAttention(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, attention_dropout: float, dropout: float,
        bias: bool, dtype: torch.dtype | None, init_method: str,
    ) -> None:  # fmt: skip
        super().__init__()
        self.attention_head_size = dim // num_heads
        self.attention_dropout = attention_dropout
        init = _linear_init(init_method)
        self.query_key_value = col_nn.Linear(dim, 3 * dim, bias=bias, dtype=dtype, **init)
        self.dense = col_nn.Linear(dim, dim, bias=bias, dtype=dtype, **init)
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.query_key_value(x)  # this rank's heads: (b, n, heads * 3 * head_size)
        heads = qkv.shape[-1] // (3 * self.attention_head_size)
        qkv = qkv.reshape(*qkv.shape[:-1], heads, 3 * self.attention_head_size)
        q, k, v = qkv.transpose(1, 2).chunk(3, dim=-1)
        drop = self.attention_dropout if self.training else 0.0
        x = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=drop)
        x = x.transpose(1, 2).flatten(2)
        return self.dropout(self.dense(x))


class _MLP(nn.Module):
    def __init__(
        self, dim: int, mlp_ratio: float, activation: Callable[[torch.Tensor], torch.Tensor],
        dropout: float, bias: bool, dtype: torch.dtype | None, init_method: str,
    ) -> None:  # fmt: skip
        super().__init__()
        init = _linear_init(init_method)
        self.dense_1 = col_nn.Linear(dim, int(dim * mlp_ratio), bias=bias, dtype=dtype, **init)
        self.activation = activation
        self.dropout_1 = col_nn.Dropout(dropout)
        self.dense_2 = col_nn.Linear(int(dim * mlp_ratio), dim, bias=bias, dtype=dtype, **init)
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout_1(self.activation(self.dense_1(x)))
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
        self.norm1 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.attn = _SelfAttention(
            dim, num_heads, attention_dropout, dropout, bias, dtype, init_method
        )
        self.norm2 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
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
            dense = col_nn.Linear(
                dim, representation_size, bias=bias, dtype=dtype, **_linear_init(init_method)
            )
            self.representation = nn.Sequential(dense, nn.Tanh())
            dim = representation_size
        init = dict(weight_initializer=_zeros, bias_initializer=_zeros)
        self.dense = col_nn.Classifier(
            dim, num_classes, bias=bias, dtype=dtype, **(init if init_method == "jax" else {})
        )

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
        norm = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        head = ViTHead(dim, num_classes, representation_size, dtype, bias, init_method)
        self.layers = nn.Sequential(embed, *blocks, norm, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _create_vit_model(**model_kwargs: object) -> VisionTransformer:
    """A :class:`VisionTransformer` from keyword arguments (the model zoo's factory)."""
    return VisionTransformer(**model_kwargs)  # type: ignore[arg-type]
