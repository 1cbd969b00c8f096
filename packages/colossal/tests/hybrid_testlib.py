"""Tiny transformers models, batches and the single-process reference for the hybrid tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import sharded_view

GLOBAL_BATCH, SEQ, VOCAB, LAYERS = 8, 16, 128, 4


def gpt2() -> nn.Module:
    """GPT-2 LM with tied embeddings, 4 layers, 4 heads, no dropout (seed 0)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def llama() -> nn.Module:
    """Llama LM (untied, grouped-query attention), 4 layers, 4 heads (seed 0)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama}


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Token ids (no padding) with labels equal to the inputs (the model shifts them)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def rows(batch: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    """The ``index``-th of ``parts`` equal row blocks of every tensor of ``batch``."""
    n = GLOBAL_BATCH // parts
    return {k: v[index * n : (index + 1) * n] for k, v in batch.items()}


def make_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """SGD with momentum (sees the gradients' scale) or AdamW."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def reference(
    build: Callable[[], nn.Module], kind: str, steps: int, max_norm: float = 0.0
) -> tuple[list[float], list[float], nn.Module]:
    """Losses, gradient norms and the model after ``steps`` on the global batch (fp32)."""
    model = build()
    opt = make_optimizer(model, kind)
    losses, norms = [], []
    for step in range(steps):
        loss = model(**global_batch(step)).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm if max_norm else float("inf"))))
        opt.step()
        losses.append(loss.item())
    return losses, norms, model


def full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly tensor-parallel) parameter, in fp32."""
    view = sharded_view(param)
    return (param.detach() if view is None else view.gather()).float()


def mean_over(value: float, group: Any) -> float:
    """Mean of ``value`` over ``group``."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)
