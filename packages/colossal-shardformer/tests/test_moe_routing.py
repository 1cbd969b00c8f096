"""MoE routers, losses and the aux-loss-free bias against hand-computed values (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from colossal.shardformer.moe import (
    NormalNoiseGenerator,
    Top1Router,
    Top2Router,
    TopKRouter,
    UniformNoiseGenerator,
    expert_capacity,
    load_balancing_loss,
    router_z_loss,
    update_balance_bias,
)

torch.set_num_threads(1)


def test_load_balancing_loss_formula() -> None:
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    idx = torch.tensor([[0, 1], [1, 2], [0, 1], [2, 0]])
    # P_e: column means; f_e: (choices of e) / T; loss = E / k * sum P_e f_e
    p = [(0.7 + 0.1 + 0.5 + 0.2) / 4, (0.2 + 0.6 + 0.25 + 0.2) / 4, (0.1 + 0.3 + 0.25 + 0.6) / 4]
    f = [3 / 4, 3 / 4, 2 / 4]
    expected = 3 / 2 * sum(a * b for a, b in zip(p, f, strict=True))
    assert load_balancing_loss(probs, idx, 3).item() == pytest.approx(expected, rel=1e-6)
    top1 = idx[:, :1]  # Switch: E * sum f_e P_e
    f1 = [2 / 4, 1 / 4, 1 / 4]
    expected1 = 3 * sum(a * b for a, b in zip(p, f1, strict=True))
    assert load_balancing_loss(probs, top1, 3).item() == pytest.approx(expected1, rel=1e-6)


def test_z_loss_formula() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 3.0]])
    rows = [math.log(sum(math.exp(v) for v in row)) for row in logits.tolist()]
    expected = sum(r * r for r in rows) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)


def test_router_sets_losses_from_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(10, 4)
    router = TopKRouter(2, capacity_factor_train=None)
    routing = router(logits)
    probs = torch.softmax(logits, -1)
    idx = torch.topk(probs, 2, -1).indices
    assert torch.equal(routing.expert_idx, idx)
    assert torch.allclose(routing.weights, probs.gather(1, idx))
    assert router.aux_loss is not None and router.z_loss is not None
    assert torch.allclose(router.aux_loss, load_balancing_loss(probs, idx, 4))
    assert torch.allclose(router.z_loss, router_z_loss(logits))
    assert torch.allclose(router.pop_routing_loss(), load_balancing_loss(probs, idx, 4))
    assert router.aux_loss is None


def test_capacity_rule() -> None:
    assert expert_capacity(2, 1.25, 8, 4, 4) == 6  # floor(5) = 5 -> even 6
    assert expert_capacity(1, 0.5, 6, 2, 1) == 2  # floor(1.5) = 1 -> even 2
    assert expert_capacity(1, 1.0, 8, 4, 4) == 4  # floor(2) = 2 -> min 4


def test_capacity_drops_first_come_top1_before_top2() -> None:
    # every token prefers expert 0, then expert 1; capacity 2
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 4)
    router = TopKRouter(2, capacity_factor_train=0.5, min_capacity=1)
    assert router.capacity(4, 3) == 2  # floor(2 * 0.5 * 4 / 3) = 1 -> even 2
    routing = router(logits)
    keep = routing.keep.tolist()
    assert keep == [[True, True], [True, True], [False, False], [False, False]]
    assert torch.all(routing.weights[2:] == 0)
    assert routing.load().tolist() == [2, 2, 0]
    router.eval()  # capacity_factor_eval 2.0: capacity floor(2*2*4/3)=5 -> 6
    assert bool(router(logits).keep.all())


def test_dropless_and_colossalai_drop_tks() -> None:
    logits = torch.tensor([[3.0, 0.0]] * 8)
    router = Top1Router(capacity_factor_train=0.5, min_capacity=1, drop_tks=False)
    assert router.k_value == 1 and Top2Router().k_value == 2
    assert not bool(router(logits).keep.all())  # training: the capacity drops
    router.eval()
    assert bool(router(logits).keep.all())  # evaluation with drop_tks=False: dropless
    assert bool(TopKRouter(1, capacity_factor_train=None)(logits).keep.all())


def test_aux_loss_free_bias() -> None:
    bias = torch.zeros(3)
    update_balance_bias(bias, torch.tensor([5, 1, 3]), 0.1)  # mean 3: sign(3 - load)
    assert torch.allclose(bias, torch.tensor([-0.1, 0.1, 0.0]))
    router = TopKRouter(1, capacity_factor_train=None, num_experts=3, bias_update_rate=0.5)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3 + [[0.2, 0.3, 0.5]]))
    routing = router(logits)
    assert routing.expert_idx.reshape(-1).tolist() == [0, 0, 0, 2]
    router.update_bias()  # load [3, 0, 1], mean 4/3 -> sign [-1, +1, +1]
    assert router.expert_bias is not None
    assert torch.allclose(router.expert_bias, torch.tensor([-0.5, 0.5, 0.5]))
    routing = router(logits)  # biased [0, .8, .7] and [-.3, .8, 1]; the weights stay unbiased
    assert routing.expert_idx.reshape(-1).tolist() == [1, 1, 1, 2]
    assert torch.allclose(routing.weights.reshape(-1), torch.tensor([0.3, 0.3, 0.3, 0.5]))


def test_noise_generators() -> None:
    x = torch.randn(5, 4)
    torch.manual_seed(3)
    noisy = NormalNoiseGenerator(4)(x)
    torch.manual_seed(3)
    assert torch.allclose(noisy, x + torch.randn(5, 4) / 16)
    y = torch.ones(200, 4)
    factors = UniformNoiseGenerator(0.1)(y)
    assert bool((factors >= 0.9).all()) and bool((factors < 1.1).all())
    assert float(factors.std()) > 0
    router = Top1Router(noisy_func=UniformNoiseGenerator(0.5), capacity_factor_train=None)
    router.eval()  # no noise in evaluation
    logits = torch.randn(6, 3)
    assert torch.allclose(router(logits).weights[:, 0], torch.softmax(logits, -1).max(-1).values)


def test_random_select_policy_keeps_capacity_many() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[3.0, 0.0]] * 10 + [[0.0, 3.0]])
    router = Top1Router(capacity_factor_train=0.5, min_capacity=1, select_policy="random")
    assert router.capacity(11, 2) == 2
    kept = [router(logits).keep[:, 0] for _ in range(8)]
    assert all(int(k[:10].sum()) == 2 and bool(k[10]) for k in kept)
    assert any(not torch.equal(k, kept[0]) for k in kept)  # not always the first two
    with pytest.raises(ValueError, match="select_policy"):
        Top1Router(select_policy="last")
