"""Hugging Face models in the 2D / 2.5D / 3D tensor-parallel modes against the unsharded model.

``ShardConfig(tensor_parallel_mode=...)`` shards the transformer blocks with the mode's layers
(Llama through its ``base_model_tp_plan``, GPT-2 with its fused ``Conv1D`` q/k/v, BERT, ViT);
:func:`reference_check` compares logits, loss, every gradient (gathered whole through the
parameters' marks), the replicated gradients' agreement over the grid, and the parameters
after SGD steps with the plain model built from the same seed. Also: the whole-tensor state
dict against the plain model's both ways, and the clear errors for shapes that do not divide.

2D at world 4 (q = 2); 2.5D (d = q = 2) and 3D (q = 2) at world 8 in one function (Llama in
both, GPT-2 in 3D).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from _models import causal_lm_batch, reference_check, tiny_llama_config

from colossal.core import ParallelDims
from colossal.core.testing import distributed_test
from colossal.shardformer.shard import ShardConfig, ShardFormer

RTOL = 1e-5


def _gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=250, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip


def _llama(**overrides: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(**overrides))


def _gpt2() -> Any:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(_gpt2_config())


def _check_layers(mode: str, batch_size: int, depth: int = 1) -> None:
    """Llama (grouped-query attention, RMSNorm, padded batch) in ``mode``."""
    batch = causal_lm_batch(250, batch_size=batch_size)
    kwargs = {"tensor_parallel_mode": mode, "tensor_parallel_depth": depth}
    report = reference_check(_llama, batch, kwargs, steps=2, rtol=RTOL)
    # q, k, v, o, gate, up, down and the two norms of both layers; embeddings/head whole
    assert len(report.sharded) == 18, (mode, report.sharded)
    assert not any("embed_tokens" in n or "lm_head" in n for n in report.sharded)


def _check_encoder(build: Any, batch: dict[str, torch.Tensor]) -> None:
    """``reference_check`` in 2D, less the key bias: softmax over the keys is invariant to it,
    so its gradient is zero up to rounding in both models and a relative error means nothing."""
    report = reference_check(build, batch, {"tensor_parallel_mode": "2d"}, steps=2, rtol=RTOL,
                             check=False)  # fmt: skip
    failures = [f for f in report.failures if not any(k in f for k in ("key.bias", "k_proj.bias"))]
    assert not failures, failures
    assert len(report.sharded) == 32, report.sharded  # 6 linears + 2 norms, weight and bias


def _check_full_state_dict(build: Any, mode: str) -> None:
    """The whole-tensor state dict equals the plain model's, and a plain one loads into parts."""
    from colossal.shardformer.layer import enable_full_state_dict

    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    model, _ = ShardFormer(ShardConfig(tensor_parallel_mode=mode)).optimize(build())
    enable_full_state_dict(model)
    whole = model.state_dict()
    expected = plain.state_dict()
    assert set(whole) == set(expected)
    for key, value in expected.items():
        assert torch.equal(whole[key], value), key
    other = {k: v + 1.0 if v.is_floating_point() else v for k, v in expected.items()}
    model.load_state_dict(other)
    for key, value in model.state_dict().items():
        assert torch.equal(value, other[key]), key


@distributed_test(4, timeout=600.0)
def test_tp2d_llama_and_gpt2_match_the_plain_model(rank: int, world_size: int) -> None:
    """Catches: a wrong block of any q/k/v/o/MLP weight (Llama's grouped-query attention, GPT-2's
    fused c_attn reordered per grid block), RMSNorm statistics over a part of the width, the
    attention mask or rotary tensors not split like the activation's rows, heads not divided,
    a replicated embedding/head whose gradient differs between ranks, marks that describe
    the wrong elements (gathered gradients, the state dict both ways), a batch that does not
    divide the grid silently mis-split."""
    torch.set_num_threads(1)
    _check_layers("2d", batch_size=2)
    report = reference_check(_gpt2, causal_lm_batch(250, batch_size=2),
                             {"tensor_parallel_mode": "2d"}, steps=2, rtol=RTOL)  # fmt: skip
    assert len(report.sharded) == 24, report.sharded  # 4 linears + 2 norms, weight and bias
    _check_full_state_dict(_gpt2, "2d")
    model, _ = ShardFormer(ShardConfig(tensor_parallel_mode="2d")).optimize(_llama())
    with pytest.raises(ValueError, match=r"batch size 3 is not divisible by q=2"):
        model(**causal_lm_batch(250, batch_size=3))
    from transformers import GPT2LMHeadModel

    bad = _gpt2_config()
    bad.n_embd, bad.n_head = 66, 6  # head_dim 11: fine for GPT-2, not for the 2x2 grid
    with pytest.raises(ValueError, match=r"hidden_size 66 is not divisible by q\*q=4 for "
                       r"tensor_parallel_mode='2d'"):  # fmt: skip
        ShardFormer(ShardConfig(tensor_parallel_mode="2d")).optimize(GPT2LMHeadModel(bad))


