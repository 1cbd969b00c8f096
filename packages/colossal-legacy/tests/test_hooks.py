"""Trainer hooks: lr schedules, logging, checkpoints, throughput, TensorBoard, and the groups
metrics are reduced over (Trainer.fit's metrics at world 2 and 4 are in test_trainer.py)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from colossal.core.testing import distributed_test
from colossal.legacy import init_context
from colossal.legacy.core import gpc
from colossal.legacy.engine import Engine
from colossal.legacy.nn.metric import Accuracy
from colossal.legacy.registry import HOOKS
from colossal.legacy.trainer import Trainer, hooks
from colossal.legacy.trainer.hooks import tensorboard_hook
from colossal.legacy.utils import MultiTimer, load_checkpoint, read_training_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _engine(model: nn.Module | None = None, lr: float = 0.1) -> Engine:
    model = model if model is not None else _model()
    return Engine(model, torch.optim.SGD(model.parameters(), lr=lr), nn.CrossEntropyLoss(),
                  verbose=False)  # fmt: skip


def _batches(n: int, size: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n)]  # fmt: skip


class LRRecorder(hooks.BaseHook):
    """The learning rate each training step runs with."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(priority=0)
        self.optimizer = optimizer
        self.lrs: list[float] = []

    def before_train_iter(self, trainer: Trainer) -> None:
        self.lrs.append(self.optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("by_epoch", [True, False])
def test_lr_scheduler_hook_steps_by_epoch_or_by_step(by_epoch: bool) -> None:
    engine = _engine(lr=0.8)
    optimizer = engine.optimizer.unwrap()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    recorder = LRRecorder(optimizer)
    trainer = Trainer(engine)
    trainer.fit(_batches(3), epochs=2, hooks=[hooks.LRSchedulerHook(scheduler, by_epoch), recorder])
    if by_epoch:  # changes after each epoch
        assert recorder.lrs == [0.8, 0.8, 0.8, 0.4, 0.4, 0.4]
        final = 0.2
    else:  # changes after each step
        assert recorder.lrs == [0.8, 0.4, 0.2, 0.1, 0.05, 0.025]
        final = 0.0125
    lr_metric = trainer.states["metrics"]["train"]["LR"]
    assert lr_metric.epoch_only == by_epoch and lr_metric.get_last_step_value() == final


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _logger(name: str) -> tuple[logging.Logger, ListHandler]:
    logger = logging.getLogger(f"test_hooks.{name}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = ListHandler()
    logger.handlers = [handler]
    return logger, handler


class ExpectedLog(hooks.BaseHook):
    """What LogMetricByEpochHook should log, read from the metrics after it ran."""

    def __init__(self) -> None:
        super().__init__(priority=20)
        self.messages: list[str] = []

    def after_train_epoch(self, trainer: Trainer) -> None:
        loss = trainer.states["metrics"]["train"]["Loss"].get_last_step_value()
        self.messages.append(f"[Epoch {trainer.cur_epoch} / Train]: Loss = {loss:.5g}")

    def after_test_epoch(self, trainer: Trainer) -> None:
        test = trainer.states["metrics"]["test"]
        loss = test["Loss"].get_accumulated_value()
        accuracy = test["Accuracy"].get_accumulated_value()
        self.messages.append(f"[Epoch {trainer.cur_epoch} / Test]: Loss = {loss:.5g}, "
                             f"Accuracy = {accuracy:.5g}")  # fmt: skip


def test_log_metric_by_epoch_hook_logs_the_metric_values() -> None:
    logger, handler = _logger("metrics")
    expected = ExpectedLog()
    trainer = Trainer(_engine())
    test = _batches(2, size=5, seed=3)
    trainer.fit(_batches(3), epochs=3, test_dataloader=test, hooks=[
        hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.LogMetricByEpochHook(logger, 2),
        expected,
    ])  # fmt: skip
    assert len(expected.messages) == 6
    assert handler.messages == [expected.messages[i] for i in (0, 1, 4, 5)]  # epochs 0 and 2
    handler.messages.clear()
    trainer.evaluate(test, hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()),
                                  hooks.LogMetricByEpochHook(logger)])  # fmt: skip
    assert handler.messages == [expected.messages[-1].replace("Epoch 2", "Epoch 3")]


