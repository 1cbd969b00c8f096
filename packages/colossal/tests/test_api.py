"""Bad input gives clear errors; dataloaders shard the data; no_sync accumulates; lazy import."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from booster_testlib import local_batch, make_booster, make_model, make_optimizer
from torch import nn
from torch.utils.data import TensorDataset

from colossal.booster import Booster, MixedPrecision
from colossal.checkpoint_io import CheckpointError
from colossal.core.testing import distributed_test


def test_import_is_lazy() -> None:
    code = (
        "import sys, colossal.booster, colossal.checkpoint_io, colossal.lazy\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'transformers'"
        " or m.startswith(('colossal.gemini', 'colossal.shardformer'))]\n"
        "assert not bad, bad\n"
        "assert 'colossal.booster.plugin.fsdp.plugin' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mixed_precision_validation() -> None:
    with pytest.raises(ValueError, match="fp8"):
        Booster(mixed_precision="fp8")
    with pytest.raises(ValueError, match="fp32"):
        MixedPrecision("fp32")
    with pytest.raises(TypeError, match="mixed_precision"):
        Booster(mixed_precision=3)  # type: ignore[arg-type]


@distributed_test(1)
def test_bad_input(rank: int, world_size: int) -> None:
    from colossal.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin

    with pytest.raises(TypeError, match="bucket_cpa_mb"):
        TorchDDPPlugin(bucket_cpa_mb=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="stage=3"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(ValueError, match="fp8"):
        LowLevelZeroPlugin(precision="fp8")
    with pytest.raises(ValueError, match="controls precision"):
        Booster(plugin=LowLevelZeroPlugin(), mixed_precision="bf16")
    booster = make_booster("ddp")
    model = make_model()
    optimizer = make_optimizer(model)
    boosted, boosted_opt, *_ = booster.boost(model, optimizer)
    with pytest.raises(ValueError, match="boosted already"):
        booster.boost(model, optimizer)
    with pytest.raises(ValueError, match="boosted already"):
        booster.boost(boosted)
    with pytest.raises(ValueError, match="boosted already"):
        make_booster("ddp").boost(make_model(), boosted_opt)
    with pytest.raises(NotImplementedError, match="execute_pipeline"):
        booster.execute_pipeline(iter([]), boosted, None)
    other = make_optimizer(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not in the model"):
        make_booster("ddp").boost(make_model(), other)
    with pytest.raises(NotImplementedError, match="no_sync"):
        make_booster("zero2").no_sync(None, None)
    from colossal.booster.plugin import TorchFSDPPlugin

    with pytest.raises(ValueError, match="does not support precision 'fp16'.*bf16"):
        TorchFSDPPlugin(precision="fp16")


class Wider(nn.Module):
    """The test model's parameter names with other shapes: "another model"."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 24)
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(24, 24), nn.Tanh())
        self.head = nn.Linear(24, 3)
        self.register_buffer("offset", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x))) + self.offset


def _boosted(plugin: str, model: nn.Module) -> tuple:
    booster = make_booster(plugin)
    boosted, optimizer, *_ = booster.boost(model, make_optimizer(model))
    return booster, boosted, optimizer


@pytest.mark.parametrize("plugin", ["zero1", "fsdp"])
@distributed_test(2)
def test_other_models_checkpoint_refused(
    rank: int, world_size: int, plugin: str, tmp_path: Path
) -> None:
    booster, model, optimizer = _boosted(plugin, make_model())
    x, y = local_batch(0, rank, world_size)
    booster.backward(nn.functional.mse_loss(model(x), y), optimizer)
    optimizer.step()
    booster.save_model(model, str(tmp_path / "model"))
    booster.save_optimizer(optimizer, str(tmp_path / "optim"))
    # Same parameter names, other shapes.
    booster, model, optimizer = _boosted(plugin, Wider())
    with pytest.raises(CheckpointError, match="another model"):
        booster.load_model(model, str(tmp_path / "model"))
    if plugin == "zero1":
        with pytest.raises(CheckpointError, match="another model"):
            booster.load_optimizer(optimizer, str(tmp_path / "optim"))
    # Other parameter names.
    other = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    booster, model, optimizer = _boosted(plugin, other)
    with pytest.raises(CheckpointError, match="does not match the model"):
        booster.load_model(model, str(tmp_path / "model"))
    with pytest.raises(CheckpointError, match="another model"):
        booster.load_optimizer(optimizer, str(tmp_path / "optim"))


