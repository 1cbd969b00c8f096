"""GeminiOptimizer over chunks built directly with ChunkManager (no GeminiDDP needed).

``_Chunked`` stands in for GeminiDDP: it gathers every chunk for the forward, and after
``loss.backward()`` copies each gradient into its chunk and reduces it (averaged over the
group), as GeminiDDP's hooks do. The reference is one process training an fp32 copy of the
model with a torch optimizer on the whole global batch (each rank takes an equal slice).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from colossal.core import CommTracker
from colossal.core.testing import distributed_test
from colossal.gemini import ChunkManager, GeminiOptimizer
from colossal.kernels import HybridAdam

GLOBAL_BATCH = 8
STEPS = 5


def _model(seed: int = 0, frozen_middle: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    if frozen_middle:  # LoRA-style: a frozen base layer between trainable ones
        model[2].requires_grad_(False)
    return model


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g))
            for _ in range(steps)]


def _local(batch: tuple[torch.Tensor, torch.Tensor], rank: int, world: int):
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


class _Chunked(nn.Module):
    """Stand-in for GeminiDDP: every chunk gathered for the forward, grads reduced after."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, chunk_size: int = 64,
                 keep_gathered: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.precision = dtype
        self.chunk_manager = ChunkManager(chunk_size, None)
        for name, p in model.named_parameters():
            self.chunk_manager.register(name, p, dtype=dtype, keep_gathered=name in keep_gathered)
        self.chunk_manager.close_all()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for chunk in self.chunk_manager.chunks:
            self.chunk_manager.access(chunk)
        return self.model(x.to(self.precision)).float()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        for chunk in self.chunk_manager.chunks:
            if chunk.requires_grad:
                for p in chunk.params:
                    if p.grad is not None:
                        chunk.copy_grad(p, p.grad)
                        p.grad = None
                chunk.reduce()
            self.chunk_manager.release(chunk)


