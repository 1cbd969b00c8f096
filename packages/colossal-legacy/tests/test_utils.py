"""colossal.legacy.utils: timers, get_dataloader over the DATA group, layout, checkpoints."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from colossal.booster import Booster
from colossal.booster.plugin import TorchDDPPlugin
from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.core import gpc
from colossal.legacy.utils import (
    MultiTimer,
    Timer,
    get_current_device,
    get_dataloader,
    is_using_ddp,
    is_using_pp,
    load_checkpoint,
    print_rank_0,
    read_training_state,
    save_checkpoint,
)

# ---- timers ------------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_multitimer_adds_intervals_and_keeps_history() -> None:
    clock = FakeClock()
    timers = MultiTimer(clock=clock)
    for seconds in (1.0, 3.0):
        timers.start("step")
        clock.now += seconds
        assert timers.stop("step", keep_in_history=True) == seconds
    timers.start("epoch")
    clock.now += 0.5
    timers.stop("epoch")  # not kept in history
    step = timers.get_timer("step")
    assert step.get_elapsed_time() == 4.0 and step.get_history() == [1.0, 3.0]
    assert step.get_history_mean() == 2.0 and step.get_history_sum() == 4.0
    assert timers.get_timer("epoch").get_elapsed_time() == 0.5
    assert not timers.get_timer("epoch").has_history
    assert [name for name, _ in timers] == ["step", "epoch"]
    timers.reset("step")
    assert step.get_elapsed_time() == 0.0 and not step.has_history
    assert timers.get_timer("epoch").get_elapsed_time() == 0.5  # only "step" was reset
    timers.reset()
    assert timers.get_timer("epoch").get_elapsed_time() == 0.0
    with pytest.raises(KeyError, match=r"no timer 'nope'; started timers: \['epoch', 'step'\]"):
        timers.stop("nope")
    timers.set_status(False)
    timers.start("off")
    assert timers.stop("off") is None and not timers.has("off") and not timers.is_on()


def test_timer_refuses_reads_while_running() -> None:
    clock = FakeClock()
    timer = Timer(clock)
    with pytest.raises(RuntimeError, match="not running"):
        timer.stop()
    timer.start()
    clock.now += 2.0
    assert timer.lap() == 2.0
    with pytest.raises(RuntimeError, match="stop the timer first"):
        timer.get_elapsed_time()
    with pytest.raises(RuntimeError, match="no interval was kept"):
        timer.stop() and timer.get_history_mean()


# ---- data --------------------------------------------------------------------------------------


def _indices(loader: torch.utils.data.DataLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def test_get_dataloader_without_data_parallelism_sees_everything() -> None:
    data = TensorDataset(torch.arange(10))
    plain = get_dataloader(data, batch_size=4)
    assert plain.sampler.__class__.__name__ == "SequentialSampler"
    assert _indices(plain) == list(range(10))
    first = _indices(get_dataloader(data, shuffle=True, seed=7, batch_size=3))
    again = _indices(get_dataloader(data, shuffle=True, seed=7, batch_size=3))
    assert first == again and sorted(first) == list(range(10)) and first != list(range(10))
    assert not get_dataloader(data, pin_memory=True).pin_memory  # nothing to pin for on CPU


def _gather(value: object) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


@distributed_test(2)
def test_get_dataloader_shards_over_the_data_group(rank: int, world_size: int) -> None:
    """Catches shards that overlap, miss samples, or ignore the DATA group's layout; and
    layout helpers or print_rank_0 that look at the wrong group."""
    init_context({}, verbose=False)
    assert is_using_ddp() and not is_using_pp() and get_current_device().type == "cpu"
    for n, drop_last in ((12, False), (11, True)):  # 11: the sampler drops one sample
        loader = get_dataloader(
            TensorDataset(torch.arange(n)),
            shuffle=True,
            batch_size=5 if drop_last else 2,
            drop_last=drop_last,
        )
        loader.sampler.set_epoch(1)  # type: ignore[attr-defined]
        shards = _gather(_indices(loader))
        assert not set(shards[0]) & set(shards[1]), shards
        assert len(shards[0]) == len(shards[1]) == n // 2
        assert len(set(shards[0]) | set(shards[1])) == n - n % 2
        assert shards[0] != sorted(shards[0])  # shuffled
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        print_rank_0("hello")
    assert printed.getvalue() == ("hello\n" if rank == 0 else "")
    gpc.destroy()

    init_context(dict(parallel=dict(pipeline=2)), verbose=False)  # dp = 1: no sampler
    assert is_using_pp() and not is_using_ddp()
    assert _indices(get_dataloader(TensorDataset(torch.arange(5)), batch_size=2)) == [0, 1, 2, 3, 4]
    with pytest.raises(NotImplementedError, match="HybridParallelPlugin"):
        save_checkpoint("unused", 0, nn.Linear(2, 2))
    gpc.destroy()


# ---- checkpoints -------------------------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


def _train_a_little(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(6, 4, generator=g)).square().mean().backward()
        optimizer.step()


def _adam_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return [state[i][k] for i in sorted(state) for k in ("exp_avg", "exp_avg_sq")]


def test_checkpoint_round_trip_in_one_process(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _train_a_little(model, optimizer)
    scheduler.step()
    target = tmp_path / "xxx.pt"  # the seeds' name: a directory here
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    save_checkpoint(target, 3, model, optimizer, scheduler, best_acc=0.5, tag="run1")
    names = sorted(p.name for p in target.iterdir())
    assert {"model.safetensors", "lr_scheduler.json", "training_state.json", "notes.txt"} <= set(
        names
    ) and any(n.startswith("optimizer") for n in names), names
    assert (target / "notes.txt").read_text() == "mine"

    fresh = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    assert load_checkpoint(str(target), fresh, fresh_opt, fresh_sched) == 3
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_adam_state(optimizer), _adam_state(fresh_opt), strict=True):
        assert torch.equal(a, b)
    assert fresh_sched.get_last_lr() == scheduler.get_last_lr() == [0.05]
    assert read_training_state(target) == {"epoch": 3, "extra": {"best_acc": 0.5, "tag": "run1"}}
    # One more training step from both gives the same parameters.
    _train_a_little(model, optimizer, 1)
    _train_a_little(fresh, fresh_opt, 1)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )

    with pytest.raises(TypeError, match="JSON cannot hold"):
        save_checkpoint(target, 4, model, extra=torch.ones(1))
    assert json.loads((target / "training_state.json").read_text())["epoch"] == 3
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing", fresh)


@distributed_test(2)
def test_checkpoint_is_read_by_the_booster_and_back(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    """Catches a checkpoint the Booster cannot read (names with DDP's ``module.`` prefix,
    optimizer states not keyed by parameter name), and the reverse."""
    torch.set_num_threads(1)
    init_context({}, verbose=False)
    model = _model()
    engine, *_ = initialize(model, torch.optim.Adam(model.parameters(), lr=0.1), verbose=False)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        engine.zero_grad()
        engine.backward(engine(torch.randn(3, 4, generator=g)).square().mean())
        engine.step()
    ours = tmp_path / "legacy"
    save_checkpoint(ours, 1, engine.model, engine.optimizer)  # a DDP model, a wrapper

    booster = Booster(plugin=TorchDDPPlugin())
    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    boosted, boosted_opt, *_ = booster.boost(other, torch.optim.Adam(other.parameters(), lr=0.1))
    booster.load_model(boosted, str(ours))
    booster.load_optimizer(boosted_opt, str(ours))
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(
        _adam_state(engine.optimizer.unwrap()), _adam_state(boosted_opt.unwrap()), strict=True
    ):
        assert torch.equal(a, b)

    theirs = tmp_path / "booster"
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(2)
    booster.save_model(boosted, str(theirs))
    third = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    assert load_checkpoint(theirs, third) == -1  # the Booster records no epoch
    for a, b in zip(other.parameters(), third.parameters(), strict=True):
        assert torch.equal(a, b)
    gpc.destroy()


@distributed_test(2)
def test_zero_engine_checkpoint_loads_into_one_process(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    """Catches a ZeRO engine whose optimizer states are saved unnamed or as this rank's
    shard only: the loaded Adam state must equal one process's on the same samples."""
    torch.set_num_threads(1)
    init_context(dict(zero=dict(stage=2)), verbose=False)
    model = _model()
    engine, *_ = initialize(model, torch.optim.Adam(model.parameters(), lr=0.1), verbose=False)
    reference = _model()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    for _ in range(2):
        batch = torch.randn(4, 4, generator=g)
        engine.zero_grad()
        engine.backward(engine(batch[2 * rank : 2 * rank + 2]).square().mean())
        engine.step()
        ref_opt.zero_grad()
        reference(batch).square().mean().backward()
        ref_opt.step()
    target = tmp_path / "zero"
    save_checkpoint(target, 2, engine.model, engine.optimizer)
    fresh = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    assert load_checkpoint(target, fresh, fresh_opt) == 2
    for a, b in zip(reference.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(_adam_state(ref_opt), _adam_state(fresh_opt), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    gpc.destroy()
