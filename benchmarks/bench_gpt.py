"""A self-contained GPT-style workload shared by the benchmarks (no transformers needed)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


@dataclass(frozen=True)
class GPTConfig:
    """Size of the benchmark model."""

    vocab_size: int = 16384
    n_layer: int = 8
    n_embd: int = 640
    n_head: int = 10
    block_size: int = 128

    @classmethod
    def preset(cls, name: str) -> GPTConfig:
        """Named sizes: ``tiny`` (~1M), ``small`` (~10M), ``medium`` (~50M)."""
        presets = {
            "tiny": cls(vocab_size=512, n_layer=2, n_embd=64, n_head=4, block_size=32),
            "small": cls(vocab_size=8192, n_layer=4, n_embd=320, n_head=5, block_size=128),
            "medium": cls(),
        }
        if name not in presets:
            raise ValueError(f"unknown model size {name!r}; choose one of {sorted(presets)}")
        return presets[name]


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, blocks, tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(
                    p, std=0.02 / (math.sqrt(2 * cfg.n_layer) if name.endswith("out.weight") else 1)
                )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def num_params(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def lm_loss(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on a batch of token ids."""
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def random_batch(cfg: GPTConfig, batch_size: int, seed: int) -> torch.Tensor:
    """Token ids of shape ``(batch_size, block_size + 1)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=g)