def _groups(model: nn.Module) -> list[dict]:
    """Two groups: weights with weight decay, biases without (frozen params included)."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _train_reference(model: nn.Module, make_opt, batches, max_norm: float = 0.0,
                     norm_type: float = 2.0) -> tuple[list[float], list[float]]:
    opt = make_opt(_groups(model))
    losses, norms = [], []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        trainable = [p for p in model.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            trainable, max_norm if max_norm > 0 else math.inf, norm_type=norm_type)))
        opt.step()
        opt.zero_grad()
    return losses, norms


def _global_loss(loss: torch.Tensor, world: int) -> float:
    t = loss.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(t)
    return t.item() / world


def _train_gemini(gem: _Chunked, opt: GeminiOptimizer, batches, rank: int, world: int
                  ) -> tuple[list[float], list[float]]:
    losses, norms = [], []
    for batch in batches:
        x, y = _local(batch, rank, world)
        loss = nn.functional.mse_loss(gem(x), y)
        opt.backward(loss)
        losses.append(_global_loss(loss, world))
        opt.step()
        norms.append(opt.get_grad_norm())
    return losses, norms


def _check_masters(opt: GeminiOptimizer, ref: nn.Module, atol: float, rtol: float) -> None:
    ref_params = dict(ref.named_parameters())
    assert opt.master_views, "this rank should hold pieces of the model"
    for v in opt.master_views:
        want = ref_params[v.name].detach().reshape(-1)[v.start : v.stop]
        torch.testing.assert_close(v.view, want, atol=atol, rtol=rtol, msg=v.name)


def _check_params(gem: _Chunked, ref: nn.Module, atol: float, rtol: float) -> None:
    """The gathered low-precision params equal the reference (the shards were refreshed)."""
    ref_params = dict(ref.named_parameters())
    for chunk in gem.chunk_manager.chunks:
        gem.chunk_manager.access(chunk)
    for name, p in gem.model.named_parameters():
        torch.testing.assert_close(p.data.float(), ref_params[name].detach(), atol=atol,
                                   rtol=rtol, msg=name)
    for chunk in gem.chunk_manager.chunks:
        gem.chunk_manager.release(chunk)


def _adamw(groups):
    return torch.optim.AdamW(groups, lr=0.01)


def _hybrid(groups):
    return HybridAdam(groups, lr=0.01)


@distributed_test(1, 2)
def test_fp32_adam_matches_torch_adamw(rank: int, world_size: int) -> None:
    """fp32, two param groups (weight decay 0.1 / 0), a frozen layer, a kept-gathered chunk.

    Catches: masters not cut per rank (a parameter split over two shards updated twice or
    not at all), param-group hyper-parameters dropped when the groups are rebuilt (weight
    decay), frozen params getting optimizer state, kept-gathered chunks not re-gathered after
    the step, and HybridAdam's fused path diverging from torch's AdamW.
    """
    batches = _batches()
    ref = _model(frozen_middle=True)
    want_losses, _ = _train_reference(copy.deepcopy(ref), _adamw, batches)
    ref_trained = copy.deepcopy(ref)
    _train_reference(ref_trained, _adamw, batches)
    for make in (_adamw, _hybrid):
        model = copy.deepcopy(ref)
        gem = _Chunked(model, torch.float32, keep_gathered=("4.weight", "4.bias"))
        opt = GeminiOptimizer(make(_groups(model)), gem)
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen == {"2.weight", "2.bias"}
        # Frozen params are in no group and hold no state.
        assert not frozen & {v.name for v in opt.master_views}
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        losses, _ = _train_gemini(gem, opt, batches, rank, world_size)
        assert losses == pytest.approx(want_losses, rel=1e-5, abs=1e-6)
        _check_masters(opt, ref_trained, atol=1e-5, rtol=1e-5)
        _check_params(gem, ref_trained, atol=1e-5, rtol=1e-5)
        assert all(len(opt.state[v.view]) > 0 for v in opt.master_views)
        assert len(opt.state) == len(opt.master_views)
        # Grad shards are freed after the step.
        assert all(c.grad_shard is None for c in gem.chunk_manager.chunks)
    _state_roundtrip(rank, world_size)


def _state_roundtrip(rank: int, world_size: int) -> None:
    """state_dict after 2 steps, load into a fresh optimizer, 3 more steps == 5 steps."""
    batches = _batches()
    ref = _model()
    ref_trained = copy.deepcopy(ref)
    _train_reference(ref_trained, _adamw, batches)
    model = copy.deepcopy(ref)
    gem = _Chunked(model, torch.float32)
    opt = GeminiOptimizer(_hybrid(_groups(model)), gem)
    _train_gemini(gem, opt, batches[:2], rank, world_size)
    saved = opt.state_dict()
    assert set(saved["state"]) == {v.name for v in opt.master_views}
    assert all(s["step"] == 2 for s in saved["state"].values())
    # A new optimizer over the same (already trained) masters, built without weight decay:
    # the states and the groups' hyper-parameters come back from the save, by name.
    fresh = GeminiOptimizer(_hybrid([{"params": list(_params_of(gem, "weight"))},
                                     {"params": list(_params_of(gem, "bias"))}]), gem)
    fresh.load_state_dict(saved)
    assert [g["weight_decay"] for g in fresh.param_groups] == [0.1, 0.0]
    _train_gemini(gem, fresh, batches[2:], rank, world_size)
    _check_masters(fresh, ref_trained, atol=1e-5, rtol=1e-5)


def _params_of(gem: _Chunked, suffix: str):
    return (p for n, p in gem.model.named_parameters() if n.endswith(suffix))


def _sgd(groups):
    return torch.optim.SGD(groups, lr=0.2)


def _hybrid_l2(groups):
    """Adam with L2 weight decay (added to the gradient): unlike AdamW, a gradient left
    multiplied by the loss scale or not clipped changes its update (the decay term does not
    scale with it), so this catches a dropped ``div_scale``."""
    return HybridAdam(groups, lr=0.01, adamw_mode=False)


def _adam_l2(groups):
    return torch.optim.Adam(groups, lr=0.01)


def _run_case(rank: int, world_size: int, dtype: torch.dtype, make_opt, ref_opt, *,
              max_norm: float = 0.0, norm_type: float = 2.0, explicit_clip: bool = False,
              **kw) -> tuple[GeminiOptimizer, _Chunked, nn.Module, list, list, list, list]:
    batches = _batches()
    ref = _model()
    ref_trained = copy.deepcopy(ref)
    want_losses, want_norms = _train_reference(ref_trained, ref_opt, batches, max_norm,
                                               norm_type)
    model = copy.deepcopy(ref)
    gem = _Chunked(model, dtype, keep_gathered=("4.weight", "4.bias"))
    opt = GeminiOptimizer(make_opt(_groups(model)), gem, norm_type=norm_type,
                          max_norm=0.0 if explicit_clip else max_norm, **kw)
    losses, norms = [], []
    for batch in batches:
        x, y = _local(batch, rank, world_size)
        loss = nn.functional.mse_loss(gem(x), y)
        opt.backward(loss)
        losses.append(_global_loss(loss, world_size))
        if explicit_clip:
            before = opt.clip_grad_by_norm(max_norm)
            assert before == opt.get_grad_norm()
        with CommTracker() as tracker:
            opt.step()
        # One all-reduce (overflow flag + norm term) when the step needs either (fp16,
        # clipping; none when clip_grad_by_norm measured it already) and one all-gather per
        # kept-gathered chunk (refreshing its payload): nothing per parameter.
        if world_size > 1:
            measures = dtype == torch.float16 or max_norm > 0
            assert tracker.calls("all_reduce") == int(measures and not explicit_clip)
            assert tracker.calls("all_gather") == 1
        norms.append(opt.get_grad_norm())
    return opt, gem, ref_trained, losses, want_losses, norms, want_norms


@distributed_test(2)
def test_mixed_precision_loss_scaling_and_clipping(rank: int, world_size: int) -> None:
    """fp16 / bf16 against an fp32 reference; clipping by the global norm (2 and inf).

    SGD, unlike Adam, does not hide a missing or doubled loss unscale (the step would be
    ``scale`` times too large). Tolerances: fp16 masters within 2e-3 of the fp32 run after 5
    steps (fp16 compute and gradients carry ~1e-3 relative error), bf16 within 2e-2 (bf16
    has 8 mantissa bits).
    """
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 2e-2)):
        # Catches: the loss not scaled/unscaled (SGD), the divisor not fused into
        # HybridAdam's step (div_scale), low-precision shards not refreshed from masters.
        for make, ref_opt in ((_sgd, _sgd), (_hybrid_l2, _adam_l2)):
            opt, gem, ref, losses, want, _, _ = _run_case(
                rank, world_size, dtype, make, ref_opt, initial_scale=2**10)
            assert opt.loss_scale == (2**10 if dtype == torch.float16 else 1.0)
            assert losses == pytest.approx(want, rel=tol, abs=tol)
            _check_masters(opt, ref, atol=tol, rtol=tol)
            _check_params(gem, ref, atol=2 * tol, rtol=2 * tol)
    # Clipping (max_norm below every step's norm, so every step clips). Catches: a norm that
    # counts a kept-gathered chunk once per rank, forgets the loss scale, or misses a rank's
    # shard (norm != torch's clip_grad_norm_), and a clip factor applied inverted or twice.
    for norm_type, explicit, make, ref_opt in ((2.0, False, _sgd, _sgd),
                                               (math.inf, True, _sgd, _sgd),
                                               (2.0, False, _hybrid_l2, _adam_l2)):
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            opt, gem, ref, losses, want, norms, want_norms = _run_case(
                rank, world_size, dtype, make, ref_opt, max_norm=0.05, norm_type=norm_type,
                explicit_clip=explicit, initial_scale=2**10)
            assert min(want_norms) > 0.05
            assert norms == pytest.approx(want_norms, rel=tol)
            _check_masters(opt, ref, atol=tol, rtol=tol)


@distributed_test(2)
def test_fp16_step_that_grows_the_scale_unscales_by_the_old_one(rank: int,
                                                                world_size: int) -> None:
    """growth_interval=1: the loss scale doubles at every step. Each update must be unscaled
    by the scale the loss carried (catches dividing by the grown scale: every update half as
    large, the masters then off by ~1e-1, far beyond fp16's 2e-3)."""
    opt, gem, ref, *_ = _run_case(rank, world_size, torch.float16, _sgd, _sgd,
                                  initial_scale=2**4, growth_interval=1)
    assert opt.loss_scale == 2**4 * 2**STEPS
    _check_masters(opt, ref, atol=2e-3, rtol=2e-3)


@distributed_test(2)
def test_fp16_overflow_skips_the_step_on_every_rank(rank: int, world_size: int) -> None:
    """An inf in rank 0's gradient shard only: every rank skips, backs off, drops grads.

    Catches an overflow verdict that is not agreed (rank 1 would step and the replicas
    diverge), a scale that does not back off, and gradients kept for the next step.
    """
    batches = _batches(3)
    model = _model()
    gem = _Chunked(model, torch.float16)
    opt = GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), gem,
                          initial_scale=2**8, hysteresis=1)
    x, y = _local(batches[0], rank, world_size)
    opt.backward(nn.functional.mse_loss(gem(x), y))
    opt.step()
    before = [v.view.clone() for v in opt.master_views]
    x, y = _local(batches[1], rank, world_size)
    opt.backward(nn.functional.mse_loss(gem(x), y))
    if rank == 0:
        gem.chunk_manager.chunks[0].grad_shard[0] = math.inf
    opt.step()
    assert opt.loss_scale == 2**7
    assert opt.get_grad_norm() == math.inf
    assert all(c.grad_shard is None for c in gem.chunk_manager.chunks)
    for v, b in zip(opt.master_views, before, strict=True):
        assert torch.equal(v.view, b), v.name
    # The next clean step trains again.
    x, y = _local(batches[2], rank, world_size)
    opt.backward(nn.functional.mse_loss(gem(x), y))
    opt.step()
    assert any(not torch.equal(v.view, b) for v, b in zip(opt.master_views, before, strict=True))


