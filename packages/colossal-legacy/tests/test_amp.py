"""AMP torch and naive against fp32 training; APEX refused; overflow agreed across ranks.

Updates are compared, not parameters: after a few SGD steps the fp16 update differs from
the fp32 one by < 0.1 % of its norm (measured); the tolerance, 1 %, is far below what the
guarded bugs cause (a missing unscale multiplies the update by the loss scale, an unscale
done twice or updates lost in fp16 leave it near zero: relative error ~1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.amp import (
    AMP_TYPE,
    NaiveAMPModel,
    NaiveAMPOptimizer,
    TorchAMPModel,
    TorchAMPOptimizer,
    convert_to_amp,
)
from colossal.legacy.core import gpc
from colossal.legacy.engine.features import parse_features
from colossal.legacy.engine.gradient_handler import DataParallelGradientHandler

REL_TOL = 1e-2
STEPS = 4


def _model(rounded: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model.half().float() if rounded else model  # naive AMP starts from fp16 weights


def _data(batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, batch, 16, generator=g), torch.randint(
        0, 4, (STEPS, batch), generator=g
    )


def _fp32_update(lr: float, rounded: bool, clip: float = 0.0) -> torch.Tensor:
    model = _model(rounded)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in zip(*_data(), strict=True):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > 4 * clip
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]) - start


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params])


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("lr", [0.5, 1e-4])
def test_convert_to_amp_torch_alone_matches_fp32(lr: float) -> None:
    """Catches a forward not under fp16 autocast, a missing or doubled unscale."""
    torch.set_num_threads(1)
    model = _model()
    start = _flat(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, criterion = convert_to_amp(model, opt, nn.CrossEntropyLoss(), AMP_TYPE.TORCH)
    assert isinstance(model, TorchAMPModel) and isinstance(opt, TorchAMPOptimizer)
    assert opt.loss_scale == 2.0**16  # the seeds' init_scale default
    for x, y in zip(*_data(), strict=True):
        opt.zero_grad()
        out = model(x)
        assert out.dtype == torch.float16
        opt.backward(criterion(out, y))
        opt.step()
    got = _flat(list(model.parameters())) - start
    assert _rel_err(got, _fp32_update(lr, rounded=False)) < REL_TOL


@pytest.mark.parametrize("lr", [0.5, 1e-4])
def test_convert_to_amp_naive_alone_steps_fp32_masters(lr: float) -> None:
    """Catches updates applied to the fp16 weights (lost below fp16 resolution at lr=1e-4:
    relative error ~0.9 measured), a missing unscale, and masters not copied back."""
    torch.set_num_threads(1)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model, opt, criterion = convert_to_amp(
        model, opt, nn.CrossEntropyLoss(), "naive", dict(initial_scale=2**10)
    )
    assert isinstance(model, NaiveAMPModel) and isinstance(opt, NaiveAMPOptimizer)
    assert all(p.dtype == torch.float16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    assert opt.param_names == (("0.weight", "0.bias", "2.weight", "2.bias"),)  # checkpoints
    start = _flat(opt.master_params)
    for x, y in zip(*_data(), strict=True):
        opt.zero_grad()
        out = model(x)
        assert out.dtype == torch.float32  # outputs back in fp32 for the criterion
        opt.backward(criterion(out, y))
        opt.step()
    got = _flat(opt.master_params) - start
    assert _rel_err(got, _fp32_update(lr, rounded=True)) < REL_TOL
    for param, master in zip(model.parameters(), opt.master_params, strict=True):
        assert torch.equal(param, master.half())


def test_apex_and_unknown_settings_are_refused() -> None:
    """Catches APEX silently running as something else, and typos in fp16 settings."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"APEX.*not supported.*AMP_TYPE.TORCH.*AMP_TYPE.NAIVE"):
        convert_to_amp(model, opt, None, AMP_TYPE.APEX)
    with pytest.raises(ValueError, match=r"fp16: AMP_TYPE.APEX"):
        parse_features(dict(fp16=dict(mode=AMP_TYPE.APEX, opt_level="O1")))
    with pytest.raises(ValueError, match=r"does not take \['initial_scale'\].*'init_scale'"):
        parse_features(dict(fp16=dict(mode=AMP_TYPE.TORCH, initial_scale=2.0)))
    with pytest.raises(ValueError, match="not an AMP_TYPE"):
        convert_to_amp(model, opt, None, "fp8")
    assert parse_features(dict(fp16=dict(mode=None))).amp_mode is None


