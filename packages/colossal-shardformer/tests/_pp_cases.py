"""Pipeline test cases: one tiny model per family and head, its batch, and the checks.

Every model has 4 layers (PP 4, and PP 2 with 2 chunks, give each slice one), dropout 0,
vocabulary 250 and 8 heads (TP 2 divides them). Batches hold 4 samples of 8 tokens with no
padded label, so each of 2 microbatches has the same token count and the mean of the
microbatch losses is the full-batch loss. The sequence-classification batch pads one row
(GPT-2 pools the last non-pad token, found from ``input_ids`` on the last stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 250
NUM_LABELS = 3
LAYERS = 4
BATCH = 4
SEQ = 8


@dataclass(frozen=True)
class PPCase:
    """A model to split and the batch to train it on."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], dict[str, torch.Tensor]]
    tied: bool = False  # input and output embeddings are one parameter


def _lm_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _cls_batch() -> dict[str, torch.Tensor]:
    batch = _lm_batch()
    batch["input_ids"][1, -3:] = 0  # right padding: pooled at the last non-pad token
    batch["attention_mask"][1, -3:] = 0
    batch["labels"] = torch.tensor([0, 2, 1, 2])
    return batch


def _mlm_batch() -> dict[str, torch.Tensor]:
    batch = _lm_batch()
    labels = torch.full_like(batch["labels"], -100)
    labels[:, 2] = batch["input_ids"][:, 2]  # one masked token per sample: equal counts
    labels[:, 5] = batch["input_ids"][:, 5]
    batch["labels"] = labels
    batch["token_type_ids"] = torch.zeros_like(labels)
    return batch


def _image_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen),
        "labels": torch.tensor([0, 2, 1, 1]),
    }


def _hf(cls_name: str, config_name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        config = getattr(transformers, config_name)(**kwargs)
        return getattr(transformers, cls_name)(config)

    return build


GPT2 = dict(
    vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=8, n_positions=64, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, num_labels=NUM_LABELS,
)  # fmt: skip
BERT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=8,
    intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    max_position_embeddings=64, num_labels=NUM_LABELS,
)  # fmt: skip
_VIT = dict(
    image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=LAYERS,
    num_attention_heads=8, intermediate_size=128, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, num_labels=NUM_LABELS,
)  # fmt: skip
_OPT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, ffn_dim=128,
    num_attention_heads=8, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0,
    attention_dropout=0.0, pad_token_id=1, num_labels=NUM_LABELS,
)  # fmt: skip
_BLOOM = dict(
    vocab_size=VOCAB, hidden_size=64, n_layer=LAYERS, n_head=8, hidden_dropout=0.0,
    attention_dropout=0.0, pad_token_id=0, num_labels=NUM_LABELS,
)  # fmt: skip
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, num_hidden_layers=LAYERS,
    pad_token_id=0, num_labels=NUM_LABELS,
)  # fmt: skip

_SEQ = "ForSequenceClassification"

CASES: dict[str, PPCase] = {
    c.name: c
    for c in (
        PPCase("gpt2-lm", _hf("GPT2LMHeadModel", "GPT2Config", **GPT2), _lm_batch, tied=True),
        PPCase("gpt2-seqcls", _hf("GPT2" + _SEQ, "GPT2Config", **GPT2), _cls_batch),
        PPCase("bert-mlm", _hf("BertForMaskedLM", "BertConfig", **BERT), _mlm_batch, tied=True),
        PPCase("bert-seqcls", _hf("Bert" + _SEQ, "BertConfig", **BERT), _cls_batch),
        PPCase("vit-imgcls", _hf("ViTForImageClassification", "ViTConfig", **_VIT), _image_batch),
        PPCase("opt-lm", _hf("OPTForCausalLM", "OPTConfig", **_OPT), _lm_batch, tied=True),
        PPCase("bloom-lm", _hf("BloomForCausalLM", "BloomConfig", **_BLOOM), _lm_batch, tied=True),
        PPCase(
            "llama-lm",
            _hf("LlamaForCausalLM", "LlamaConfig", **DECODER, tie_word_embeddings=False),
            _lm_batch,
        ),
        PPCase(
            "llama-seqcls",
            _hf("Llama" + _SEQ, "LlamaConfig", **DECODER),
            _cls_batch,
        ),
        PPCase(
            "qwen2-lm-tied",
            _hf("Qwen2ForCausalLM", "Qwen2Config", **DECODER, tie_word_embeddings=True),
            _lm_batch,
            tied=True,
        ),
    )
}
"""Every family (hand-written plans and derived ones) and head the pipeline supports."""


def build_pair(case: PPCase) -> tuple[nn.Module, nn.Module]:
    """``(reference, model)``: the same weights, both in train mode (dropout is 0)."""
    torch.manual_seed(0)
    ref = case.build()
    torch.manual_seed(0)
    model = case.build()
    ref.train()
    model.train()
    return ref, model


def chunk_list(model: nn.Module) -> list[nn.Module]:
    """The chunks ``optimize`` returned (one module, or an ``nn.ModuleList`` of them)."""
    return list(model) if isinstance(model, nn.ModuleList) else [model]


def held_parameters(chunks: list[nn.Module]) -> Iterator[tuple[str, nn.Parameter]]:
    """Hugging Face name and parameter of everything the chunks hold (tied ones once)."""
    seen: set[int] = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p
