"""Trainer.fit/evaluate/predict on the real Engine: hook order, max_steps, resuming, and
data parallelism with gradient accumulation and clipping equal to one process."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from colossal.core.testing import distributed_test
from colossal.legacy import ParallelMode, init_context, initialize
from colossal.legacy.builder import build_pipeline_model
from colossal.legacy.core import gpc
from colossal.legacy.engine import Engine
from colossal.legacy.nn.metric import Accuracy
from colossal.legacy.trainer import Trainer, hooks
from colossal.legacy.utils import get_dataloader

LR = 0.5
CLIP = 0.05  # below the gradient norms of every step here (checked in the reference)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def _engine(model: nn.Module | None = None) -> Engine:
    model = model if model is not None else _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return Engine(model, optimizer, nn.CrossEntropyLoss(), verbose=False)


def _batches(n_batches: int, size: int = 2, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    data = _dataset(n_batches * size, seed)
    return [data[i * size : (i + 1) * size] for i in range(n_batches)]


class Recorder(hooks.BaseHook):
    """Records every life-cycle call as (method, epoch, step)."""

    METHODS = (
        "after_hook_is_attached before_train after_train before_train_epoch after_train_epoch "
        "before_train_iter after_train_iter before_test after_test before_test_epoch "
        "after_test_epoch before_test_iter after_test_iter"
    ).split()

    def __init__(self, priority: int = 5) -> None:
        super().__init__(priority)
        self.calls: list[tuple[str, int, int]] = []
        for name in self.METHODS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name: str) -> Any:
        def record(trainer: Trainer, *args: Any) -> None:
            self.calls.append((name, trainer.cur_epoch, trainer.cur_step))

        return record


# ---- one process -------------------------------------------------------------------------------


def test_hooks_are_called_in_the_documented_order() -> None:
    recorder = Recorder()
    trainer = Trainer(_engine())
    trainer.fit(_batches(3), epochs=2, test_dataloader=_batches(2, seed=2), test_interval=2,
                hooks=[recorder])  # fmt: skip

    def train_epoch(epoch: int) -> list[tuple[str, int, int]]:
        calls = [("before_train_epoch", epoch, 3 * epoch)]
        for step in range(3 * epoch, 3 * epoch + 3):
            calls += [("before_train_iter", epoch, step), ("after_train_iter", epoch, step)]
        return calls + [("after_train_epoch", epoch, 3 * epoch + 3)]

    test = [("before_test", 0, 3), ("before_test_epoch", 0, 3)]
    test += [("before_test_iter", 0, 3), ("after_test_iter", 0, 3)] * 2
    test += [("after_test_epoch", 0, 3), ("after_test", 0, 3)]
    expected = [("after_hook_is_attached", 0, 0), ("before_train", 0, 0)]
    expected += train_epoch(0) + test + train_epoch(1)  # test_interval=2: no test after epoch 1
    expected += [("after_train", 2, 6)]
    assert recorder.calls == expected
    assert (trainer.cur_epoch, trainer.cur_step, trainer.steps_per_epoch) == (2, 6, 3)


class SeedsLogMessageHook(hooks.BaseHook):
    """The seeds' example hook: its __init__ does not call BaseHook's."""

    def __init__(self, priority: int = 10) -> None:
        self.events: list[str] = []

    def before_train(self, trainer: Trainer) -> None:
        self.events.append("training starts")

    def after_train(self, trainer: Trainer) -> None:
        self.events.append("training finished")


def test_hooks_run_by_priority_and_the_seeds_hook_works() -> None:
    order: list[str] = []

    class Named(hooks.BaseHook):
        def __init__(self, name: str, priority: int) -> None:
            super().__init__(priority)
            self.name = name

        def before_train(self, trainer: Trainer) -> None:
            order.append(self.name)

    seeds = SeedsLogMessageHook()
    given = [Named("late", 20), seeds, Named("early", 1), Named("also10", 10)]
    trainer = Trainer(_engine())
    trainer.fit(_batches(1), epochs=1, hooks=given)
    assert order == ["early", "also10", "late"] and seeds.priority == 10
    assert [type(h).__name__ for h in trainer.hooks] == [
        "Named", "SeedsLogMessageHook", "Named", "Named"
    ]  # fmt: skip
    assert seeds.events == ["training starts", "training finished"]
    assert [type(h).__name__ for h in given][0] == "Named"  # the caller's list is not sorted
    with pytest.raises(TypeError, match=r"BaseHook instances .* got \['LossMetric'\]"):
        trainer.fit(_batches(1), epochs=1, hooks=[hooks.LossMetric(epoch_only=True)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="must be a list of hooks"):
        trainer.fit(_batches(1), epochs=1, hooks=hooks.LossHook())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="test_interval=0"):
        trainer.fit(_batches(1), epochs=1, test_interval=0)


def test_max_steps_stops_training_and_resuming_continues_the_count() -> None:
    recorder = Recorder()
    engine = _engine()
    trainer = Trainer(engine)
    trainer.fit(_batches(3), epochs=5, max_steps=4, test_dataloader=_batches(1), hooks=[recorder])
    steps = [c for c in recorder.calls if c[0] == "after_train_iter"]
    assert [s[2] for s in steps] == [0, 1, 2, 3]  # 4 steps: epoch 0 and one step of epoch 1
    tests = [c for c in recorder.calls if c[0] == "before_test"]
    assert [t[1] for t in tests] == [0, 1]  # the epoch cut short is still tested
    assert (trainer.cur_epoch, trainer.cur_step) == (2, 4)

    resumed = Trainer(_engine())
    resumed.cur_epoch = 3
    recorder = Recorder()
    resumed.fit(_batches(3), epochs=4, hooks=[recorder])
    assert [c[2] for c in recorder.calls if c[0] == "after_train_iter"] == [9, 10, 11]


def test_evaluate_and_predict_run_the_model_without_gradients() -> None:
    model = _model()
    trainer = Trainer(_engine(model))
    test = _batches(3, size=4, seed=5)
    loss_hook = hooks.LossHook()
    trainer.evaluate(test, hooks=[loss_hook, hooks.AccuracyHook(Accuracy())])
    model.eval()
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(model(x), y).item() for x, y in test]
        correct = sum(int((model(x).argmax(-1) == y).sum()) for x, y in test)
    metrics = trainer.states["metrics"]["test"]
    assert metrics["Loss"].get_accumulated_value() == pytest.approx(sum(losses) / 3)
    assert metrics["Accuracy"].get_accumulated_value() == pytest.approx(correct / 12)
    assert all(p.grad is None for p in model.parameters())
    x = test[0][0]
    out = trainer.predict(x)
    assert not out.requires_grad and torch.equal(out, model(x).detach())
    with pytest.raises(ValueError, match="return_output_label=True"):
        trainer.evaluate(test, hooks=[hooks.AccuracyHook(Accuracy())], return_output_label=False)


def test_progress_bar_shows_epochs_and_step_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = Trainer(_engine())
    trainer.fit(_batches(2), epochs=1, hooks=[hooks.LossHook(), hooks.LogMetricByStepHook()],
                display_progress=True)  # fmt: skip
    err = capsys.readouterr().err
    assert "[Epoch 0 / Train]" in err and "2/2" in err and "loss=" in err
    trainer.fit(_batches(2), epochs=2, display_progress=False)
    assert "[Epoch 1 / Train]" not in capsys.readouterr().err


# ---- data parallelism, gradient accumulation 2, clipping ---------------------------------------

TRAIN, TEST, MICRO, EPOCHS = 32, 12, 2, 2


def _one_process() -> dict[str, Any]:
    """Plain SGD on the whole global batch (2 ranks x 2 micro-steps x MICRO samples)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, global_batch = _dataset(TRAIN, 1), 2 * 2 * MICRO
    epoch_losses = []
    for _ in range(EPOCHS):
        epoch_losses = []
        for start in range(0, TRAIN, global_batch):
            x, y = data[start : start + global_batch]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > 4 * CLIP
            opt.step()
            epoch_losses.append(loss.item())
    x, y = _dataset(TEST, 4)[:]
    with torch.no_grad():
        logits = model(x)
        test_losses = [nn.functional.cross_entropy(logits[i : i + 6], y[i : i + 6]).item()
                       for i in (0, 6)]  # fmt: skip
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "train_loss": sum(epoch_losses) / len(epoch_losses),
        "test_loss": sum(test_losses) / 2,
        "accuracy": (logits.argmax(-1) == y).float().mean().item(),
    }


