"""Pipeline builders: partitions, stage slices equal to the whole model, tied weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from colossal.core import grad_norm
from colossal.core.testing import distributed_test
from colossal.legacy import init_context
from colossal.legacy.builder import (
    build_pipeline_model,
    build_pipeline_model_from_cfg,
    partition_balanced,
    partition_uniform,
)
from colossal.legacy.core import gpc
from colossal.legacy.pipeline import PipelinableContext, PipelineSharedModuleWrapper
from colossal.legacy.pipeline.shared import SHARED_GROUP_ATTR, mark_stage_parameters


def test_partition_uniform_covers_every_layer_once() -> None:
    for items, stages, chunks in [(10, 2, 1), (10, 2, 2), (7, 3, 1), (9, 2, 2), (4, 4, 1)]:
        parts = partition_uniform(items, stages, chunks)
        assert len(parts) == stages and all(len(p) == chunks for p in parts)
        flat = sorted(r for p in parts for r in p)
        assert flat[0][0] == 0 and flat[-1][1] == items
        assert all(a[1] == b[0] for a, b in zip(flat, flat[1:], strict=False))  # contiguous
        sizes = [e - s for s, e in flat]
        assert max(sizes) - min(sizes) <= 1
    # Interleaved: stage 0 holds slices 0 and 2, stage 1 slices 1 and 3.
    assert partition_uniform(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    with pytest.raises(ValueError, match="cannot split 3 layers into 2 stages x 2 chunks"):
        partition_uniform(3, 2, 2)


def test_partition_balanced_minimises_the_heaviest_slice() -> None:
    weights = [1, 1, 1, 10, 1, 1]
    assert partition_balanced(weights, 2) == [[(0, 3)], [(3, 6)]]  # 3 | 12 (13 otherwise)
    # Brute force over every split of 7 weighted layers into 3 slices.
    w = [4, 1, 3, 2, 6, 1, 2]
    best = min(
        max(sum(w[:a]), sum(w[a:b]), sum(w[b:])) for a in range(1, 6) for b in range(a + 1, 7)
    )
    parts = partition_balanced(w, 3)
    assert max(sum(w[s:e]) for p in parts for s, e in p) == best


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.act = nn.ReLU()
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.flatten(self.mid(self.act(self.inp(x))), 1))


def test_pipelinable_context_stages_equal_the_eager_model() -> None:
    torch.manual_seed(0)
    eager = _Net()
    torch.manual_seed(0)
    ctx = PipelinableContext()
    with ctx:
        _Net()
    ctx.policy = "uniform"
    ctx.to_layer_list(["inp", "act", "mid", (lambda x: torch.flatten(x, 1), "behind"), "out"])
    stage0 = ctx.partition(1, 2, 0)
    stage1 = ctx.partition(1, 2, 1)
    # Values of the lazily built layers are those an eager build gives (same seed).
    assert torch.equal(stage0.inp.weight, eager.inp.weight)
    assert torch.equal(stage1.out.weight, eager.out.weight)
    x = torch.randn(5, 6)
    torch.testing.assert_close(stage1(stage0(x)), eager(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="'nope' is not a submodule"):
        ctx.to_layer_list(["inp", "nope"])


@distributed_test(2)
def test_build_pipeline_model_keeps_this_stage_slice(rank: int, world_size: int) -> None:
    init_context(dict(parallel=dict(pipeline=2)), verbose=False)
    torch.manual_seed(0)
    whole = nn.Sequential(*(nn.Linear(4, 4) for _ in range(5)))
    stage = build_pipeline_model(whole)
    expected = ["0", "1"] if rank == 0 else ["2", "3", "4"]  # the middle takes the extra
    assert [n for n, _ in stage.named_children()] == expected
    assert set(stage.state_dict()) <= set(whole.state_dict())  # keys of the whole model
    sizes = [(4, 32), (32, 4), (4, 4), (4, 4)]  # by parameters: [0] | [1, 2, 3]
    cfg = dict(layers=[dict(type="Linear", in_features=i, out_features=o) for i, o in sizes])
    built = build_pipeline_model_from_cfg(cfg, partition_method="uniform")
    assert len(list(built.children())) == 2 and not any(p.is_meta for p in built.parameters())
    balanced = build_pipeline_model_from_cfg(cfg)
    assert [n for n, _ in balanced.named_children()] == (["0"] if rank == 0 else ["1", "2", "3"])
    gpc.destroy()


@distributed_test(2)
def test_shared_weight_is_tied_and_counted_once(rank: int, world_size: int) -> None:
    init_context(dict(parallel=dict(pipeline=2)), verbose=False)
    torch.manual_seed(rank)  # different on purpose: registration must equalise them
    layer = nn.Linear(3, 3, bias=False)
    wrapper = PipelineSharedModuleWrapper([0, 1])
    wrapper.register_module(layer)
    copies = [torch.empty_like(layer.weight) for _ in range(2)]
    dist.all_gather(copies, layer.weight.detach())
    assert torch.equal(copies[0], copies[1])
    assert getattr(layer.weight, SHARED_GROUP_ATTR) is wrapper.group
    # Both stages hold the same (summed) gradient: the norm counts the tied weight once and
    # each stage's own parameter once.
    own = nn.Linear(2, 1, bias=False)
    model = nn.ModuleList([layer, own])
    assert mark_stage_parameters(model) == 1  # the tied weight keeps its mark
    layer.weight.grad = torch.full_like(layer.weight, 2.0)
    own.weight.grad = torch.full_like(own.weight, float(rank + 1))  # 1 on stage 0, 2 on 1
    norm = grad_norm(model.parameters())
    expected = (9 * 4.0 + 2 * 1.0 + 2 * 4.0) ** 0.5  # tied once, each stage's own once
    assert norm.item() == pytest.approx(expected, rel=1e-6)
    gpc.destroy()
