"""Hand-written policies without processes: every description names real modules and
attributes of the transformers 5.x models, bad sizes are refused, Bloom's ALiBi slice.

These catch a transformers upgrade that renames a module or attribute (the sharder would
fail at run time, or worse, an attribute set on nothing) before any spawned test runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from colossal.shardformer.policies import bert, bloom, gpt2, opt, vit

FAMILIES = (gpt2, bert, vit, opt, bloom)


def _shard_config(tp: int, **overrides: Any) -> Any:
    fields: dict[str, Any] = dict(
        enable_tensor_parallelism=True,
        tensor_parallel_size=tp,
        tensor_parallel_process_group=None,
        pipeline_stage_manager=None,
        parallel_output=True,
        make_vocab_size_divisible_by=64,
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _config(module: Any, **overrides: Any) -> Any:
    import transformers

    common: dict[str, Any] = dict(vocab_size=250, num_labels=3)
    if module is gpt2:
        return transformers.GPT2Config(
            n_embd=64, n_layer=1, n_head=8, pad_token_id=0, **common, **overrides
        )
    if module is bert:
        return transformers.BertConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=8, intermediate_size=128,
            **common, **overrides,
        )
    if module is vit:
        return transformers.ViTConfig(
            image_size=16, patch_size=4, hidden_size=64, num_hidden_layers=1,
            num_attention_heads=8, intermediate_size=128, num_labels=3, **overrides,
        )
    if module is opt:
        return transformers.OPTConfig(
            hidden_size=64, num_hidden_layers=1, ffn_dim=128, num_attention_heads=8,
            word_embed_proj_dim=64, **common, **overrides,
        )
    return transformers.BloomConfig(
        hidden_size=64, n_layer=1, n_head=8, pad_token_id=0, **common, **overrides
    )


def _policy(module: Any, name: str, tp: int, **config_overrides: Any) -> tuple[Any, Any]:
    import transformers

    model = getattr(transformers, name)(_config(module, **config_overrides))
    policy = module.POLICIES[name]()
    policy.set_model(model)
    policy.set_shard_config(_shard_config(tp))
    return policy, model


OPTIONAL = {"BertCrossAttention"}  # only in decoders with add_cross_attention
CASES = [(m, name) for m in FAMILIES for name in m.POLICIES]


@pytest.mark.parametrize(("module", "name"), CASES, ids=[n for _, n in CASES])
def test_descriptions_name_real_modules_and_attributes(module: Any, name: str) -> None:
    """Every key class occurs in the model, every suffix resolves, every attribute exists."""
    from colossal.shardformer.shard.sharder import get_submodule

    policy, model = _policy(module, name, tp=2)
    policy.config_sanity_check()
    policy.preprocess()
    policy_map = policy.module_policy()
    for key, desc in policy_map.items():
        instances = [m for m in model.modules() if isinstance(m, key)]
        assert instances or key.__name__ in OPTIONAL, f"{name}: no {key.__name__} in the model"
        for inst in instances:
            for sub in desc.sub_module_replacement:
                found = get_submodule(inst, sub.suffix)
                assert found is not None or sub.ignore_if_not_exist, (
                    f"{name}: {key.__name__} has no submodule {sub.suffix!r}"
                )
            for attr, value in desc.attribute_replacement.items():
                old = getattr(inst, attr)
                assert isinstance(old, int) and value * 2 == old, (
                    f"{name}: {key.__name__}.{attr}={old}, policy sets {value} at TP 2"
                )
            for suffix in desc.tp_region_inputs:
                assert get_submodule(inst, suffix) is not None
    head = policy.lm_head
    if head is not None:
        assert isinstance(get_submodule(model, head), torch.nn.Linear), f"{name}: {head}"


@pytest.mark.parametrize("module", FAMILIES, ids=[m.__name__.rsplit(".", 1)[-1] for m in FAMILIES])
def test_head_count_not_divisible_is_a_value_error(module: Any) -> None:
    """8 heads over TP 3: a ValueError naming the head count and the fix, before sharding."""
    name = next(iter(module.POLICIES))
    policy, _ = _policy(module, name, tp=3)
    with pytest.raises(ValueError, match=r"=8 is not divisible by the tensor-parallel size 3"):
        policy.config_sanity_check()


def test_refused_configs() -> None:
    """GPT-2 cross-attention and Bloom's slow_but_exact pretraining-TP emulation."""
    policy, _ = _policy(gpt2, "GPT2Model", tp=2, add_cross_attention=True)
    with pytest.raises(ValueError, match="add_cross_attention"):
        policy.config_sanity_check()
    policy, _ = _policy(bloom, "BloomModel", tp=2, pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(ValueError, match="slow_but_exact=False"):
        policy.config_sanity_check()


def test_tensor_parallelism_off_replaces_nothing() -> None:
    """``enable_tensor_parallelism=False``: an empty module policy."""
    policy, _ = _policy(gpt2, "GPT2LMHeadModel", tp=2)
    policy.set_shard_config(_shard_config(2, enable_tensor_parallelism=False))
    assert policy.module_policy() == {}


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "mask"])
def test_alibi_slice_holds_each_ranks_heads(padded: bool) -> None:
    """Rank r's slice equals the ALiBi rows transformers builds for heads r*h..(r+1)*h.

    Catches slicing by rank along the batch-major rows (the wrong heads for batch > 1).
    """
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    heads, tp, batch, seq = 8, 4, 3, 5
    mask = torch.ones(batch, seq, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    full = build_alibi_tensor(mask, heads, torch.float32)
    per_head = full.reshape(batch, heads, 1, seq)
    local = heads // tp
    for rank in range(tp):
        got = bloom.slice_alibi(full, heads, rank, tp)
        want = per_head[:, rank * local : (rank + 1) * local].reshape(batch * local, 1, seq)
        assert torch.equal(got, want)