def test_memory_and_timing_hooks_log_each_epoch() -> None:
    logger, handler = _logger("memory")
    clock = iter(float(t) for t in range(1000))
    timer = MultiTimer(clock=lambda: next(clock))  # every reading advances one second
    trainer = Trainer(_engine(), timer=timer)
    trainer.fit(_batches(2), epochs=1, test_dataloader=_batches(1), hooks=[
        hooks.LogMemoryByEpochHook(logger), hooks.LogTimingByEpochHook(timer, logger)
    ])  # fmt: skip
    memory = [m for m in handler.messages if "GB" in m]
    assert [m.split(":")[0] for m in memory] == ["Before-train", "[Epoch 0 / Train]",
                                                 "[Epoch 0 / Test]"]  # fmt: skip
    assert all(" cpu RSS " in m for m in memory), memory
    rss = float(memory[0].split(" cpu RSS ")[1].split(" GB")[0])
    assert 0.01 < rss < 1000  # this process's resident set, in GB
    timing = [m for m in handler.messages if "Train-step" in m or "Test-step" in m]
    assert "Train-step: last = 1 s, mean = 1 s over 2" in timing[0], timing
    assert "Test-step: last = 1 s, mean = 1 s over 1" in timing[1], timing


def test_throughput_counts_the_samples_each_step_drew() -> None:
    metric = hooks.ThroughputMetric(epoch_only=True, ignored_steps=1)
    for samples, seconds in ((100, 9.0), (8, 2.0), (12, 3.0)):
        metric.update(samples, seconds)
    assert metric.get_accumulated_value() == 4.0  # (8 + 12) / (2 + 3); the first ignored
    assert metric.get_last_step_value() == 4.0
    trainer = Trainer(_engine())
    hook = hooks.ThroughputHook()
    trainer.fit([*_batches(2, size=5), *_batches(1, size=3)], epochs=1, hooks=[hook])
    assert trainer.last_batch_size == 3
    assert hook.train_metric is not None and hook.train_metric._total[0].item() == 13
    assert hook.train_metric.get_accumulated_value() > 0


@pytest.mark.parametrize("save_by_iter", [False, True])
def test_save_checkpoint_hook_saves_what_the_trainer_trained(
    tmp_path: Path, save_by_iter: bool
) -> None:
    model = _model()
    engine = _engine(model)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer.unwrap(), 1, gamma=0.5)
    hook = hooks.SaveCheckpointHook(2, tmp_path / "ckpt", save_by_iter=save_by_iter)
    trainer = Trainer(engine)
    trainer.fit(_batches(3), epochs=3, hooks=[hooks.LRSchedulerHook(scheduler, True), hook])
    state = read_training_state(tmp_path / "ckpt")
    # by epoch: after epoch 1 (the 2nd); by step: after 2, 4, 6, 8 steps (the last in epoch 2)
    assert state == ({"epoch": 2, "extra": {"step": 8}} if save_by_iter
                     else {"epoch": 1, "extra": {"step": 6}})  # fmt: skip
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1.0)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5)
    assert load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt, fresh_sched) == state["epoch"]
    if save_by_iter:  # saved mid-epoch 2 after 8 steps: one more step was taken afterwards
        assert not torch.equal(fresh[0].weight, model[0].weight)
    else:  # saved after epoch 1, then epoch 2 trained on
        assert fresh_sched.get_last_lr() == [0.1 * 0.5**2]
    with pytest.raises(ValueError, match="checkpoint_dir"):
        hooks.SaveCheckpointHook(1)


def test_save_checkpoint_hook_final_state_loads_back(tmp_path: Path) -> None:
    model = _model()
    trainer = Trainer(_engine(model))
    trainer.fit(_batches(2), epochs=2, hooks=[hooks.SaveCheckpointHook(1, tmp_path)])
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    assert load_checkpoint(tmp_path, fresh) == 1
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


