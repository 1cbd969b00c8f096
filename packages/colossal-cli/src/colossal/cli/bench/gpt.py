"""A small self-contained GPT (nanoGPT-style) used as the standard benchmark workload."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

__all__ = ["GPT", "GPTConfig", "MODEL_SIZES", "gpt_config"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the benchmark GPT.

    Attributes:
        vocab_size: Tokens in the vocabulary.
        n_layer: Transformer blocks.
        n_head: Attention heads per block.
        n_embd: Hidden size (divisible by ``n_head``).
        max_seq_len: Longest sequence the position embedding covers.
    """

    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    max_seq_len: int = 1024

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.n_layer, self.n_head, self.n_embd, self.max_seq_len) < 1:
            raise ValueError(f"every GPTConfig field must be >= 1, got {self}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    def num_params(self) -> int:
        """Parameters of :class:`GPT` built from this config."""
        e, v, s, n = self.n_embd, self.vocab_size, self.max_seq_len, self.n_layer
        norms, attn = 2 * 2 * e, (3 * e * e + 3 * e) + (e * e + e)
        block = norms + attn + (4 * e * e + 4 * e) + (4 * e * e + e)
        return v * e + s * e + n * block + 2 * e + e * v


#: Named sizes for ``--model-size``; "tiny" keeps a CPU run of every configuration short.
MODEL_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=512, n_layer=2, n_head=2, n_embd=64),
    "small": GPTConfig(vocab_size=4096, n_layer=4, n_head=4, n_embd=256),
    "medium": GPTConfig(vocab_size=8192, n_layer=8, n_head=8, n_embd=512),
    "gpt2": GPTConfig(vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
}


def gpt_config(size: str, seq_len: int) -> GPTConfig:
    """The named size, with position embeddings covering ``seq_len``.

    Raises:
        ValueError: Unknown size or ``seq_len < 1``.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(MODEL_SIZES)}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    base = MODEL_SIZES[size]
    return GPTConfig(base.vocab_size, base.n_layer, base.n_head, base.n_embd, seq_len)


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (y.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Decoder-only transformer returning the next-token cross-entropy loss.

    Args:
        cfg: The model's shape.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("out.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting ``targets`` from ``idx`` (both ``[batch, seq]``)."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} > max_seq_len {self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