@distributed_test(2)
def test_overflow_on_one_rank_skips_the_step_everywhere(rank: int, world_size: int) -> None:
    """Catches an overflow verdict that is not agreed across ranks (the ranks' weights
    would diverge) and a scaler that ignores hysteresis (naive) or backs off late (torch)."""
    torch.set_num_threads(1)
    for mode, config, scales in [
        (AMP_TYPE.NAIVE, dict(initial_scale=2**10, hysteresis=2), [2**10, 2**9]),
        (AMP_TYPE.TORCH, dict(init_scale=2.0**10), [2**9, 2**8]),
    ]:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt, criterion = convert_to_amp(model, opt, nn.CrossEntropyLoss(), mode, config)
        x, y = _data()
        seen = []
        for step in range(2):
            before = _flat(list(model.parameters()))
            opt.zero_grad()
            opt.backward(criterion(model(x[step]), y[step]))
            if rank == 1:  # only this rank overflows
                next(model.parameters()).grad[0, 0] = float("inf")
            assert opt.step() is None
            assert torch.equal(before, _flat(list(model.parameters()))), mode
            seen.append(opt.loss_scale)
        assert seen == scales, (mode, seen)
        opt.zero_grad()  # a clean step then updates on both ranks alike
        opt.backward(criterion(model(x[2]), y[2]))
        opt.step()
        flat = _flat(list(model.parameters()))
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(gathered, flat)
        assert torch.equal(gathered[0], gathered[1])


@distributed_test(2)
def test_initialize_fp16_with_data_parallel_and_clipping(rank: int, world_size: int) -> None:
    """Catches clipping before unscaling (the scaled norm would shrink the update by the
    loss scale), the wrong data-parallel path per mode, and a wrong loss scale in
    initialize: fp16 training at world 2 follows the fp32 one-process update."""
    torch.set_num_threads(1)
    clip = 0.05
    for config in [
        dict(mode=AMP_TYPE.TORCH, init_scale=2.0**12),
        dict(mode=AMP_TYPE.NAIVE, initial_scale=2**10),
    ]:
        naive = config["mode"] is AMP_TYPE.NAIVE
        init_context(dict(fp16=config, clip_grad_norm=clip), verbose=False)
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        engine, *_ = initialize(model, opt, nn.CrossEntropyLoss(), verbose=False)
        if naive:  # ColossalAI: naive AMP reduces with the handler, not DDP
            assert isinstance(engine.model, NaiveAMPModel)
            assert [type(h) for h in engine.gradient_handlers] == [DataParallelGradientHandler]
            start = _flat(engine.optimizer.master_params)
        else:
            assert isinstance(engine.model, DistributedDataParallel)
            assert isinstance(engine.model.module, TorchAMPModel)
            assert engine.optimizer.loss_scale == 2.0**12
            start = _flat(list(model.parameters()))
        xs, ys = _data()
        for x, y in zip(xs, ys, strict=True):
            half = slice(rank * 4, rank * 4 + 4)
            engine.zero_grad()
            engine.execute_schedule(iter([(x[half], y[half])]), return_output_label=False)
            engine.step()
        end = _flat(engine.optimizer.master_params if naive else list(model.parameters()))
        err = _rel_err(end - start, _fp32_update(0.5, rounded=naive, clip=clip))
        assert err < REL_TOL, (config, err)
        gpc.destroy()