class FakeWriter:
    written: list[tuple[str, float, int]] = []

    def __init__(self, log_dir: str, filename_suffix: str) -> None:
        self.log_dir = log_dir

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.written.append((tag, value, step))

    def flush(self) -> None:
        pass


def test_tensorboard_hook_writes_metrics(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tensorboard_hook, "summary_writer_class", lambda: FakeWriter)
    FakeWriter.written = []
    hook = hooks.TensorboardHook(tmp_path, ranks=[0])
    assert hook._writer.log_dir == str(tmp_path / "global_rank_0")
    trainer = Trainer(_engine())
    trainer.fit(_batches(2), epochs=1, test_dataloader=_batches(1),
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hook])  # fmt: skip
    tags = [(tag, step) for tag, _, step in FakeWriter.written]
    assert tags == [("Loss/train", 0), ("Loss/train", 1), ("Loss/test", 0),
                    ("Accuracy/test", 0)]  # fmt: skip
    loss = trainer.states["metrics"]["test"]["Loss"].get_accumulated_value()
    assert FakeWriter.written[2][1] == loss


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed"
)
def test_tensorboard_hook_without_tensorboard_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(
        ImportError, match=r"pip install tensorboard .*colossal-legacy\[tensorboard\]"
    ):
        hooks.TensorboardHook(tmp_path)


def test_hooks_are_registered_by_name() -> None:
    names = [
        "AccuracyHook", "LRSchedulerHook", "LogMemoryByEpochHook", "LogMetricByEpochHook",
        "LogMetricByStepHook", "LogTimingByEpochHook", "LossHook", "SaveCheckpointHook",
        "TensorboardHook", "ThroughputHook",
    ]  # fmt: skip
    for name in names:
        assert HOOKS.get_module(name) is getattr(hooks, name)
    built: Any = HOOKS.build(dict(type="LossHook", priority=3))
    assert isinstance(built, hooks.LossHook) and built.priority == 3


@distributed_test(2)
def test_metrics_reduce_over_the_ranks_sharing_the_data(rank: int, world_size: int) -> None:
    """Catches a reduction over the wrong group: DATA with data parallelism, SEQUENCE_DP
    (each rank a part of every sample) under sequence parallelism, none with a pipeline."""
    cases = [  # (config, reduced over both ranks?)
        ({}, True),
        (dict(parallel=dict(tensor=dict(size=2, mode="sequence"))), True),
        (dict(parallel=dict(pipeline=2)), False),
    ]
    for config, reduced in cases:
        init_context(config, verbose=False)
        loss = hooks.LossMetric(epoch_only=True)
        for value in (1.0 + rank, 3.0 + rank):  # rank 0: 1, 3; rank 1: 2, 4
            loss.update(torch.tensor(value))
        accuracy = hooks.AccuracyMetric(epoch_only=True, accuracy_func=Accuracy())
        logits = torch.eye(3)[[0, 1, 2, 0]]  # predicts 0, 1, 2, 0
        accuracy.update(logits, torch.tensor([0, 1, 2, 0]) if rank == 0 else torch.zeros(4))
        samples = hooks.ThroughputMetric(epoch_only=True, use_local=False)
        samples.update(4, 2.0)
        if reduced:
            assert loss.get_accumulated_value() == 2.5  # (1 + 3 + 2 + 4) / 4
            assert accuracy.get_accumulated_value() == 6 / 8  # rank 0: 4 of 4, rank 1: 2 of 4
        else:
            assert loss.get_accumulated_value() == 2.0 + rank
            assert accuracy.get_accumulated_value() == (1.0 if rank == 0 else 0.5)
        assert loss.get_last_step_value() == 3.0 + rank  # this rank's own
        # Throughput counts samples once per data-parallel rank (sequence ranks share them).
        assert samples.get_accumulated_value() == (4.0 if config == {} else 2.0)
        gpc.destroy()
