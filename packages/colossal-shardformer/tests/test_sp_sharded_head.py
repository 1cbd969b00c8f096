"""The causal-LM head and loss on sequence shards (``all_to_all`` / ``ring_attn``).

End to end (spawned, folded into the existing spawns to keep the CI budget): every causal
LM family of ``test_sp_ulysses`` / ``test_sp_ring`` (Llama, Qwen2 tied, GPT-2 tied, OPT;
TP 2 x SP 2 Llama in ``test_attention_modes_world4``) returns this rank's logits, equal to
the unsharded logits at its ``token_indices``, with the unsharded loss and every gradient
after ``SequenceParallelGradSync``; ``_sp_attention_cases.head_cases`` adds a batch with
no label on rank 0's tokens, ``parallel_output=False`` and the head/norm sync.

Here, in one process (no communication: the group's sum is done by the test): the loss
wrapper's arithmetic for every layout, and which models get a sharded head.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from colossal.shardformer.layer import causal_lm_loss_fn
from colossal.shardformer.sequence import (
    SequenceParallelState,
    sequence_parallel_causal_loss,
    token_indices,
)
from colossal.shardformer.sequence import sharded_head as sh

VOCAB = 11


class _Identity:
    """Stands for the group's sum: the test adds the ranks' results itself."""

    @staticmethod
    def apply(x: torch.Tensor, group: Any) -> torch.Tensor:
        return x


def _labels(b: int, s: int, layout: str, size: int) -> torch.Tensor:
    """Random labels, row 1 left-padded, and no label at all for rank 0's tokens of row 0."""
    gen = torch.Generator().manual_seed(5)
    labels = torch.randint(0, VOCAB, (b, s), generator=gen)
    labels[1, : s // 4] = -100
    targets = token_indices(s, 0, size, layout) + 1  # token t predicts label t + 1
    labels[0, targets[targets < s]] = -100
    return labels


@pytest.mark.parametrize(
    ("layout", "size"), [("contiguous", 2), ("zigzag", 2), ("contiguous", 4), ("zigzag", 4)]
)
def test_loss_over_ranks_is_global(
    monkeypatch: pytest.MonkeyPatch, layout: str, size: int
) -> None:
    """The ranks' losses sum to the unsharded loss; their gradients are its gradient's slices.

    Catches: labels sliced before the shift (the last token of a rank's chunk would predict
    its own chunk's next label, not the global one); the wrong token order (zigzag); a
    per-rank token count or mean (row 0 has no label on rank 0's tokens; counts differ per
    rank); ``num_items_in_batch`` ignored; a wrapper that only works with transformers'
    loss (also the vocab-parallel ``causal_lm_loss_fn``).
    """
    monkeypatch.setattr(sh, "_SumOverGroup", _Identity)
    b, s = 2, 16
    labels = _labels(b, s, layout, size)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(b, s, VOCAB, generator=gen)
    for name, inner in (("ForCausalLMLoss", ForCausalLMLoss), ("vocab", causal_lm_loss_fn(None))):
        for items in (None, torch.tensor(7)):
            full = logits.clone().requires_grad_()
            ref = ForCausalLMLoss(full, labels, VOCAB, num_items_in_batch=items)
            ref.backward()
            total = torch.zeros(())
            grads = torch.zeros_like(logits)
            for rank in range(size):
                state = SequenceParallelState(group=None, layout=layout, mode="x", size=size,
                                              rank=rank)  # fmt: skip
                index = token_indices(s, rank, size, layout)
                local = logits[:, index].clone().requires_grad_()
                loss = sequence_parallel_causal_loss(inner, state)(
                    local, labels, VOCAB, num_items_in_batch=items
                )
                loss.backward()
                total = total + loss.detach()
                grads[:, index] = local.grad
            what = f"{name}, num_items_in_batch={items}"
            torch.testing.assert_close(total, ref.detach(), rtol=1e-6, atol=0, msg=what)
            assert full.grad is not None
            torch.testing.assert_close(grads, full.grad, rtol=1e-6, atol=1e-8, msg=what)


def test_loss_refuses_a_wrong_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits neither of the whole sequence nor of this rank's share: a ValueError naming them.

    Full-length logits go to the wrapped loss unchanged (``logits_to_keep``-style calls).
    """
    monkeypatch.setattr(sh, "_SumOverGroup", _Identity)
    state = SequenceParallelState(group=None, layout="contiguous", mode="x", size=2, rank=1)
    fn = sequence_parallel_causal_loss(ForCausalLMLoss, state)
    labels = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match="logits hold 3 tokens.*8.*2 ranks"):
        fn(torch.randn(1, 3, VOCAB), labels, VOCAB)
    whole = torch.randn(1, 8, VOCAB)
    assert torch.equal(fn(whole, labels, VOCAB), ForCausalLMLoss(whole, labels, VOCAB))


def test_which_heads_run_on_local_tokens() -> None:
    """Decided from data: causal LMs (policy ``loss`` or ``loss_type``), attention modes only.

    ``"local_exit"`` where the model's pipeline plan lists the modules after the stack
    (Llama, Qwen2); ``"split_head"`` otherwise (GPT-2's base model reshapes the stack's
    output to the input's length, so its exit must stay whole); None for heads that are not
    token-wise causal LMs, ``parallel_output=False`` and ``split_gather``. Catches a
    classification or masked-LM head put on local tokens (its loss would be wrong).
    """
    import _sp_attention_cases as c

    from colossal.shardformer import ShardConfig
    from colossal.shardformer.policies.auto_policy import get_autopolicy
    from colossal.shardformer.shard.stack import find_layer_stack

    kw = c.sp_kwargs("ring_attn")
    attention = ShardConfig(**kw)
    gathered = ShardConfig(**{**kw, "parallel_output": False})
    megatron = ShardConfig(enable_sequence_parallelism=True,
                           sequence_parallelism_mode="split_gather")  # fmt: skip
    cases = [
        (c.derived("tiny_llama_config"), "local_exit"),
        (c.derived("tiny_qwen2_config", "Qwen2ForCausalLM"), "local_exit"),
        (c.gpt2(), "split_head"),
        (c.opt(), "split_head"),
        (c.bert(), None),
        (c.vit(), None),
        (c.gpt2("GPT2ForSequenceClassification"), None),
        (c.derived("tiny_llama_config", "LlamaForSequenceClassification"), None),
        (c.derived("tiny_llama_config", "LlamaModel"), None),
    ]
    for build, want in cases:
        model = build()
        path, _ = find_layer_stack(model)
        policy = get_autopolicy(model)
        name = type(model).__name__
        assert sh.sharded_head_mode(model, attention, path, policy) == want, name
        assert sh.sharded_head_mode(model, gathered, path, policy) is None, name
        assert sh.sharded_head_mode(model, megatron, path, policy) is None, name
