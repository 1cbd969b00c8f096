"""Shared cases of the attention sequence-parallel modes (``all_to_all``, ``ring_attn``).

Tiny fp32 models of every family whose attention goes through transformers'
``AttentionInterface`` (GPT-2, BERT, ViT, OPT; Llama and Qwen2 through their derived
policies) with every dropout 0, and :func:`check_family`: ``reference_check`` with the mode
on, ``SequenceParallelGradSync`` after each backward, everything at relative error <= 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

RTOL = 1e-5
VOCAB = 250


def batch(pad: bool = True, seq_len: int = 8) -> dict[str, torch.Tensor]:
    """A causal LM batch (row 1 left-padded when ``pad``)."""
    from _models import causal_lm_batch

    return causal_lm_batch(VOCAB, batch_size=2, seq_len=seq_len, pad=pad, seed=1234)


def hf(cls_name: str, config_name: str, **kwargs: Any) -> Callable[[], Any]:
    """A builder of ``transformers.<cls_name>(<config_name>(**kwargs))``."""

    def build() -> Any:
        import transformers

        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**kwargs))

    return build


def gpt2(cls_name: str = "GPT2LMHeadModel", n_layer: int = 2) -> Callable[[], Any]:
    """Tiny GPT-2 (8 heads, tied LM head)."""
    return hf(
        cls_name, "GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=n_layer, n_head=8,
        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
    )  # fmt: skip


def bert() -> Callable[[], Any]:
    """Tiny BERT masked LM (bidirectional)."""
    return hf(
        "BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=8, intermediate_size=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, max_position_embeddings=64,
    )  # fmt: skip


def vit(image_size: int = 12) -> Callable[[], Any]:
    """Tiny ViT classifier: ``(image_size / 4) ** 2`` patches + [CLS] tokens."""
    return hf(
        "ViTForImageClassification", "ViTConfig", image_size=image_size, patch_size=4,
        num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=3,
    )  # fmt: skip


def opt() -> Callable[[], Any]:
    """Tiny OPT causal LM."""
    return hf(
        "OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
        ffn_dim=128, num_attention_heads=8, max_position_embeddings=64, word_embed_proj_dim=64,
        dropout=0.0, attention_dropout=0.0, pad_token_id=1,
    )  # fmt: skip


def bloom() -> Callable[[], Any]:
    """Tiny Bloom (ALiBi attention)."""
    return hf(
        "BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2,
        n_head=8, hidden_dropout=0.0, attention_dropout=0.0, pad_token_id=0,
    )  # fmt: skip


def derived(config_fn: str, cls_name: str = "LlamaForCausalLM", **overrides: Any) -> Any:
    """A model of ``_models.<config_fn>`` (Llama / Qwen2, policies derived from their plan)."""

    def build() -> Any:
        import _models
        import transformers

        return getattr(transformers, cls_name)(getattr(_models, config_fn)(2, **overrides))

    return build


def mlm(b: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``b`` with every other label ignored (a masked-LM batch)."""
    out = dict(b)
    labels = out["labels"].clone()
    labels[:, ::2] = -100
    out["labels"] = labels
    return out


def pixels() -> dict[str, torch.Tensor]:
    """Two 12x12 images and their labels."""
    gen = torch.Generator().manual_seed(7)
    return {
        "pixel_values": torch.randn(2, 3, 12, 12, generator=gen),
        "labels": torch.tensor([0, 2]),
    }


def sync(model: torch.nn.Module) -> None:
    """Sum the partial gradients of the sequence-parallel parameters."""
    from colossal.shardformer import SequenceParallelGradSync

    SequenceParallelGradSync(model)()


def sp_kwargs(mode: str, sp_group: Any = None, tp_group: Any = None) -> dict[str, Any]:
    """``ShardConfig`` arguments of ``mode`` (tensor parallelism only with ``tp_group``)."""
    return {
        "enable_sequence_parallelism": True,
        "sequence_parallelism_mode": mode,
        "sequence_parallel_process_group": sp_group,
        "tensor_parallel_process_group": tp_group,
        "enable_tensor_parallelism": tp_group is not None,
    }


ZERO_GRAD_SUFFIXES = ("key.bias", "k_proj.bias")
"""Key biases: softmax ignores them, their exact gradient is 0 (compared absolutely)."""


def check_family(
    build: Callable[[], Any], b: dict[str, torch.Tensor], what: str, kwargs: dict[str, Any],
    steps: int = 1,
) -> Any:  # fmt: skip
    """``reference_check`` with the sequence-parallel grad sync; raises naming ``what``.

    Key biases (exact gradient 0, so a relative error is rounding noise) are compared by
    their largest absolute difference (gradient after the last backward, parameter after
    the steps; <= 1e-6) instead.
    """
    from _models import reference_check

    from colossal.core import sharded_view

    built: list[Any] = []

    def recording() -> Any:
        built.append(build())
        return built[-1]

    report = reference_check(
        recording, b, shard_config_kwargs=kwargs, steps=steps, rtol=RTOL, check=False,
        update_rtol=1e-3, after_backward=sync,
    )  # fmt: skip
    failures = [f for f in report.failures if not f.split(":")[0].endswith(ZERO_GRAD_SUFFIXES)]
    ref, model = built
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if not n.endswith(ZERO_GRAD_SUFFIXES):
            continue
        for label, mine, theirs in (("grad", p.grad, ref_params[n].grad), ("param", p, None)):
            if mine is None:
                continue
            view = sharded_view(mine, like=p)
            full = mine.detach() if view is None else view.gather()
            want = ref_params[n].detach() if theirs is None else theirs
            diff = float((full - want).abs().max())
            if not diff <= 1e-6:
                failures.append(f"{label} {n}: max abs difference {diff:.3e}")
    assert not failures, f"{what}: differs from unsharded:\n" + "\n".join(failures[:20])
    assert report.grads, f"{what}: no gradient was compared"
    return report


def sync_matters(build: Callable[[], Any], b: dict[str, torch.Tensor], kwargs: dict[str, Any],
                 name: str) -> None:  # fmt: skip
    """Without the grad sync a stack parameter's gradient is only this rank's share."""
    from _models import reference_check

    report = reference_check(build, b, shard_config_kwargs=kwargs, steps=0, check=False)
    assert report.grads[name] > 1e-2, (name, report.grads[name])
