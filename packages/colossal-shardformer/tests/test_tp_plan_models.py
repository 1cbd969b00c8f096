"""Policies derived from transformers' ``base_model_tp_plan``: Llama (grouped-query
attention), Mistral and Qwen2 (tied embeddings, q/k/v bias) at TP 2 and 4 against the
unsharded model, bf16 at TP 2, and Megatron's communication count per decoder layer.

One spawned run per world size keeps the package's CI budget.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from _models import (
    causal_lm_batch,
    reference_check,
    tiny_llama_config,
    tiny_mistral_config,
    tiny_qwen2_config,
)

from colossal.core import CommTracker
from colossal.core.testing import distributed_test

BF16_RTOL = 3e-2
"""bf16 keeps 8 mantissa bits (relative step 2**-8 = 3.9e-3); a sharded reduction order
changes the rounding of every matmul, and the errors add up over 2 layers, the loss and 5
steps. Measured worst case about 1e-2 (see the test's report)."""


def _families() -> list[tuple[str, Any]]:
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    return [
        ("llama", lambda: LlamaForCausalLM(tiny_llama_config())),
        ("mistral", lambda: MistralForCausalLM(tiny_mistral_config())),
        ("qwen2", lambda: Qwen2ForCausalLM(tiny_qwen2_config())),
    ]


def _layer_comm(num_layers: int) -> tuple[CommTracker, CommTracker]:
    from transformers import LlamaForCausalLM

    from colossal.shardformer.shard import ShardConfig, ShardFormer

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=num_layers))
    model, _ = ShardFormer(ShardConfig()).optimize(model)
    batch = causal_lm_batch(model.config.vocab_size)
    with CommTracker() as fwd:
        loss = model(**batch).loss
    with CommTracker() as bwd:
        loss.backward()
    return fwd, bwd


def _check_comm_count() -> None:
    one_fwd, one_bwd = _layer_comm(1)
    two_fwd, two_bwd = _layer_comm(2)
    # Megatron: per layer, one all-reduce forward and one backward for attention and MLP.
    assert two_fwd.calls("all_reduce") - one_fwd.calls("all_reduce") == 2
    assert two_bwd.calls("all_reduce") - one_bwd.calls("all_reduce") == 2
    # ... and nothing else per layer.
    assert two_fwd.calls() - one_fwd.calls() == 2
    assert two_bwd.calls() - one_bwd.calls() == 2


def _check_more_plan_styles(batch: dict[str, torch.Tensor]) -> None:
    """Qwen3: per-head q/k norms ("replicated_with_grad_allreduce": each rank sees only its
    heads, so their gradients are summed over the group). Gemma3: a scaled embedding
    subclass, left replicated together with the LM head tied to it (the vocab-parallel
    layer would drop the scale)."""
    import transformers

    common = dict(
        vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    families = {
        "Qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "Gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    for family, (config_cls, model_cls) in families.items():
        config = config_cls(**common)
        report = reference_check(partial(model_cls, config), batch, {}, steps=1)
        assert any("q_proj" in n for n in report.sharded), family
        if family == "Gemma3":
            assert "model.embed_tokens.weight" not in report.sharded


@distributed_test(2, 4, timeout=240)
def test_tp_plan_families_match_unsharded(rank: int, world_size: int) -> None:
    """Logits, loss, every gradient and 5 SGD steps equal the unsharded model (fp32).

    Catches: a wrong shard of q/k/v with grouped-query attention, a missing or doubled
    all-reduce (the shared TP region at the attention/MLP input), the tied Qwen2 LM head
    losing its tie, vocab padding leaking into the loss, a replicated gradient that differs
    between ranks, and parameter names that stop matching Hugging Face's.
    """
    batch = causal_lm_batch(250)
    for name, build in _families():
        report = reference_check(build, batch, {}, rtol=1e-5)
        assert report.sharded, f"{name}: nothing was sharded"
        assert any("embed_tokens" in n for n in report.sharded), name
    if world_size == 2:
        from transformers import LlamaForCausalLM

        report = reference_check(
            lambda: LlamaForCausalLM(tiny_llama_config()),
            batch,
            {},
            rtol=BF16_RTOL,
            dtype=torch.bfloat16,
        )
        assert report.worst() > 0  # the bf16 run really ran in bf16
        _check_comm_count()
        _check_more_plan_styles(batch)
    else:
        from transformers import LlamaForCausalLM, Qwen2ForCausalLM

        # Gathered logits: users see (..., vocab) and transformers' own loss.
        reference_check(
            lambda: LlamaForCausalLM(tiny_llama_config()), batch, {"parallel_output": False}
        )
        # Colossal attention and fused norms on the sharded copy vs SDPA and native norms.
        reference_check(
            lambda: Qwen2ForCausalLM(tiny_qwen2_config(attn_implementation="sdpa")),
            batch,
            {"enable_all_optimization": True},
            steps=1,
        )
