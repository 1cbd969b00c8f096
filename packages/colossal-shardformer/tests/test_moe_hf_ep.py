"""``apply_expert_parallel`` on tiny Hugging Face MoE models against the single-process model.

Every rank builds the same whole model from one seed (the reference) and an expert-parallel
copy, and feeds both the same batch. The EP copy's loss and non-expert gradients must equal the
reference's; each local expert gradient must equal ``ep`` times the reference's slice (every rank
sends the same tokens, so each expert sees them ``ep`` times). Dividing the expert gradients by
``ep`` (what data-parallel averaging does) then makes AdamW steps match the reference exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from colossal.core import CommTracker, shard_spec
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.moe import HFExpertParallelExperts, apply_expert_parallel

RTOL = 1e-5
H, VOCAB, BATCH, SEQ = 32, 64, 2, 6
_COMMON = {"vocab_size": VOCAB, "hidden_size": H, "max_position_embeddings": 32}


def _mixtral(num_experts: int = 4) -> PreTrainedModel:
    config = MixtralConfig(
        **_COMMON,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=num_experts,
        num_experts_per_tok=2,
    )
    return MixtralForCausalLM(config)


def _deepseek() -> PreTrainedModel:
    config = DeepseekV3Config(  # layer 0 dense, layers 1-2 MoE with grouped routing
        **_COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )
    return DeepseekV3ForCausalLM(config)


def _qwen3() -> PreTrainedModel:
    config = Qwen3MoeConfig(
        **_COMMON,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return Qwen3MoeForCausalLM(config)


FAMILIES: dict[str, Callable[[], PreTrainedModel]] = {
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek,
    "qwen3_moe": _qwen3,
}


def _pair(build: Callable[[], PreTrainedModel]) -> tuple[PreTrainedModel, PreTrainedModel]:
    torch.manual_seed(0)
    ref = build().float()
    ep = copy.deepcopy(ref)
    return ref, ep


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
    return loss


def _ref_slice(model: nn.Module, name: str, ep: nn.Module, grad: bool) -> torch.Tensor:
    """The reference tensor (or gradient) for ``ep``'s parameter ``name`` (its slice if expert)."""
    p = model.get_parameter(name)
    q = ep.get_parameter(name)
    t = p.grad if grad else p.detach()
    if t is None:
        t = torch.zeros_like(p)
    spec = shard_spec(q)
    if spec is None or spec.axis("ep") is None:
        return t
    module = ep.get_submodule(name.rpartition(".")[0])
    assert isinstance(module, HFExpertParallelExperts)
    lo = module.first_expert
    return t[lo : lo + module.num_local_experts]


def _check_grads(ref: nn.Module, ep: nn.Module, ep_size: int, family: str) -> None:
    experts = 0
    for name, q in ep.named_parameters():
        assert q.grad is not None, f"{family}: {name} has no gradient"
        want = _ref_slice(ref, name, ep, grad=True)
        is_expert = shard_spec(q) is not None
        experts += is_expert
        scale = ep_size if is_expert else 1
        assert_rel_close(q.grad, want * scale, RTOL, f"{family}: {name}.grad")
    assert experts > 0 or ep_size == 1, f"{family}: no expert parameter was marked"


