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

import _families as fam
import torch
from torch import nn

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
    # ids from 2 up: no pad token (0 or 1) inside a sequence
    return fam.lm_batch(pad=False, seq_len=SEQ, batch_size=BATCH, first_id=2)


def _cls_batch() -> dict[str, torch.Tensor]:
    # right padding: pooled at the last non-pad token
    return fam.classification(_lm_batch(), labels=[0, 2, 1, 2], right_pad=3)


def _mlm_batch() -> dict[str, torch.Tensor]:
    batch = fam.masked_lm(_lm_batch(), positions=[2, 5])  # equal label counts per sample
    batch["token_type_ids"] = torch.zeros_like(batch["labels"])
    return batch


def _image_batch() -> dict[str, torch.Tensor]:
    return fam.images(size=16, labels=[0, 2, 1, 1], batch_size=BATCH)


_SIZES = {"num_labels": NUM_LABELS}  # every family: LAYERS layers, 3 classes
GPT2 = fam.config_kwargs("GPT2Config", n_layer=LAYERS, **_SIZES)
BERT = fam.config_kwargs("BertConfig", num_hidden_layers=LAYERS, **_SIZES)
DECODER = dict(
    vocab_size=fam.VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=8,
    num_key_value_heads=4, max_position_embeddings=64, num_hidden_layers=LAYERS,
    pad_token_id=0, num_labels=NUM_LABELS,
)  # fmt: skip
"""Llama / Qwen2 arguments (``_models``' tiny decoder with 4 layers and a pad token)."""

_SEQ = "ForSequenceClassification"
_DERIVED = {"layers": LAYERS, "pad_token_id": 0, **_SIZES}

CASES: dict[str, PPCase] = {
    c.name: c
    for c in (
        PPCase("gpt2-lm", fam.gpt2("GPT2LMHeadModel", **GPT2), _lm_batch, tied=True),
        PPCase("gpt2-seqcls", fam.gpt2("GPT2" + _SEQ, **GPT2), _cls_batch),
        PPCase("bert-mlm", fam.bert("BertForMaskedLM", **BERT), _mlm_batch, tied=True),
        PPCase("bert-seqcls", fam.bert("Bert" + _SEQ, **BERT), _cls_batch),
        PPCase(
            "vit-imgcls",
            fam.vit(image_size=16, num_hidden_layers=LAYERS, **_SIZES),
            _image_batch,
        ),
        PPCase("opt-lm", fam.opt(num_hidden_layers=LAYERS, **_SIZES), _lm_batch, tied=True),
        PPCase("bloom-lm", fam.bloom(n_layer=LAYERS, **_SIZES), _lm_batch, tied=True),
        PPCase("llama-lm", fam.derived("tiny_llama_config", **_DERIVED), _lm_batch),
        PPCase(
            "llama-seqcls",
            fam.derived("tiny_llama_config", "Llama" + _SEQ, **_DERIVED),
            _cls_batch,
        ),
        PPCase(
            "qwen2-lm-tied",
            fam.derived("tiny_qwen2_config", "Qwen2ForCausalLM", **_DERIVED),
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
