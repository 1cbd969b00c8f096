"""initialize(...): the config's keys, the returned pieces, the Engine API, the handlers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.core import gpc
from colossal.legacy.engine import Engine, NonPipelineSchedule
from colossal.legacy.engine.features import ZERO_KEYS, parse_features
from colossal.legacy.engine.gradient_handler import (
    BaseGradientHandler,
    PipelineSharedModuleGradientHandler,
    SequenceParallelGradientHandler,
)
from colossal.legacy.pipeline import PipelineSharedModuleWrapper
from colossal.legacy.registry import GRADIENT_HANDLER

# ---- the config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(gradient_accumulation=0), r"gradient_accumulation=0 in the config must be an int"),
        (dict(gradient_accumulation=2.0), r"gradient_accumulation=2.0"),
        (dict(clip_grad_norm=-1), r"clip_grad_norm=-1 in the config must be a number >= 0"),
        (dict(clip_grad_norm="1"), r"clip_grad_norm='1'"),
        (dict(fp16=dict(init_scale=2)), r"fp16 in the config needs a mode"),
        (dict(fp16=dict(mode="torch"), zero=dict(stage=1)), r"sets both fp16 and zero"),
        (dict(zero=dict(stage=3)), r"zero stage 3 is not supported.*zero_model_wrapper"),
        (dict(zero=dict(stag=2)), r"does not take \['stag'\]"),
        (dict(zero=dict(stage=1, level=2)), r"stage=1 and level=2"),
        (dict(zero=dict(stage=1, partition_grad=True)), r"partition_grad is stage 2"),
        (dict(zero=dict(model_config=dict(shard_strategy=1))), r"ZeRO-3 sharded model"),
        (dict(zero=dict(optimizer_config=dict(lr=1))), r"optimizer_config=...\) does not take"),
        (dict(gradient_handler=dict(type="X")), r"gradient_handler in the config must be a list"),
        (dict(gradient_handler=[dict(name="X")]), r"must be a dict with a 'type'"),
        (dict(gradient_handler=[], gradient_handlers=[]), r"gradient_handler and gradient_"),
        (dict(NUM_MICRO_BATCHES=0), r"NUM_MICRO_BATCHES=0"),
        (dict(torch_ddp=[1]), r"torch_ddp in the config must be a dict"),
        (dict(cudnn_benchmark=1), r"cudnn_benchmark=1 in the config must be True or False"),
        (dict(model=dict(num_chunks=0)), r"model.num_chunks=0"),
    ],
)
def test_known_keys_with_bad_values_are_named(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_features(config)


def test_config_keys_are_read_and_user_keys_left_alone() -> None:
    features = parse_features(
        dict(
            BATCH_SIZE=128,
            NUM_EPOCHS=3,
            my_setting=dict(a=1),  # user keys: no error
            zero=dict(level=2, optimizer_config=dict(initial_scale=2**8), reduce_bucket_size=64),
            gradient_accumulation=4,
            clip_grad_norm=1,
            gradient_handlers=[dict(type="A")],
            NUM_MICRO_BATCHES=4,
            model=dict(num_chunks=2),
            TENSOR_SHAPE=[1, 2, 3],
        ),
        pipeline_size=2,
    )
    assert features.zero is not None and features.zero.stage == 2
    assert dict(features.zero.optimizer_kwargs) == dict(initial_scale=2**8, reduce_bucket_size=64)
    assert (features.gradient_accumulation, features.clip_grad_norm) == (4, 1.0)
    assert features.gradient_handlers == (dict(type="A"),)
    assert (features.num_microbatches, features.num_chunks) == (4, 2)
    assert features.tensor_shape == (1, 2, 3)
    assert "stage" in ZERO_KEYS and "initial_scale" in ZERO_KEYS
    with pytest.raises(ValueError, match="pipeline=2 but no NUM_MICRO_BATCHES"):
        parse_features({}, pipeline_size=2)
    with pytest.raises(ValueError, match="AMP_TYPE.TORCH\\) does not support pipeline"):
        parse_features(dict(fp16=dict(mode="torch"), NUM_MICRO_BATCHES=2), pipeline_size=2)


def test_initialize_before_launch_says_what_to_call() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"launch\(config=...\)"):
        initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))


# ---- the Engine at world 1 -------------------------------------------------------------------


@GRADIENT_HANDLER.register_module
class CountingGradientHandler(BaseGradientHandler):
    """The seeds' custom handler: registered, named in the config, built with extra keys."""

    def __init__(self, model: nn.Module, optimizer: Any, tag: str = "") -> None:
        super().__init__(model, optimizer)
        self.tag = tag
        self.calls = 0
        self.saw_grads: list[bool] = []

    def handle_gradient(self) -> None:
        self.calls += 1
        self.saw_grads.append(all(p.grad is not None for p in self._model.parameters()))


