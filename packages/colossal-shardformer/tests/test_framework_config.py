"""ShardConfig validation, policy lookup, the derived-plan policy's structure and its errors.

Single-process tests (no process group): nothing here needs communication.
"""

from __future__ import annotations

import pytest
import torch
from _models import tiny_llama_config, tiny_qwen2_config
from torch import nn

from colossal.shardformer.policies.auto_policy import get_autopolicy, hand_written_policies
from colossal.shardformer.policies.tp_plan import TPPlanPolicy, model_tp_plan
from colossal.shardformer.shard import ShardConfig, ShardFormer

# --- ShardConfig ----------------------------------------------------------------------------


def test_shard_config_defaults_follow_colossalai() -> None:
    c = ShardConfig()
    assert c.enable_tensor_parallelism and c.parallel_output
    assert c.make_vocab_size_divisible_by == 64
    assert not (c.enable_fused_normalization or c.enable_flash_attention or c.enable_jit_fused)
    assert c.tensor_parallel_size == 1  # no process group: one rank


def test_enable_all_optimization_turns_on_the_fused_paths() -> None:
    c = ShardConfig(enable_all_optimization=True)
    assert c.enable_fused_normalization and c.enable_flash_attention and c.enable_jit_fused


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"make_vocab_size_divisible_by": 0}, ValueError, "make_vocab_size_divisible_by"),
        ({"make_vocab_size_divisible_by": 2.0}, ValueError, "make_vocab_size_divisible_by"),
        ({"parallel_output": 1}, TypeError, "parallel_output"),
        ({"tensor_parallel_process_group": "tp"}, TypeError, "ProcessGroup"),
        ({"sequence_parallelism_mode": "ring"}, ValueError, "enable_sequence_parallelism"),
        (
            {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "zigzag"},
            ValueError,
            "split_gather",
        ),
        (
            {
                "enable_sequence_parallelism": True,
                "sequence_parallelism_mode": "split_gather",
                "enable_tensor_parallelism": False,
            },
            ValueError,
            "enable_tensor_parallelism=True",
        ),
        ({"sequence_parallel_process_group": 2}, TypeError, "sequence_parallel_process_group"),
        ({"enable_sequence_overlap": True}, ValueError, "enable_sequence_parallelism"),
        ({"pipeline_stage_manager": object()}, TypeError, "PipelineStageManager"),
        ({"gradient_checkpoint_config": object()}, TypeError, "get_num_ckpt_layers"),
    ],
)
def test_shard_config_rejects_bad_options(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        ShardConfig(**kwargs)


def test_shardformer_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="ShardConfig"):
        ShardFormer({"parallel_output": True})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Policy instance"):
        ShardFormer(ShardConfig()).optimize(nn.Linear(2, 2), policy=TPPlanPolicy)


# --- policy lookup --------------------------------------------------------------------------


def test_autopolicy_prefers_hand_written_then_the_tp_plan() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    hand = hand_written_policies()
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    if "GPT2LMHeadModel" in hand:
        assert isinstance(get_autopolicy(gpt2), hand["GPT2LMHeadModel"])
    assert isinstance(get_autopolicy(LlamaForCausalLM(tiny_llama_config(1))), TPPlanPolicy)


def test_unsupported_model_names_the_class_and_the_custom_policy_route() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(NotImplementedError, match=r"Tiny.*policy=MyPolicy\(\)"):
        ShardFormer(ShardConfig()).optimize(Tiny())


# --- the derived policy ---------------------------------------------------------------------


def _policy_for(model: nn.Module, **config: object) -> TPPlanPolicy:
    policy = get_autopolicy(model)
    assert isinstance(policy, TPPlanPolicy)
    policy.set_model(model)
    policy.set_shard_config(ShardConfig(**config))  # type: ignore[arg-type]
    return policy


def test_llama_plan_becomes_layers_regions_and_a_vocab_parallel_head() -> None:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from colossal.shardformer.layer import (
        Linear1D_Col,
        Linear1D_Row,
        VocabParallelEmbedding1D,
        VocabParallelLMHead1D,
    )

    model = LlamaForCausalLM(tiny_llama_config(2))
    assert model_tp_plan(model)["lm_head"] == "colwise_gather_output"
    policy_map = _policy_for(model, parallel_output=False).module_policy()
    layer = policy_map[LlamaDecoderLayer]
    targets = {d.suffix: (d.target_module, d.kwargs) for d in layer.sub_module_replacement}
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        assert targets[name] == (Linear1D_Col, {"gather_output": False})
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert targets[name] == (Linear1D_Row, {"parallel_input": True})
    # q/k/v and gate/up share one TP region each: one backward all-reduce, not three.
    assert sorted(layer.tp_region_inputs) == ["mlp", "self_attn"]
    root = policy_map[LlamaForCausalLM]
    roots = {d.suffix: (d.target_module, d.kwargs) for d in root.sub_module_replacement}
    assert roots["lm_head"][0] is VocabParallelLMHead1D
    assert roots["lm_head"][1]["gather_output"] is True  # parallel_output=False
    assert roots["model.embed_tokens"][0] is VocabParallelEmbedding1D


def test_head_counts_must_divide_the_tp_size() -> None:
    from transformers import LlamaForCausalLM

    class FourRanks(TPPlanPolicy):
        tp_size = 4  # type: ignore[assignment]

    model = LlamaForCausalLM(tiny_llama_config(1, num_key_value_heads=2))
    policy = FourRanks()
    policy.set_model(model)
    policy.set_shard_config(ShardConfig())
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by .* 4"):
        policy.config_sanity_check()


def test_unsupported_plan_style_names_style_and_module() -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=2,
    )  # fmt: skip
    policy = _policy_for(MixtralForCausalLM(config))
    with pytest.raises(NotImplementedError, match=r"style '(packed_colwise|moe_tp_experts)'"):
        policy.module_policy()


def test_qwen2_without_dist_is_left_whole_but_keeps_working() -> None:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(1))
    ids = torch.randint(0, 250, (1, 6))
    expected = model(input_ids=ids).logits
    model, shared = ShardFormer(ShardConfig()).optimize(model)
    assert shared == []
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