@distributed_test(4, timeout=600.0)
def test_tp2d_bert_and_vit_match_the_plain_model(rank: int, world_size: int) -> None:
    """Catches: BERT's extended attention mask not split by rows, its head attributes
    (num_attention_heads, all_head_size) not divided, LayerNorm after the residual on the
    wrong part; ViT's blocks with a replicated patch embedding and classifier."""
    torch.set_num_threads(1)
    from transformers import BertConfig, BertForMaskedLM, ViTConfig, ViTForImageClassification

    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    bert = BertConfig(vocab_size=250, max_position_embeddings=32, **common)
    _check_encoder(lambda: BertForMaskedLM(bert), causal_lm_batch(250, batch_size=2))
    vit = ViTConfig(image_size=16, patch_size=4, num_channels=3, num_labels=5, **common)
    gen = torch.Generator().manual_seed(5)
    images = {
        "pixel_values": torch.randn(2, 3, 16, 16, generator=gen),
        "labels": torch.randint(0, 5, (2,), generator=gen),
    }
    _check_encoder(lambda: ViTForImageClassification(vit), images)


@distributed_test(8, timeout=900.0)
def test_tp2p5d_and_tp3d_llama_match_the_plain_model(rank: int, world_size: int) -> None:
    """2.5D (depth 2, q 2: batch split 4 ways over depth x column) and 3D (q 2: attention in the
    cube's swapped orientation, so the mask is split by that orientation's rows) for Llama;
    GPT-2 in 3D."""
    torch.set_num_threads(1)
    _check_layers("2.5d", batch_size=4, depth=2)
    _check_layers("3d", batch_size=4)
    # GPT-2's fused c_attn under the cube's nested levels (out split by input, then weight)
    report = reference_check(_gpt2, causal_lm_batch(250, batch_size=4),
                             {"tensor_parallel_mode": "3d"}, steps=2, rtol=RTOL)  # fmt: skip
    assert len(report.sharded) == 24, report.sharded
    assert dist.get_world_size() == 8


# ---- validation (no processes) ---------------------------------------------------------------


def test_grid_mode_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_mode='4d' is not one of"):
        ShardConfig(tensor_parallel_mode="4d")
    with pytest.raises(ValueError, match=r"tensor_parallel_depth=2 applies to .*'2.5d' only"):
        ShardConfig(tensor_parallel_mode="2d", tensor_parallel_depth=2)
    dims = ParallelDims(tp=4, tp_mode="2d", world_size=4)
    with pytest.raises(ValueError, match=r"parallel_dims has tp_mode='2d'"):
        ShardConfig(tensor_parallel_mode="3d", parallel_dims=dims)
    with pytest.raises(ValueError, match=r"does not support enable_sequence_parallelism"):
        ShardConfig(tensor_parallel_mode="2d", enable_sequence_parallelism=True)


def test_grid_plan_sizes_name_the_dimension_and_grid() -> None:
    from colossal.shardformer.grid import GridPlan, check_grid_plan, grid_mode

    plan = GridPlan(layers="layers", linears={}, widths={"hidden_size": 96},
                    head_counts={"num_attention_heads": 6})  # fmt: skip
    three = grid_mode(ParallelDims(tp=8, tp_mode="3d", world_size=8))
    check_grid_plan("M", plan, three)  # 96 % 4 == 0, 6 % 2 == 0
    two = grid_mode(ParallelDims(tp=9, tp_mode="2d", world_size=9))
    grid = r"tensor_parallel_mode='2d' \(a 3 x 3 grid of tp=9 ranks, q=3\)"
    with pytest.raises(ValueError, match=r"hidden_size 96 is not divisible by q\*q=9 for " + grid):
        check_grid_plan("M", plan, two)
    heads = GridPlan(layers="layers", linears={}, head_counts={"num_attention_heads": 6})
    deep = grid_mode(ParallelDims(tp=32, tp_mode="2.5d", tp_depth=2, world_size=32))
    with pytest.raises(ValueError, match=r"num_attention_heads 6 is not divisible by q=4"):
        check_grid_plan("M", heads, deep)
