"""Tiny models of every family with a hand-written or derived policy, and their batches.

One home for the test models of GPT-2, BERT, ViT, OPT and Bloom (and of Llama / Qwen2 from
``_models``' tiny configs): fp32-friendly, every dropout 0, 64 hidden units, 8 heads (TP 2
and 4 both divide them), vocabulary :data:`VOCAB` (not a multiple of ``64 * tp``: the vocab
padding is exercised). Each family function takes the head class name and config overrides
(e.g. ``n_layer=4``, ``num_labels=3``, ``image_size=16``) and returns a zero-argument
builder, so a test builds the reference and the sharded copy from one seed. Transformers is
imported lazily (inside the builders).

Batch makers: :func:`lm_batch` (causal LM), :func:`classification`, :func:`masked_lm` and
:func:`images`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

VOCAB = 250
"""Vocabulary of every tiny model (not a multiple of ``64 * tp``)."""

Builder = Callable[[], Any]

_CONFIGS: dict[str, dict[str, Any]] = {
    "GPT2Config": dict(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0,
    ),
    "BertConfig": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
    ),
    # image_size 12: 3 x 3 patches + [CLS] = 10 tokens (divisible by SP 2).
    "ViTConfig": dict(
        image_size=12, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=8, intermediate_size=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3,
    ),
    "OPTConfig": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
        num_attention_heads=8, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0,
        attention_dropout=0.0, pad_token_id=1,
    ),
    "BloomConfig": dict(
        vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=8, hidden_dropout=0.0,
        attention_dropout=0.0, pad_token_id=0,
    ),
}  # fmt: skip


def config_kwargs(config_name: str, **overrides: Any) -> dict[str, Any]:
    """The tiny ``transformers.<config_name>`` arguments, ``overrides`` applied on top."""
    if config_name not in _CONFIGS:
        raise ValueError(f"no tiny config {config_name!r}; one of {sorted(_CONFIGS)}")
    return {**_CONFIGS[config_name], **overrides}


def hf(cls_name: str, config_name: str, **kwargs: Any) -> Builder:
    """A builder of ``transformers.<cls_name>(transformers.<config_name>(**kwargs))``."""

    def build() -> Any:
        import transformers

        config = getattr(transformers, config_name)(**kwargs)
        return getattr(transformers, cls_name)(config)

    return build


def gpt2(cls_name: str = "GPT2LMHeadModel", **overrides: Any) -> Builder:
    """Tiny GPT-2 (2 layers, 8 heads, tied LM head)."""
    return hf(cls_name, "GPT2Config", **config_kwargs("GPT2Config", **overrides))


def bert(cls_name: str = "BertForMaskedLM", **overrides: Any) -> Builder:
    """Tiny BERT (2 layers, 8 heads, bidirectional)."""
    return hf(cls_name, "BertConfig", **config_kwargs("BertConfig", **overrides))


def vit(cls_name: str = "ViTForImageClassification", **overrides: Any) -> Builder:
    """Tiny ViT (12x12 images by default: ``(image_size / 4) ** 2`` patches + [CLS])."""
    return hf(cls_name, "ViTConfig", **config_kwargs("ViTConfig", **overrides))


def opt(cls_name: str = "OPTForCausalLM", **overrides: Any) -> Builder:
    """Tiny OPT (2 layers, 8 heads, pad token 1)."""
    return hf(cls_name, "OPTConfig", **config_kwargs("OPTConfig", **overrides))


def bloom(cls_name: str = "BloomForCausalLM", **overrides: Any) -> Builder:
    """Tiny Bloom (2 layers, 8 heads, ALiBi attention)."""
    return hf(cls_name, "BloomConfig", **config_kwargs("BloomConfig", **overrides))


def derived(
    config_fn: str, cls_name: str = "LlamaForCausalLM", layers: int = 2, **overrides: Any
) -> Builder:
    """A model of ``_models.<config_fn>(layers, **overrides)`` (Llama / Qwen2 / Mistral).

    Their policies are derived from the model's tensor-parallel plan.
    """

    def build() -> Any:
        import _models
        import transformers

        return getattr(transformers, cls_name)(getattr(_models, config_fn)(layers, **overrides))

    return build


# ------------------------------------------------------------------------------- batches


def lm_batch(
    pad: bool = True, seq_len: int = 8, seed: int = 1234, batch_size: int = 2, first_id: int = 0
) -> dict[str, torch.Tensor]:
    """A causal-LM batch: ``input_ids``, ``attention_mask`` and ``labels`` (the ids).

    ``pad``: the left part of row 1 is padded (label ``-100``), see
    ``_models.causal_lm_batch``. ``first_id`` > 0 draws ids from ``[first_id, VOCAB)``
    (keeps pad-token ids out of the sequence; unpadded batches only).
    """
    if not first_id:
        from _models import causal_lm_batch

        return causal_lm_batch(VOCAB, batch_size=batch_size, seq_len=seq_len, pad=pad, seed=seed)
    if pad:
        raise ValueError(f"first_id={first_id} needs pad=False (padding uses id 0)")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(first_id, VOCAB, (batch_size, seq_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def classification(
    batch: dict[str, torch.Tensor], labels: Sequence[int], right_pad: int = 0
) -> dict[str, torch.Tensor]:
    """``batch`` with one class label per row (``labels``) instead of token labels.

    ``right_pad``: the last ``right_pad`` tokens of row 1 become padding (id 0, mask 0), so
    a last-token pooler must find the last non-pad token. ``batch`` is not modified.
    """
    out = dict(batch)
    if right_pad:
        out["input_ids"] = out["input_ids"].clone()
        out["attention_mask"] = out["attention_mask"].clone()
        out["input_ids"][1, -right_pad:] = 0
        out["attention_mask"][1, -right_pad:] = 0
    out["labels"] = torch.tensor(list(labels))
    return out


def masked_lm(
    batch: dict[str, torch.Tensor], positions: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """``batch`` as a masked-LM batch (no shift): only some positions carry a label.

    Without ``positions`` every other label (columns 0, 2, ...) is ignored; with them only
    those columns carry a label (their input id), the same count in every row.
    """
    out = dict(batch)
    if positions is None:
        labels = out["labels"].clone()
        labels[:, ::2] = -100
    else:
        labels = torch.full_like(out["labels"], -100)
        cols = list(positions)
        labels[:, cols] = out["input_ids"][:, cols]
    out["labels"] = labels
    return out


def images(
    size: int = 12, labels: Sequence[int] | None = (0, 2), batch_size: int = 2
) -> dict[str, torch.Tensor]:
    """``batch_size`` random ``size`` x ``size`` RGB images (seed 7) and their ``labels``."""
    gen = torch.Generator().manual_seed(7)
    out = {"pixel_values": torch.randn(batch_size, 3, size, size, generator=gen)}
    if labels is not None:
        out["labels"] = torch.tensor(list(labels))
    return out
