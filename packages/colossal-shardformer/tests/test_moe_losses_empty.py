"""Router losses when a rank routes no token: 0 with a zero gradient, never NaN (issue 33).

A rank can hold an empty batch slice (uneven data split, the tail of an epoch); the mean over
zero tokens used to make the load-balancing loss and the z-loss NaN, and a NaN added to the
training loss poisons every gradient it is all-reduced with.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.moe import (
    GroupedExperts,
    MoeLayer,
    TopKRouter,
    load_balancing_loss,
    router_z_loss,
)

H, F, E, T = 8, 12, 4, 6


def test_losses_of_no_token_are_zero_with_zero_gradient() -> None:
    """Catches: NaN aux/z loss for ``T == 0`` (mean over nothing); a loss detached from the
    graph (backward would fail) or a non-zero gradient from a rank with no token."""
    logits = torch.zeros(0, E, requires_grad=True)
    router = TopKRouter(2, capacity_factor_train=1.0, min_capacity=1)
    router(logits)
    assert router.aux_loss is not None and router.z_loss is not None
    assert router.aux_loss.item() == 0.0 and router.z_loss.item() == 0.0
    (router.aux_loss + router.z_loss).backward()
    assert logits.grad is not None and logits.grad.shape == (0, E)
    empty_idx = torch.zeros(0, 2, dtype=torch.int64)
    assert load_balancing_loss(torch.zeros(0, E), empty_idx, E).item() == 0.0
    assert router_z_loss(torch.zeros(0, E)).item() == 0.0


def test_losses_with_tokens_keep_their_formula() -> None:
    """Catches: the empty-case guard changing the normal loss (e.g. dividing by ``T + 1``)."""
    torch.manual_seed(0)
    logits = torch.randn(5, E)
    probs = torch.softmax(logits, dim=-1)
    idx = torch.topk(probs, 2, dim=-1).indices
    frac = [sum(int(e in row) for row in idx.tolist()) / 5 for e in range(E)]
    expected = E / 2 * sum(probs[:, e].mean().item() * frac[e] for e in range(E))
    assert math.isclose(load_balancing_loss(probs, idx, E).item(), expected, rel_tol=1e-6)
    z = sum(torch.logsumexp(logits[t], 0).item() ** 2 for t in range(5)) / 5
    assert math.isclose(router_z_loss(logits).item(), z, rel_tol=1e-6)


def test_layer_on_empty_input_has_zero_gradients() -> None:
    """Catches: a NaN training loss or NaN gate/expert gradients from a layer (world 1) fed an
    empty batch slice."""
    torch.manual_seed(0)
    layer = MoeLayer(H, E, TopKRouter(2, None), GroupedExperts(E, H, F, gated=True))
    x = torch.zeros(0, H, requires_grad=True)
    y = layer(x)
    assert layer.router.aux_loss is not None
    loss = y.sum() + 0.01 * layer.router.aux_loss
    assert torch.isfinite(loss) and loss.item() == 0.0
    loss.backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name


def _layer(group: dist.ProcessGroup | None) -> MoeLayer:
    torch.manual_seed(0)
    full = MoeLayer(H, E, TopKRouter(2, None), GroupedExperts(E, H, F, gated=True))
    if group is None:
        return full
    layer = MoeLayer(H, E, TopKRouter(2, None), GroupedExperts(E, H, F, group, gated=True))
    lo = E // dist.get_world_size(group) * dist.get_rank(group)
    hi = lo + E // dist.get_world_size(group)
    with torch.no_grad():
        layer.gate_weight.copy_(full.gate_weight)
        layer.experts.w1.copy_(full.experts.w1[lo:hi])
        layer.experts.w2.copy_(full.experts.w2[lo:hi])
    return layer


@distributed_test(2)
def test_ep_rank_with_no_token_matches_reference(rank: int, world_size: int) -> None:
    """Catches: a rank with zero tokens making the aux loss NaN (and, through the all-reduced
    gate gradient, every rank's gradient NaN), or hanging the all-to-alls; the EP gradients
    must equal a single-process layer run on rank 0's tokens alone."""
    torch.set_num_threads(1)
    world = dist.group.WORLD
    assert world is not None
    torch.manual_seed(1)
    x_all, g_all = torch.randn(T, H), torch.randn(T, H)
    ref = _layer(None)
    y_ref = ref(x_all)
    assert ref.router.aux_loss is not None
    ((y_ref * g_all).sum() + 0.1 * ref.router.aux_loss).backward()

    layer = _layer(world)
    x = x_all if rank == 0 else x_all[:0]
    g = g_all if rank == 0 else g_all[:0]
    y = layer(x)
    aux = layer.router.aux_loss
    assert aux is not None and torch.isfinite(aux)
    if rank == 1:
        assert aux.item() == 0.0
    ((y * g).sum() + 0.1 * aux).backward()
    gate = layer.gate_weight.grad
    assert gate is not None and ref.gate_weight.grad is not None
    dist.all_reduce(gate)
    assert_rel_close(gate, ref.gate_weight.grad, 1e-5, "gate grad")
    lo = E // world_size * rank
    for name in ("w1", "w2"):
        p, q = getattr(layer.experts, name), getattr(ref.experts, name)
        assert q.grad is not None
        assert_rel_close(p.grad, q.grad[lo : lo + E // world_size], 1e-5, f"{name}.grad")