@distributed_test(2)
def test_fit_with_data_parallel_accumulation_and_clipping_equals_one_process(
    rank: int, world_size: int
) -> None:
    """Catches a Trainer that steps or zeroes at the wrong time, a metric not reduced over
    the DATA group (each rank's own loss/accuracy differs from the global one), and the
    Engine's DDP + accumulation + clipping path disagreeing with one process."""
    torch.set_num_threads(1)
    init_context(dict(gradient_accumulation=2, clip_grad_norm=CLIP), verbose=False)
    model = _model()
    train = get_dataloader(_dataset(TRAIN, 1), batch_size=MICRO)
    test = get_dataloader(_dataset(TEST, 4), batch_size=3)
    engine, train, test, _ = initialize(
        model, torch.optim.SGD(model.parameters(), lr=LR), nn.CrossEntropyLoss(), train, test,
        verbose=False,
    )  # fmt: skip
    trainer = Trainer(engine)
    trainer.fit(train, EPOCHS, test_dataloader=test, test_interval=EPOCHS - 1,
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy())])  # fmt: skip
    want = _one_process()
    for a, b in zip(model.parameters(), want["params"], strict=True):
        assert (a - b).abs().max().item() < 1e-6
    train_metrics, test_metrics = (
        trainer.states["metrics"]["train"],
        trainer.states["metrics"]["test"],
    )
    assert train_metrics["Loss"].get_accumulated_value() == pytest.approx(want["train_loss"])
    assert test_metrics["Loss"].get_accumulated_value() == pytest.approx(want["test_loss"])
    accuracy = test_metrics["Accuracy"].get_accumulated_value()
    assert accuracy == pytest.approx(want["accuracy"])
    # The ranks' own accuracies differ from the global one: the reduction is what makes it.
    x, y = zip(*[batch for batch in test], strict=True)
    with torch.no_grad():
        local = (model(torch.cat(x)).argmax(-1) == torch.cat(y)).float().mean().item()
    locals_ = [0.0, 0.0]
    dist.all_gather_object(locals_, local)
    assert any(v != pytest.approx(accuracy) for v in locals_), (locals_, accuracy)
    assert trainer.cur_step == EPOCHS * TRAIN // (2 * MICRO)
    gpc.destroy()


