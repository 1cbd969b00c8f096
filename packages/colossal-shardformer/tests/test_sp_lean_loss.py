"""The sequence-parallel causal-LM loss keeps no log-probabilities for the backward.

With the LM head on this rank's tokens (``all_to_all`` / ``ring_attn``, ``parallel_output``),
transformers' ``ForCausalLMLoss`` is replaced by ``colossal.kernels.cross_entropy``, which
saves the logits (alive anyway) and a per-row log-sum-exp instead of ``F.cross_entropy``'s
float32 ``(tokens / P, V)`` log-probabilities.

One spawn at SP 2, tiny Llama, both modes:

* loss and every gradient equal the unsharded model's (``check_family``; the ring case passes
  ``num_items_in_batch``): catches a lean loss that differs from ``ForCausalLMLoss``
  (shift, ``ignore_index``, divisor, float32 upcast);
* the tensors saved for the backward during the forward hold no ``(..., V)`` floating tensor
  other than the returned logits: catches the lean path not taken (``F.cross_entropy``
  saving its log-probabilities). A control with the detection of transformers' loss
  switched off shows the check sees the log-probabilities then.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colossal.core.testing import distributed_test


def _vocab_sized_saved(model: Any, b: dict[str, torch.Tensor], vocab: int) -> list[Any]:
    """``(shape, dtype)`` of saved ``(..., vocab)`` float tensors: not the logits, no weight.

    (The LM head's matmul saves its weight transposed, ``(hidden, vocab)``.)
    """
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[-1] == vocab and t.is_floating_point():
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**b)
    assert out.logits.shape[1] < b["input_ids"].shape[1], "the head must run on local tokens"
    alive = {out.logits.untyped_storage().data_ptr()}
    alive |= {p.untyped_storage().data_ptr() for p in model.parameters()}
    out.loss.backward()
    return [(tuple(t.shape), t.dtype) for t in saved if t.untyped_storage().data_ptr() not in alive]


def _lean_cases(rank: int, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import _sp_attention_cases as c
    from _families import VOCAB

    from colossal.shardformer import ShardConfig, ShardFormer
    from colossal.shardformer.sequence import sharded_head

    llama = c.derived("tiny_llama_config")
    items = {"num_items_in_batch": torch.tensor(9)}
    for mode, extra in (("all_to_all", {}), ("ring_attn", items)):
        kw = c.sp_kwargs(mode)
        b = {**c.batch(), **extra}
        c.check_family(llama, b, f"Llama {mode}, lean loss", kw, steps=0, local=True)
        torch.manual_seed(0)
        model, _ = ShardFormer(ShardConfig(**kw)).optimize(llama())
        found = _vocab_sized_saved(model, b, VOCAB)
        assert found == [], f"{mode}: saved {found}"

    # control: transformers' loss not recognised -> F.cross_entropy saves its log-probs
    monkeypatch.setattr(sharded_head, "_is_transformers_causal_loss", lambda fn: False)
    torch.manual_seed(0)
    model, _ = ShardFormer(ShardConfig(**c.sp_kwargs("all_to_all"))).optimize(llama())
    found = _vocab_sized_saved(model, c.batch(), VOCAB)
    assert (found and all(dtype == torch.float32 for _, dtype in found)), found


@distributed_test(2)
def test_sp_lean_loss(rank: int, world_size: int) -> None:
    """SP 2, Ulysses and ring: unsharded loss and gradients, and no saved log-probabilities."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _lean_cases(rank, world_size, monkeypatch)