@distributed_test(2)
def test_prepare_dataloader(rank: int, world_size: int) -> None:
    from colossal.booster.plugin import TorchDDPPlugin

    data = TensorDataset(torch.arange(10))
    plugin = TorchDDPPlugin()
    loader = plugin.prepare_dataloader(data, batch_size=2, shuffle=True, seed=7)
    mine = torch.cat([b[0] for b in loader]).tolist()
    gathered: list[list[int]] = [[] for _ in range(world_size)]
    torch.distributed.all_gather_object(gathered, mine)
    assert sorted(sum(gathered, [])) == list(range(10))
    assert not set(gathered[0]) & set(gathered[1])
    again = torch.cat([b[0] for b in plugin.prepare_dataloader(data, 2, True, 7)]).tolist()
    assert again == mine  # same seed, same order
    with pytest.raises(ValueError, match="batch_size"):
        plugin.prepare_dataloader(data, batch_size=0)


@pytest.mark.parametrize("plugin", ["ddp", "zero1"])
@distributed_test(2)
def test_no_sync_accumulation(rank: int, world_size: int, plugin: str) -> None:
    """Two micro-batches under no_sync + one synced equal one big batch."""
    results = []
    for accumulate in (False, True):
        booster = make_booster(plugin)
        model = make_model()
        model, optimizer, *_ = booster.boost(model, make_optimizer(model))
        x, y = local_batch(0, rank, world_size)
        if accumulate:
            with booster.no_sync(model, optimizer):
                loss = nn.functional.mse_loss(model(x[:2]), y[:2]) / 2
                booster.backward(loss, optimizer)
            loss = nn.functional.mse_loss(model(x[2:]), y[2:]) / 2
            booster.backward(loss, optimizer)
        else:
            booster.backward(nn.functional.mse_loss(model(x), y), optimizer)
        optimizer.step()
        results.append({k: v.clone() for k, v in model.unwrap().state_dict().items()})
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name], msg=name)


@distributed_test(1)
def test_fp16_backward_by_grad_takes_a_scaled_grad(rank: int, world_size: int) -> None:
    """backward_by_grad(loss, d(scaled loss)/d(loss)) gives backward(loss)'s grads."""
    grads = []
    for by_grad in (False, True):
        booster = make_booster("none", "fp16")
        plain = make_model()
        model, optimizer, *_ = booster.boost(plain, make_optimizer(plain))
        x, y = local_batch(0, rank, world_size)
        loss = nn.functional.mse_loss(model(x).float(), y)
        if by_grad:
            optimizer.backward_by_grad(loss, torch.tensor(optimizer.loss_scale))
        else:
            booster.backward(loss, optimizer)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert optimizer.loss_scale > 1.0  # the grads really are scaled
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("broadcast", [True, False])
@distributed_test(2)
def test_ddp_broadcast_buffers(rank: int, world_size: int, broadcast: bool) -> None:
    """True: rank 0's buffers everywhere (no deprecation warning); False: buffers stay local."""
    from colossal.booster.plugin import TorchDDPPlugin

    model = make_model()
    model.register_buffer("seen", torch.full((3,), float(rank)))
    booster = Booster(plugin=TorchDDPPlugin(broadcast_buffers=broadcast))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model, *_ = booster.boost(model)
    x, _ = local_batch(0, rank, world_size)
    model(x)
    expected = 0.0 if broadcast else float(rank)
    assert torch.equal(model.unwrap().seen, torch.full((3,), expected))