# ---- pipeline x data parallelism ---------------------------------------------------------------


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@distributed_test(4)
def test_fit_under_pipeline_and_data_parallelism_keeps_metrics_on_the_last_stage(
    rank: int, world_size: int
) -> None:
    """Catches metrics computed (or reduced, or logged) on a stage without losses, a
    reduction over the wrong group, and a hang when stages read metrics differently."""
    torch.set_num_threads(1)
    init_context(dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2), verbose=False)
    stage = build_pipeline_model(_layers())
    train = get_dataloader(_dataset(16, 1), batch_size=4)
    test = get_dataloader(_dataset(16, 4), batch_size=4)
    engine, train, test, _ = initialize(
        stage, torch.optim.SGD(stage.parameters(), lr=LR), nn.CrossEntropyLoss(), train, test,
        verbose=False,
    )  # fmt: skip
    logger = logging.getLogger(f"test_trainer.pipeline.{rank}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = _Messages()
    logger.handlers = [handler]
    trainer = Trainer(engine)
    trainer.fit(train, 1, test_dataloader=test, hooks=[
        hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.LogMetricByEpochHook(logger)
    ])  # fmt: skip

    model = _layers()  # one process, global batches of 2 data-parallel ranks x 4 samples
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses = _dataset(16, 1), []
    for start in (0, 8):
        x, y = data[start : start + 8]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = _dataset(16, 4)[:]
    with torch.no_grad():
        logits = model(x)
    test_losses = [nn.functional.cross_entropy(logits[i : i + 8], y[i : i + 8]).item()
                   for i in (0, 8)]  # fmt: skip
    metrics = trainer.states["metrics"]
    if gpc.is_pipeline_last_stage():
        train_loss = metrics["train"]["Loss"].get_accumulated_value()
        assert train_loss == pytest.approx(sum(losses) / 2, rel=1e-5)
        test_loss = metrics["test"]["Loss"].get_accumulated_value()
        assert test_loss == pytest.approx(sum(test_losses) / 2, rel=1e-5)
        accuracy = metrics["test"]["Accuracy"].get_accumulated_value()
        assert accuracy == pytest.approx((logits.argmax(-1) == y).float().mean().item())
    else:
        assert metrics == {"train": {}, "test": {}}
    logs_here = gpc.is_pipeline_last_stage() and gpc.get_local_rank(ParallelMode.DATA) == 0
    assert len(handler.messages) == (2 if logs_here else 0), handler.messages
    gpc.destroy()
