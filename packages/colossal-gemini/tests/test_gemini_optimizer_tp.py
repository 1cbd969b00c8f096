"""GeminiOptimizer next to tensor parallelism: the norm and the overflow verdict span the job.

Four ranks as ``dp 2 x tp 2`` (``ParallelDims``): the chunks are sharded over the dp group;
each rank holds a "split" weight (its tp rank's part: different values on the two tp ranks)
and a "replicated" bias (the same on both tp ranks), in one chunk whose dp shards cut
through the weight, so the norm's pieces are cut out of a shard. Gradients are set by hand
and reduced as GeminiDDP does (averaged over dp). The expected norm counts the split
weight's parts once each and the bias once: the weight is marked as its tp block, the bias
as replicated over tp (or implied so by ``tp_process_group``); unknown, the bias would count
twice, and with nothing marked the norm would leave out the other tp rank's part (both
checked to differ). An fp16 inf in a piece another rank counts skips the step on every rank.
``GeminiDDP`` over one of two data-parallel groups trains like one process (each group
creating its own reduction group: a job-wide ``new_group`` paired ranks of different groups
and hung).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from colossal.core import Block, ParallelDims, Placement, Replicate, mark_sharded
from colossal.core.testing import distributed_test
from colossal.gemini import ChunkManager, GeminiDDP, GeminiOptimizer

W, B = 10, 6  # one chunk of 16 elements: dp rank 0 holds w[0:8], dp rank 1 w[8:10] + b


class _Chunked(nn.Module):
    """Stand-in for GeminiDDP over ``group``: chunks built directly, gradients set by hand."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, group: object) -> None:
        super().__init__()
        self.model = model
        self.precision = dtype
        self.chunk_manager = ChunkManager(W + B, group)
        for name, p in model.named_parameters():
            self.chunk_manager.register(name, p, dtype=dtype)
        self.chunk_manager.close_all()

    def set_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Copy the gradients into the chunks and reduce them (averaged over the group)."""
        for chunk in self.chunk_manager.chunks:
            self.chunk_manager.access(chunk)
            for p in chunk.params:
                chunk.copy_grad(p, grads[chunk.infos[p].name].to(chunk.dtype))
            chunk.reduce()
            self.chunk_manager.release(chunk)


def _model() -> nn.Module:
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(W))
    model.b = nn.Parameter(torch.zeros(B))
    return model


def _grads(tp: int, dp: int) -> dict[str, torch.Tensor]:
    """The weight's gradient depends on both coordinates; the bias's on dp only."""
    w = torch.arange(W, dtype=torch.float32) * (1 + tp) + dp
    b = torch.linspace(-3.0, 3.0, B) * (1 + dp)
    return {"w": w, "b": b}


def _expected(norm_type: float, tp_size: int = 2, dp_size: int = 2) -> float:
    parts = [torch.stack([_grads(t, d)["w"] for d in range(dp_size)]).mean(0)
             for t in range(tp_size)]
    parts.append(torch.stack([_grads(0, d)["b"] for d in range(dp_size)]).mean(0))
    return float(torch.linalg.vector_norm(torch.cat(parts), norm_type))


def _build(dims: ParallelDims, dtype: torch.dtype, bias: str, weight: bool = True
           ) -> tuple[_Chunked, GeminiOptimizer]:
    """``bias``: "marked" (recorded as replicated over tp), "implied" (unmarked, with
    ``tp_process_group``) or "unknown" (unmarked, no group); ``weight``: mark w's tp block."""
    model = _model()
    tp_group, t = dims.group("tp"), dims.coordinate("tp")
    if weight:
        mark_sharded(model.w, Block.along((2 * W,), 0, t * W, (t + 1) * W), (2 * W,), tp_group)
    if bias == "marked":
        mark_sharded(model.b, Placement("tp", Replicate(), tp_group), (B,))
    gem = _Chunked(model, dtype, dims.group("dp"))
    opt = GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gem, initial_scale=4,
                          hysteresis=1,
                          tp_process_group=tp_group if bias == "implied" else None)
    return gem, opt


@distributed_test(4)
def test_norm_counts_each_parameter_once_over_tp_and_dp(rank: int, world_size: int) -> None:
    dims = ParallelDims(dp=2, tp=2)
    tp, dp = dims.coordinate("tp"), dims.coordinate("dp")
    for norm_type, bias in ((2.0, "marked"), (2.0, "implied"), (math.inf, "marked")):
        gem, opt = _build(dims, torch.float32, bias)
        gem.set_grads(_grads(tp, dp))
        norm = opt.clip_grad_by_norm(1e9, norm_type) if norm_type == 2.0 else None
        if norm_type == math.inf:
            opt.norm_type = math.inf  # the max norm: duplicates do not change it
            norm = opt.clip_grad_by_norm(1e9)
        assert norm == pytest.approx(_expected(norm_type), rel=1e-6), (norm_type, norm)
    # The bias not known to be replicated (counted twice), or nothing known about tp
    # (reduced over dp only: the other tp rank's part missing) is another number.
    for bias, weight in (("unknown", True), ("unknown", False)):
        gem, opt = _build(dims, torch.float32, bias, weight)
        gem.set_grads(_grads(tp, dp))
        got = opt.clip_grad_by_norm(1e9)
        assert got != pytest.approx(_expected(2.0), rel=1e-3), (bias, weight, got)


@distributed_test(4)
def test_fp16_overflow_in_an_uncounted_piece_skips_every_rank(rank: int,
                                                              world_size: int) -> None:
    dims = ParallelDims(dp=2, tp=2)
    tp, dp = dims.coordinate("tp"), dims.coordinate("dp")
    gem, opt = _build(dims, torch.float16, "marked")
    grads = _grads(tp, dp)
    if (tp, dp) == (1, 1):
        grads["b"][2] = math.inf  # the bias lives in dp rank 1's shard; tp rank 1 skips it
    gem.set_grads(grads)
    before = [v.view.clone() for v in opt.master_views]
    opt.step()
    assert opt.get_grad_norm() == math.inf
    assert opt.loss_scale == 2  # backed off on every rank (hysteresis 1)
    for v, b in zip(opt.master_views, before, strict=True):
        assert torch.equal(v.view, b), v.name
    gem.set_grads(_grads(tp, dp))
    opt.step()  # a clean step trains again
    assert any(not torch.equal(v.view, b) for v, b in zip(opt.master_views, before,
                                                          strict=True))


@distributed_test(4)
def test_gemini_ddp_over_one_of_two_dp_groups(rank: int, world_size: int) -> None:
    dims = ParallelDims(dp=2, tp=2)
    tp, dp = dims.coordinate("tp"), dims.coordinate("dp")

    def build() -> nn.Module:
        torch.manual_seed(tp)  # the two groups train different models on different data
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    g = torch.Generator().manual_seed(10 + tp)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g))
               for _ in range(3)]
    ref = build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    model = build()
    gem = GeminiDDP(model, process_group=dims.group("dp"), precision="fp32",
                    chunk_config_dict={"chunk_size": 64})
    opt = GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gem)
    for x, y in batches:
        opt.backward(nn.functional.mse_loss(gem(x[dp * 4 : dp * 4 + 4]),
                                            y[dp * 4 : dp * 4 + 4]))
        opt.step()
    state = gem.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), atol=1e-6, rtol=1e-5, msg=name)
