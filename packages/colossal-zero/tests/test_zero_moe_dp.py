"""ZeRO over moe_dp for experts, dp for the rest, against one process on the global batch.

World 4: ep 2 x moe_dp 2 (ep groups {0,1}, {2,3}; local experts 0-1 on ep rank 0, 2-3 on ep
rank 1), dense dp 4. The test's MoE layer routes each rank's tokens among the experts of its
own ep rank (top-1), so no layer of colossal-shardformer is needed: an expert's gradient holds
the tokens of the ranks sharing its ep coordinate, and the reference (one process, every
expert) runs each rank's quarter of the batch through the same experts. Expert parameters are
one ``(1, H, H)`` tensor per expert, so an expert without tokens gets no gradient at all on
that rank: the case that hangs ColossalAI's ZeRO-2.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core import Block, ParallelDims, Placement, ScalerConfig, mark_sharded
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.zero import LowLevelZeroOptimizer
from colossal.zero.moe import MoeLowLevelZeroOptimizer, is_expert_param

H, E, EP, T, STEPS = 8, 4, 2, 6, 3
LOCAL = E // EP
MAX_NORM = 0.05  # below every step's norm: clipping is active
RTOL = 1e-5


class _Net(nn.Module):
    """fc_in -> top-1 MoE over the experts of ep coordinate ``c`` -> fc_out."""

    def __init__(self, ep_group: dist.ProcessGroup | None, coord: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(H, H)
        self.gate = nn.Parameter(torch.randn(E, H))
        held = LOCAL if ep_group is not None else E
        self.experts = nn.ParameterList(
            nn.Parameter(torch.randn(1, H, H) / H**0.5) for _ in range(held)
        )
        if ep_group is not None:  # local expert j of ep rank c: block c of a (EP, H, H) whole
            whole = (EP, H, H)
            for p in self.experts:
                mark_sharded(
                    p, Placement("ep", Block.along(whole, 0, coord, coord + 1), ep_group), whole
                )
        self.fc_out = nn.Linear(H, H)

    def route(self, h: torch.Tensor, coord: int, sign: float) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(sign * h @ self.gate[coord * LOCAL : (coord + 1) * LOCAL].T, -1)
        return probs, probs.argmax(-1)

    def forward(self, x: torch.Tensor, coord: int, sign: float) -> torch.Tensor:
        h = torch.sigmoid(self.fc_in(x))
        probs, pick = self.route(h, coord, sign)
        first = coord * LOCAL if len(self.experts) == E else 0
        y = torch.zeros_like(h)
        for j in range(LOCAL):
            mask = pick == j
            if bool(mask.any()):  # an expert without tokens is not in the graph
                w = self.experts[first + j][0]
                y = y.index_put((mask,), (h[mask] @ w) * probs[mask, j : j + 1])
        return self.fc_out(h + y)


def _models(ep_group: dist.ProcessGroup, coord: int, forced: bool) -> tuple[_Net, _Net]:
    torch.manual_seed(0)
    ref = _Net(None, 0)
    if forced:  # sign +1 picks local expert 0 everywhere, sign -1 local expert 1
        with torch.no_grad():
            ref.gate.copy_(torch.tensor([[3.0], [-3.0]]).repeat(EP, H))
    ep = _Net(ep_group, coord)
    with torch.no_grad():
        for name, p in ep.named_parameters():
            if name.startswith("experts."):
                p.copy_(ref.experts[coord * LOCAL + int(name.split(".")[1])])
            else:
                p.copy_(ref.get_parameter(name))
    return ref, ep


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _run(rank: int, stage: int, opt_name: str, forced: bool) -> None:
    dims = ParallelDims(ep=EP)
    ep_group, moe_dp_group = dims.group("ep"), dims.group("moe_dp")
    coord = dims.coordinate("ep")
    coords = [dims.coordinate("ep", r) for r in range(4)]
    signs = [1.0 if not forced or r < 2 else -1.0 for r in range(4)]
    ref, model = _models(ep_group, coord, forced)
    ref_opt = OPTIMIZERS[opt_name](list(ref.parameters()))
    zero = MoeLowLevelZeroOptimizer(
        OPTIMIZERS[opt_name](list(model.parameters())),
        moe_dp_process_group=moe_dp_group,
        partition_grad=stage == 2,
        clip_grad_norm=MAX_NORM,
        reduce_bucket_size=64,  # several buckets per part
    )
    assert zero.ep_size == 2 and zero.expert_optimizer is not None
    assert {id(s.param) for b in zero.expert_optimizer.buckets for s in b.slots} == {
        id(p) for p in model.parameters() if is_expert_param(p)
    }
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x, target = torch.randn(4, T, H), torch.randn(4, T, H)
        if step == 1:  # an LR schedule edits the wrapped optimizer's groups
            for group in (*ref_opt.param_groups, *zero.param_groups):
                group["lr"] *= 0.5
        ref_opt.zero_grad()
        outs = [ref(x[r], coords[r], signs[r]) for r in range(4)]
        nn.functional.mse_loss(torch.stack(outs), target).backward()
        for q in ref.parameters():  # an expert without tokens anywhere: zero gradient, as
            if q.grad is None:  # ZeRO (and the all-to-all MoE layer) give it
                q.grad = torch.zeros_like(q)
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        assert ref_norm > 2 * MAX_NORM, "clipping must be active"
        ref_opt.step()
        zero.zero_grad()
        zero.backward(nn.functional.mse_loss(model(x[rank], coord, signs[rank]), target[rank]))
        if forced and step == 0:  # ranks 0, 1 use only local expert 0; ranks 2, 3 only 1
            with torch.no_grad():
                h = torch.sigmoid(model.fc_in(x[rank]))
                _, pick = model.route(h, coord, signs[rank])
            assert pick.tolist() == [0 if rank < 2 else 1] * T, pick
        zero.step()
        norm = zero.get_grad_norm()
        assert norm is not None and abs(norm - ref_norm) <= RTOL * ref_norm, (norm, ref_norm)
    zero.wait_params()
    for name, p in model.named_parameters():
        if name.startswith("experts."):
            want = ref.experts[coord * LOCAL + int(name.split(".")[1])]
        else:
            want = ref.get_parameter(name)
        assert_rel_close(p.detach(), want.detach(), RTOL, f"{opt_name} stage {stage} {name}")
    dims.destroy()


@pytest.mark.parametrize("stage", [1, 2])
@distributed_test(4, timeout=120, comm_timeout=60)
def test_experts_over_moe_dp_equal_single_process(rank: int, world_size: int, stage: int) -> None:
    """Catches: experts averaged over dp (or moe_dp without the 1/ep of their summed
    gradients), experts partitioned/broadcast over the wrong group, a norm counting expert
    slices twice or missing the other ep rank's experts, clipping by a part's norm only, LR
    hyper-parameters not reaching a part; and ColossalAI's ZeRO-2 hang when ep rank 1's
    experts receive no tokens (forced routing; a hang fails by the timeout)."""
    torch.set_num_threads(1)
    for opt_name in OPTIMIZERS:
        _run(rank, stage, opt_name, forced=False)
    _run(rank, stage, "sgd", forced=True)


@distributed_test(4)
def test_moe_dp_size_must_match(rank: int, world_size: int) -> None:
    """Catches: a moe_dp group that with ep does not cover dp accepted (wrong averaging)."""
    torch.set_num_threads(1)
    dims = ParallelDims(ep=EP)
    model = _Net(dims.group("ep"), dims.coordinate("ep"))
    with pytest.raises(ValueError, match="moe_dp \\* ep must equal dp"):
        MoeLowLevelZeroOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), moe_dp_process_group=None
        )
    with pytest.raises(ValueError, match="grad_divisor=0"):
        LowLevelZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), grad_divisor=0)
    dims.destroy()


def _mse(model: _Net, x: torch.Tensor, target: torch.Tensor, coord: int) -> torch.Tensor:
    return nn.functional.mse_loss(model(x, coord, 1.0), target)


@distributed_test(4, timeout=120, comm_timeout=60)
def test_no_sync_accumulation_and_one_fp16_overflow_verdict(rank: int, world_size: int) -> None:
    """Catches: no_sync (stage 1) not reaching the expert part (two reductions: the first
    half counted twice); an inf in one rank's expert gradient skipping only the expert part
    or only that rank's step, the parts' loss scales drifting apart."""
    torch.set_num_threads(1)
    dims = ParallelDims(ep=EP)
    ep_group, moe_dp = dims.group("ep"), dims.group("moe_dp")
    coord = dims.coordinate("ep")
    torch.manual_seed(5)
    x, target = torch.randn(T, H) + rank, torch.randn(T, H)
    _, model = _models(ep_group, coord, False)
    _, twin = _models(ep_group, coord, False)
    acc = MoeLowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), moe_dp_process_group=moe_dp
    )
    one = MoeLowLevelZeroOptimizer(
        torch.optim.SGD(twin.parameters(), lr=0.5), moe_dp_process_group=moe_dp
    )
    with acc.no_sync():
        acc.backward(_mse(model, x[:3], target[:3], coord) / 2)
    acc.backward(_mse(model, x[3:], target[3:], coord) / 2)
    acc.step()
    one.backward(_mse(twin, x, target, coord))
    one.step()
    norm_acc, norm_one = acc.get_grad_norm(), one.get_grad_norm()
    assert norm_acc is not None and norm_one is not None
    assert abs(norm_acc - norm_one) <= RTOL * norm_one
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert_rel_close(p.detach(), q.detach(), RTOL, f"accumulated {name}")
    # fp16: an inf in rank 3's expert gradients skips every part's step on every rank
    half = _models(ep_group, coord, False)[1].half()
    opt = MoeLowLevelZeroOptimizer(
        torch.optim.SGD(half.parameters(), lr=0.5),
        moe_dp_process_group=moe_dp,
        partition_grad=True,
        scaler_config=ScalerConfig(initial_scale=2**8, hysteresis=1),
    )
    before = [p.detach().clone() for p in half.parameters()]
    handles = [
        p.register_hook(lambda g: torch.full_like(g, float("inf")))
        for p in half.experts
        if rank == 3
    ]
    opt.backward(_mse(half, x.half(), target.half(), coord))
    opt.step()
    assert [part.loss_scale for part in opt.parts] == [2.0**7, 2.0**7]
    assert all(torch.equal(p, b) for p, b in zip(half.parameters(), before, strict=True))
    for handle in handles:
        handle.remove()
    opt.zero_grad()
    opt.backward(_mse(half, x.half(), target.half(), coord))
    opt.step()
    opt.wait_params()
    assert [part.loss_scale for part in opt.parts] == [2.0**7, 2.0**7]
    names = [n for n, _ in half.named_parameters()]
    changed = {
        n: not torch.equal(p, b) for n, p, b in zip(names, half.parameters(), before, strict=True)
    }
    assert changed["fc_in.weight"] and (changed["experts.0"] or changed["experts.1"]), changed
    dims.destroy()