class TwoInputs(nn.Module):
    """A model taking two inputs (dict or tuple data)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(z)


@distributed_test(1)
def test_engine_api_and_a_custom_handler(rank: int, world_size: int) -> None:
    """Catches handlers not built from the registry or not called once per step (before the
    optimizer, after the backward), dict/tuple batches not unpacked into the model, an
    evaluation step that keeps a graph, and pieces not returned from initialize."""
    torch.set_num_threads(1)
    init_context(
        dict(gradient_handler=[dict(type="CountingGradientHandler", tag="x")], BATCH_SIZE=2),
        verbose=False,
    )
    assert gpc.config.BATCH_SIZE == 2
    model = TwoInputs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    train, test = [1], [2]
    hooks = [object()]
    engine, train_dl, test_dl, lr_sched = initialize(
        model, optimizer, nn.MSELoss(), train, test, scheduler, ophooks=hooks, verbose=False
    )
    assert isinstance(engine, Engine) and (train_dl, test_dl, lr_sched) == (train, test, scheduler)
    assert engine.model is model and engine.ophooks == hooks and not engine.uses_pipeline
    assert isinstance(engine.schedule, NonPipelineSchedule)
    (handler,) = engine.gradient_handlers
    assert isinstance(handler, CountingGradientHandler) and handler.tag == "x"
    engine.eval()
    assert not model.training
    engine.train()
    assert model.training
    x, z, y = torch.randn(2, 3), torch.randn(2, 4), torch.randn(2, 2)
    for data in (dict(x=x, z=z), (x, z)):
        engine.zero_grad()
        output, label, loss = engine.execute_schedule(iter([(data, y)]))
        assert torch.allclose(output, model(x, z)) and label is y
        assert loss is not None and torch.allclose(loss, nn.functional.mse_loss(model(x, z), y))
        engine.step()
    assert handler.calls == 2 and handler.saw_grads == [True, True]
    engine.zero_grad()
    output, label, loss = engine.execute_schedule(iter([((x, z), y)]), forward_only=True)
    assert loss is not None and not loss.requires_grad and output is not None
    assert all(p.grad is None for p in model.parameters())
    assert engine.execute_schedule(
        iter([((x, z), y)]), forward_only=True, return_loss=False, return_output_label=False
    ) == (None, None, None)
    with pytest.raises(ValueError, match="return_loss=False needs forward_only=True"):
        engine.execute_schedule(iter([((x, z), y)]), return_loss=False)
    with pytest.raises(TypeError, match=r"a batch must be \(data, label\)"):
        engine.execute_schedule(iter([x]))
    with pytest.raises(NameError, match="NoSuchHandler.*CountingGradientHandler"):
        GRADIENT_HANDLER.build(dict(type="NoSuchHandler"), model=model, optimizer=optimizer)
    gpc.destroy()


# ---- sequence and tied-parameter handlers at world 2 -------------------------------------------


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


@distributed_test(2)
def test_sequence_and_pipeline_shared_handlers(rank: int, world_size: int) -> None:
    """Catches the sequence handler reducing over the wrong group or summing instead of
    averaging, DDP chosen where the sequence group needs it, and tied pipeline parameters
    whose gradients are not summed (their copies would drift apart)."""
    torch.set_num_threads(1)
    # Sequence mode: without a handler DDP runs over SEQUENCE_DP; with one, no DDP.
    init_context(dict(parallel=dict(tensor=dict(size=2, mode="sequence"))), verbose=False)
    model = nn.Linear(3, 2)
    engine, *_ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    assert isinstance(engine.model, DistributedDataParallel)
    gpc.destroy()
    init_context(
        dict(
            parallel=dict(tensor=dict(size=2, mode="sequence")),
            gradient_handler=[dict(type="SequenceParallelGradientHandler")],
        ),
        verbose=False,
    )
    model = nn.Linear(3, 2)
    engine, *_ = initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    (handler,) = engine.gradient_handlers
    assert isinstance(handler, SequenceParallelGradientHandler)
    assert not isinstance(engine.model, DistributedDataParallel)
    assert torch.equal(*_gathered(model.weight.detach()))  # synced at initialize
    model.weight.grad = torch.full_like(model.weight, float(rank + 1))
    model.bias.grad = None  # unused on this rank: still averaged with the other's
    if rank == 1:
        model.bias.grad = torch.full_like(model.bias, 4.0)
    handler.handle_gradient()
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 1.5))
    assert torch.equal(model.bias.grad, torch.full_like(model.bias, 2.0))
    gpc.destroy()
    # Tied parameters across two pipeline stages: initialize adds the shared handler.
    init_context(dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=1), verbose=False)
    torch.manual_seed(rank)  # different copies: registering broadcasts stage 0's
    tied = nn.Linear(4, 4)
    PipelineSharedModuleWrapper([0, 1]).register_module(tied)
    assert torch.equal(*_gathered(tied.weight.detach()))
    engine, *_ = initialize(tied, torch.optim.SGD(tied.parameters(), lr=0.1), verbose=False)
    assert [type(h) for h in engine.gradient_handlers] == [PipelineSharedModuleGradientHandler]
    for p in tied.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    engine.step()  # handler (sum: 3), then SGD: both copies move alike
    assert all(torch.equal(p.grad, torch.full_like(p, 3.0)) for p in tied.parameters())
    assert torch.equal(*_gathered(tied.weight.detach()))
    gpc.destroy()