def _routed_choices(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE layer's ``top_k_index`` on ``ids`` (hooks on the experts modules)."""
    seen: list[torch.Tensor] = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
        for name, m in model.named_modules()
        if name.endswith("mlp.experts")
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return seen


def _check_family(family: str, world: dist.ProcessGroup, rank: int, ep_size: int) -> None:
    ref, ep = _pair(FAMILIES[family])
    replaced = apply_expert_parallel(ep, world)
    layers = [n for n, m in ref.named_modules() if n.endswith("mlp.experts")]
    assert replaced == layers and layers, f"{family}: replaced {replaced}, expected {layers}"
    ids = _batch()
    choices = _routed_choices(ref, ids)
    ref_loss = _loss(ref, ids)
    ref_loss.backward()
    with CommTracker() as fwd:
        loss = _loss(ep, ids)
    assert_rel_close(loss.detach(), ref_loss.detach(), RTOL, f"{family}: loss")
    with CommTracker() as bwd:
        loss.backward()
    _check_grads(ref, ep, ep_size, family)
    # per MoE layer: counts all-to-all (E int64) + tokens there and back; backward both reversed
    num_experts = ep.get_submodule(layers[0]).num_experts
    local = num_experts // ep_size
    lo = rank * local
    token_bytes = 0
    for idx in choices:
        send = idx.numel()  # dropless: every (token, choice) travels
        recv = ep_size * int(((idx >= lo) & (idx < lo + local)).sum())  # same batch on all ranks
        token_bytes += (send + recv) * H * 4
    moe_layers = len(layers)
    assert fwd.calls("all_to_all") == 3 * moe_layers and fwd.calls() == 3 * moe_layers
    assert fwd.bytes("all_to_all") == moe_layers * num_experts * 8 + token_bytes
    assert bwd.calls("all_to_all") == 2 * moe_layers and bwd.calls() == 2 * moe_layers
    assert bwd.bytes("all_to_all") == token_bytes
    _check_adamw(ref, ep, ids, ep_size, family)


def _check_adamw(ref: nn.Module, ep: nn.Module, ids: torch.Tensor, ep_size: int, fam: str) -> None:
    before = {n: q.detach().clone() for n, q in ep.named_parameters()}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt_ep = torch.optim.AdamW(ep.parameters(), lr=1e-2)
    for step in range(3):
        if step:  # step 0 reuses the gradients checked above
            for model in (ref, ep):
                model.zero_grad()
                _loss(model, ids).backward()
        for q in ep.parameters():
            if shard_spec(q) is not None and q.grad is not None:
                q.grad.div_(ep_size)  # the data-parallel mean over the ep ranks' (equal) batches
        opt_ref.step()
        opt_ep.step()
    for name, q in ep.named_parameters():
        want = _ref_slice(ref, name, ep, grad=False)
        assert_rel_close(q.detach(), want, RTOL, f"{fam}: {name} after 3 AdamW steps")
        assert not torch.equal(q.detach(), before[name]), f"{fam}: {name} did not move"


@distributed_test(2, 4)
def test_hf_models_match_single_process(rank: int, world_size: int) -> None:
    """Loss, every gradient, the exact all-to-alls and 3 AdamW steps of EP HF models.

    Catches: wrong expert slice per rank, gate_up/down layout or act mix-up, wrong combine
    weights, dropped top-k choices, expert grads not summed over ranks, extra or missing
    collectives, wrong token bytes, shared experts or routers split by mistake (DeepSeek-V3
    grouped routing, Qwen3-MoE), parameter names changed (optimizer/aliases break).
    """
    torch.set_num_threads(1)
    world = dist.group.WORLD
    assert world is not None
    for family in FAMILIES:
        _check_family(family, world, rank, world_size)


@distributed_test(2)
def test_starved_experts_and_bad_ep_size(rank: int, world_size: int) -> None:
    """All tokens forced onto rank 0's experts: the step completes, rank 1's grads are zero.

    Catches: a rank skipping a collective when it has no token (hang), starved experts with no
    (None) gradient, wrong results when a rank receives nothing; a non-dividing ep size passing.
    """
    torch.set_num_threads(1)
    world = dist.group.WORLD
    assert world is not None
    ref, ep = _pair(_mixtral)
    names = apply_expert_parallel(ep, world)

    def force_low(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, index, weights = args
        return hidden, index % 2, weights  # experts 0 and 1: rank 0's

    for model in (ref, ep):
        for name in names:
            model.get_submodule(name).register_forward_pre_hook(force_low)
    ids = _batch()
    _loss(ref, ids).backward()
    _loss(ep, ids).backward()
    _check_grads(ref, ep, world_size, "forced mixtral")
    for name in names:
        for p in ep.get_submodule(name).parameters():
            assert p.grad is not None
            assert bool((p.grad == 0).all()) == (rank == 1), f"rank {rank} {name} grad"
    with pytest.raises(ValueError, match=r"3 experts.*ep group of 2"):
        apply_expert_parallel(_mixtral(num_experts=3), world)


def test_single_rank_keeps_all_experts_and_matches() -> None:
    """ep_group None: all experts kept, no communication, same loss and gradients.

    Catches: the local path mis-slicing or re-laying out the weights, names changed, a module
    replaced twice.
    """
    ref, ep = _pair(_mixtral)
    names = apply_expert_parallel(ep, None)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert apply_expert_parallel(ep, None) == []  # already expert-parallel: left alone
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ep.named_parameters()]
    ids = _batch()
    ref_loss = _loss(ref, ids)
    ref_loss.backward()
    with CommTracker() as tracker:
        loss = _loss(ep, ids)
        loss.backward()
    assert tracker.calls() == 0
    assert_rel_close(loss.detach(), ref_loss.detach(), RTOL, "loss")
    _check_grads(ref, ep, 1, "mixtral ep1")


def test_non_moe_model_is_rejected() -> None:
    """Catches: a dense model (GPT-2) silently passing with nothing split."""
    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*Mixtral"):
        apply_expert_parallel(GPT2LMHeadModel(config), None)
