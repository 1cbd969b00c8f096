"""Shared pieces of the Hugging Face Trainer tests: a tiny GPT-2, token data, arguments."""

from __future__ import annotations

import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, SEQ = 64, 8


def tiny_gpt2() -> GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config, the same weights on every call (no dropout)."""
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def token_data(n: int = 32, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` causal-LM samples of ``SEQ`` tokens (labels = inputs); learnable: a cycle."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, 1), generator=g)
    ids = (starts + torch.arange(SEQ) * 3) % VOCAB
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def training_args(out: str, **overrides: object) -> TrainingArguments:
    """CPU/gloo arguments logging the loss every step; ``overrides`` replace any of them."""
    base: dict[str, object] = dict(
        output_dir=out, use_cpu=True, per_device_train_batch_size=2, max_steps=5,
        learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        optim="adamw_torch", disable_tqdm=True, lr_scheduler_type="linear",
        per_device_eval_batch_size=4,
    )  # fmt: skip
    base.update(overrides)
    return TrainingArguments(**base)  # type: ignore[arg-type]


def step_losses(trainer: Trainer) -> list[float]:
    """The loss logged at each optimizer step (the mean over ranks)."""
    return [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]


def grad_norms(trainer: Trainer) -> list[float]:
    """The gradient norm logged at each optimizer step (before clipping)."""
    return [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]


def assert_curve(got: list[float], want: list[float], rtol: float, what: str) -> None:
    """Same number of steps and every value within ``rtol`` (relative)."""
    assert len(got) == len(want) and want, f"{what}: {len(got)} values, expected {len(want)}"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(a, b, rel_tol=rtol), (
            f"{what}: step {i + 1}: {a} != {b} ({got} vs {want})"
        )
