"""ColossalAI model zoo's GPT parts, with its names and arguments, on ``colossalai.nn``.

As in ColossalAI's zoo, the layers are ``colossalai.nn``'s mode-dispatched ones (``Embedding``,
``Linear``, ``LayerNorm``, ``Classifier``, ``Dropout``): torch's modules without tensor
parallelism, Megatron's 1D split under ``tensor=dict(mode='1d')`` (the fused
``query_key_value`` and ``dense_1`` column-parallel, ``dense`` and ``dense_2`` row-parallel,
the embeddings split along their width and a tied head row-parallel over the same weight).
The fused ``query_key_value`` output is laid out head by head (each head's q, k and v side by
side), so a rank's columns hold whole heads; the local head count follows from the local
width. Layers are built in the order the forward runs them (a 1D Linear follows the
previous one). The 2D/2.5D/3D modes split the batch of the activations, which the attention
mask here does not follow: run None or '1d'.

``GPTBlock`` takes and returns ``(hidden_states, attention_mask)``, the mask additive
(``0`` to keep, ``-10000`` to drop) of shape ``(B, 1, 1, S)``, or ``None``; attention is
causal either way. ``checkpoint=True`` recomputes a block's activations in the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import colossalai.nn as col_nn
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - torch's own convention
from torch.utils.checkpoint import checkpoint as recompute

__all__ = ["GPTBlock", "GPTEmbedding", "GPTLMHead", "GPTLMLoss"]


class GPTEmbedding(nn.Module):
    """Token plus learned position embeddings (normal, std 0.02), then dropout."""

    def __init__(
        self,
        embedding_dim: int,
        vocab_size: int,
        max_position_embeddings: int,
        num_tokentypes: int = 0,
        padding_idx: int | None = None,
        dropout: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if num_tokentypes:
            raise ValueError("GPTEmbedding(num_tokentypes>0) is not supported by this stand-in")
        init = dict(weight_initializer=_normal_002)  # GPT-2's initialization
        self.word_embeddings = col_nn.Embedding(
            vocab_size, embedding_dim, padding_idx=padding_idx, dtype=dtype, **init
        )
        self.position_embeddings = col_nn.Embedding(
            max_position_embeddings, embedding_dim, dtype=dtype, **init
        )
        self.dropout = col_nn.Dropout(dropout)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(x)


def _normal_002(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
    nn.init.normal_(tensor, std=0.02)


class _CausalSelfAttention(nn.Module):
    def __init__(
        self, dim: int, num_heads: int, attention_dropout: float, dropout: float, bias: bool,
        dtype: torch.dtype | None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.head_size = dim // num_heads
        self.attention_dropout = attention_dropout
        self.query_key_value = col_nn.Linear(dim, 3 * dim, bias=bias, dtype=dtype)
        self.dense = col_nn.Linear(dim, dim, bias=bias, dtype=dtype)
        self.dropout = col_nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        qkv = self.query_key_value(x)  # this rank's heads: (b, s, heads * 3 * head_size)
        b, s, width = qkv.shape
        heads = width // (3 * self.head_size)
        q, k, v = qkv.reshape(b, s, heads, 3 * self.head_size).transpose(1, 2).chunk(3, dim=-1)
        causal = torch.full((s, s), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        mask = causal if attention_mask is None else causal + attention_mask.to(x.dtype)
        drop = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        return self.dropout(self.dense(out.transpose(1, 2).flatten(2)))


class GPTBlock(nn.Module):
    """Pre-norm GPT block: causal attention and MLP, each with a residual."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
        attention_dropout: float = 0.0,
        dropout: float = 0.0,
        layernorm_epsilon: float = 1e-5,
        dtype: torch.dtype | None = None,
        bias: bool = True,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.norm1 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.attn = _CausalSelfAttention(dim, num_heads, attention_dropout, dropout, bias, dtype)
        self.norm2 = col_nn.LayerNorm(dim, eps=layernorm_epsilon, dtype=dtype)
        self.dense_1 = col_nn.Linear(dim, int(dim * mlp_ratio), bias=bias, dtype=dtype)
        self.activation = activation
        self.dense_2 = col_nn.Linear(int(dim * mlp_ratio), dim, bias=bias, dtype=dtype)
        self.dropout = col_nn.Dropout(dropout)
        self.checkpoint = checkpoint

    def _forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attention_mask)
        mlp = self.dense_2(self.activation(self.dense_1(self.norm2(x))))
        return x + self.dropout(mlp)

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.checkpoint and self.training and torch.is_grad_enabled():
            out = recompute(self._forward, x, attention_mask, use_reentrant=False)
        else:
            out = self._forward(x, attention_mask)
        return out, attention_mask


class GPTLMHead(nn.Module):
    """Hidden states to vocabulary logits; ties to ``word_embeding_weight`` when given.

    A ``colossalai.nn.Classifier``: in '1d' row-parallel over the embedding's split weight
    (whole logits on every rank).
    """

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        word_embeding_weight: nn.Parameter | None = None,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dense = col_nn.Classifier(
            dim, vocab_size, word_embeding_weight, bias=bias, dtype=dtype,
            weight_initializer=_normal_002,
        )  # fmt: skip

    @property
    def weight(self) -> torch.Tensor:
        """The output projection's weight, ``(vocab_size, dim)`` (this rank's part in '1d')."""
        return self.dense.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(x)


class GPTLMLoss(nn.Module):
    """Next-token cross entropy: logits at position ``t`` predict ``labels[t + 1]``."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        # Flatten the tokens
        return F.cross_entropy(
            shift_logits.view(-1, shift_logits.size(-1)).float(), shift_labels.view(-1)
        )