@distributed_test(2)
def test_offloaded_masters_and_nvme_state_match_no_offload(rank: int, world_size: int) -> None:
    """Masters on "host" (offload_optim_frac) and HybridAdam's nvme_offload_fraction=0.5.

    Catches: an optimizer whose views still point at the master from before ``move_master``
    (the update lands in a dropped tensor), and NVMe-offloaded state changing the update.
    """
    batches = _batches(2)
    results = []
    for host, nvme in ((False, 0.0), (True, 0.0), (True, 0.5)):
        model = _model()
        gem = _Chunked(model, torch.bfloat16)
        if host:
            for chunk in gem.chunk_manager.chunks[:2]:  # half of the chunks, as a plan would
                chunk.move_master("host")
        opt = GeminiOptimizer(HybridAdam(model.parameters(), lr=0.01,
                                         nvme_offload_fraction=nvme), gem)
        if nvme:
            for chunk in gem.chunk_manager.chunks[2:]:  # moved after the optimizer was built
                chunk.move_master("host")
        _train_gemini(gem, opt, batches, rank, world_size)
        if nvme:
            assert opt.optim.offloaded_params  # some state really lives on disk
            opt.optim.close()
        results.append([v.view.clone() for v in opt.master_views])
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bad_arguments() -> None:
    model = _model()
    gem = _Chunked(model, torch.float32)
    with pytest.raises(TypeError, match="GeminiDDP"):
        GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="max_norm"):
        GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gem, max_norm=-1)
    with pytest.raises(ValueError, match="norm_type"):
        GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gem, norm_type=0)
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="does not manage"):
        GeminiOptimizer(torch.optim.SGD([stranger], lr=0.1), gem)
    opt = GeminiOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), gem)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_by_norm(0)
    with pytest.raises(ValueError, match="closure"):
        opt.step(closure=lambda: 0.0)
