"""Expert-parallel MoE against a single-process MoE on the same global tokens (gloo, CPU).

Each rank builds the reference layer (all experts local) from one seed and an EP copy holding
its experts; the reference runs every rank's chunk of the global batch (the capacity rule is
per rank's tokens, as in ColossalAI), the EP layer this rank's chunk. Outputs, input gradients,
expert gradients (this rank's slice) and the summed gate gradient must match at 1e-5. The
CommTracker must see the exact all-to-alls and bytes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core import CommTracker, shard_spec
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.moe import Experts, GroupedExperts, MoeLayer, TopKRouter

RTOL = 1e-5
H, F, T = 8, 12, 6


def _router(capacity: bool) -> TopKRouter:
    factor = 1.0 if capacity else None
    return TopKRouter(2, capacity_factor_train=factor, min_capacity=1)


def _layers(
    num_experts: int, capacity: bool, world: dist.ProcessGroup
) -> tuple[MoeLayer, MoeLayer]:
    torch.manual_seed(0)
    ref = MoeLayer(H, num_experts, _router(capacity), GroupedExperts(num_experts, H, F, gated=True))
    ep = MoeLayer(
        H, num_experts, _router(capacity), GroupedExperts(num_experts, H, F, world, gated=True)
    )
    lo = num_experts // dist.get_world_size() * dist.get_rank()
    hi = lo + num_experts // dist.get_world_size()
    with torch.no_grad():
        ep.gate_weight.copy_(ref.gate_weight)
        for name in ("w1", "w2"):
            getattr(ep.experts, name).copy_(getattr(ref.experts, name)[lo:hi])
    return ref, ep


def _check(rank: int, world_size: int, num_experts: int, capacity: bool) -> None:
    world = dist.group.WORLD
    assert world is not None
    ref, ep = _layers(num_experts, capacity, world)
    torch.manual_seed(1)
    x_all = torch.randn(world_size, T, H)
    g_all = torch.randn(world_size, T, H)
    x_ref = x_all.clone().requires_grad_(True)
    ys = [ref(x_ref[c]) for c in range(world_size)]
    sum((y * g_all[c]).sum() for c, y in enumerate(ys)).backward()
    x = x_all[rank].clone().requires_grad_(True)
    with CommTracker() as fwd:
        y = ep(x)
    assert_rel_close(y, ys[rank], RTOL, "output")
    with CommTracker() as bwd:
        (y * g_all[rank]).sum().backward()
    assert x.grad is not None and x_ref.grad is not None
    assert_rel_close(x.grad, x_ref.grad[rank], RTOL, "input grad")
    lo = num_experts // world_size * rank
    hi = lo + num_experts // world_size
    for name in ("w1", "w2"):
        p, q = getattr(ep.experts, name), getattr(ref.experts, name)
        assert_rel_close(p.grad, q.grad[lo:hi], RTOL, f"{name}.grad")
        spec = shard_spec(p)
        assert spec is not None and spec.axis("ep") is not None
        assert tuple(spec.shape) == tuple(q.shape)
    gate = ep.gate_weight.grad
    assert gate is not None and ref.gate_weight.grad is not None
    dist.all_reduce(gate)
    assert_rel_close(gate, ref.gate_weight.grad, RTOL, "gate grad")
    # exact communication: counts (E int64) + tokens out and back; backward: both reversed
    with torch.no_grad():
        kept = [
            ref.router(nn.functional.linear(x_all[c], ref.gate_weight)) for c in range(world_size)
        ]
    send = int(kept[rank].keep.sum())
    recv = sum(int(r.load()[lo:hi].sum()) for r in kept)
    token_bytes = (send + recv) * H * 4
    assert fwd.calls("all_to_all") == 3 and fwd.calls() == 3
    assert fwd.bytes("all_to_all") == num_experts * 8 + token_bytes
    assert bwd.calls("all_to_all") == 2 and bwd.calls() == 2
    assert bwd.bytes("all_to_all") == token_bytes
    if capacity:
        assert any(not bool(r.keep.all()) for r in kept), "the capacity case must drop tokens"


@pytest.mark.parametrize("capacity", [False, True], ids=["dropless", "capacity"])
@distributed_test(2, 4)
def test_ep_matches_single_process(rank: int, world_size: int, capacity: bool) -> None:
    torch.set_num_threads(1)
    _check(rank, world_size, 4, capacity)
    if world_size == 2:
        _check(rank, world_size, 8, capacity)  # two experts per rank


class _FFN(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


@distributed_test(2)
def test_experts_without_tokens_get_zero_grads(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    world = dist.group.WORLD
    assert world is not None
    for experts in (GroupedExperts(4, H, F, world), Experts(_FFN, 4, world, d=H)):
        layer = MoeLayer(H, 4, TopKRouter(1, capacity_factor_train=None), experts)
        with torch.no_grad():  # every token picks expert 0 (rank 0): rank 1 gets none
            layer.gate_weight.zero_()
            layer.gate_weight[0].fill_(1.0)
        x = torch.rand(T, H) + 0.1
        layer(x).sum().backward()
        for name, p in layer.experts.named_parameters():
            assert p.grad is not None, name
        grads = [p.grad for p in layer.experts.parameters() if p.grad is not None]
        if rank == 1:
            assert all(bool((g == 0).all()) for g in grads)
        elif isinstance(experts, Experts):  # expert 0 learns, expert 1 is zero
            first = [p.grad for p in experts.experts[0].parameters() if p.grad is not None]
            second = [p.grad for p in experts.experts[1].parameters() if p.grad is not None]
            assert any(bool((g != 0).any()) for g in first)
            assert all(bool((g == 0).all()) for g in second)
        else:
            assert experts.w1.grad is not None
            assert bool((experts.w1.grad[0] != 0).any()) and bool((experts.w1.grad[1] == 0).all())


@distributed_test(2)
def test_aux_loss_free_bias_uses_the_global_load(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    # rank 0's tokens all pick expert 0, rank 1's expert 1 then 2: global load [3, 2, 1, 0]
    picks = {0: [0, 0, 0], 1: [1, 1, 2]}
    logits = nn.functional.one_hot(torch.tensor(picks[rank]), 4).float() * 5.0
    router = TopKRouter(1, capacity_factor_train=None, num_experts=4, bias_update_rate=0.25)
    router(logits)
    router.update_bias(dist.group.WORLD)  # mean load 1.5: sign [-1, -1, +1, +1]
    assert router.expert_bias is not None
    assert torch.equal(router.expert_bias, torch.tensor([-0.25, -0.25, 0.25, 0.25]))


@distributed_test(2)
def test_module_experts_match_single_process(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    world = dist.group.WORLD
    assert world is not None
    torch.manual_seed(0)
    ref = MoeLayer(H, 4, _router(False), Experts(_FFN, 4, d=H))
    ep = MoeLayer(H, 4, _router(False), Experts(_FFN, 4, world, d=H))
    ep.gate_weight.data.copy_(ref.gate_weight.data)
    assert isinstance(ref.experts, Experts) and isinstance(ep.experts, Experts)
    first = ep.experts.first_expert
    assert first == 2 * rank and ep.experts.num_local_experts == 2
    for j, expert in enumerate(ep.experts.experts):
        expert.load_state_dict(ref.experts.experts[first + j].state_dict())
    torch.manual_seed(1)
    x_all = torch.randn(world_size, T, H)
    sum(ref(x_all[c]).square().sum() for c in range(world_size)).backward()
    ep(x_all[rank]).square().sum().backward()
    for j, expert in enumerate(ep.experts.experts):
        natives = dict(ref.experts.experts[first + j].named_parameters())
        for name, p in expert.named_parameters():
            want = natives[name].grad
            assert p.grad is not None and want is not None
            assert_rel_close(p.grad, want, RTOL, f"expert {first + j}.{name}")
