"""Checkpoint format, cross-plugin / cross-world-size resume, integrity and crash safety."""

from __future__ import annotations

import json
import os

import pytest
import torch
from booster_testlib import (
    make_booster,
    make_model,
    make_optimizer,
    tiny_gpt2_config,
    train_steps,
)
from safetensors.torch import load_file
from torch import nn

from colossal.booster import Booster
from colossal.checkpoint_io import MODEL_INDEX, OPTIMIZER_INDEX, CheckpointError
from colossal.core.testing import spawn

STEPS, RESUME = 3, 3


def _scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def _boost(plugin: str) -> tuple:
    booster = make_booster(plugin)
    model = make_model(seed=99)  # different init: loading must overwrite everything
    optimizer = make_optimizer(model)
    sched = _scheduler(optimizer)
    model, optimizer, _, _, sched = booster.boost(model, optimizer, lr_scheduler=sched)
    return booster, model, optimizer, sched


def _save_run(rank: int, world_size: int, root: str, plugins: list[str]) -> None:
    for plugin in plugins:
        booster = make_booster(plugin)
        model = make_model()
        optimizer = make_optimizer(model)
        sched = _scheduler(optimizer)
        model, optimizer, _, _, sched = booster.boost(model, optimizer, lr_scheduler=sched)
        for step in range(STEPS):
            train_steps(model, optimizer, booster, range(step, step + 1), rank, world_size)
            sched.step()
        path = os.path.join(root, f"{plugin}-w{world_size}")
        use_async = plugin != "ddp"
        booster.save_model(
            model, f"{path}/model", shard=True, size_per_shard=0.001, use_async=use_async
        )
        booster.save_optimizer(
            optimizer, f"{path}/optim", shard=True, size_per_shard=0.001, use_async=use_async
        )
        booster.save_lr_scheduler(sched, f"{path}/sched.json")
        booster.wait_async_saves()


def _resume_run(rank: int, world_size: int, root: str, pairs: list[tuple[str, str]]) -> list:
    out = []
    for source, plugin in pairs:
        booster, model, optimizer, sched = _boost(plugin)
        path = os.path.join(root, source)
        booster.load_model(model, f"{path}/model")
        booster.load_optimizer(optimizer, f"{path}/optim")
        booster.load_lr_scheduler(sched, f"{path}/sched.json")
        losses = []
        for step in range(STEPS, STEPS + RESUME):
            losses += train_steps(
                model, optimizer, booster, range(step, step + 1), rank, world_size
            )
            sched.step()
        out.append(losses)
    return out


def _reference_with_scheduler(steps: int) -> list[float]:
    model = make_model()
    optimizer = make_optimizer(model)
    sched = _scheduler(optimizer)
    losses = []
    from booster_testlib import batch

    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def test_cross_plugin_world_size_resume(tmp_path) -> None:
    """Save under {ddp, zero1, zero2, fsdp} at world 2, resume under others at world 1 and 4."""
    root = str(tmp_path)
    spawn(_save_run, 2, args=(root, ["ddp", "zero2", "zero1", "fsdp"]))
    index = json.load(open(os.path.join(root, "ddp-w2", "model", MODEL_INDEX)))
    assert len(index["metadata"]["files"]) > 2  # sharded, and spread over both ranks
    for info in index["metadata"]["files"].values():
        assert set(info) == {"size", "crc32"}
    optim_index = json.load(open(os.path.join(root, "zero2-w2", "optim", OPTIMIZER_INDEX)))
    assert optim_index["steps"] == STEPS
    assert optim_index["param_groups"][0]["params"][0] == "embed.weight"
    assert "embed.weight.exp_avg" in optim_index["weight_map"]
    expected = _reference_with_scheduler(STEPS + RESUME)[STEPS:]
    pairs1 = [("ddp-w2", "zero1"), ("zero2-w2", "ddp"), ("zero1-w2", "none"), ("fsdp-w2", "fsdp")]
    pairs4 = [("ddp-w2", "zero2"), ("zero2-w2", "fsdp"), ("zero1-w2", "ddp"), ("fsdp-w2", "zero1")]
    for world, pairs in ((1, pairs1), (4, pairs4)):
        results = spawn(_resume_run, world, args=(root, pairs))[0]
        for (source, plugin), losses in zip(pairs, results, strict=True):
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(expected),
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, s=source, p=plugin, w=world: f"{s} -> {p}@{w}: {m}",
            )


def _plain(tmp_path, **save_kwargs) -> tuple[Booster, nn.Module, str]:
    booster = Booster()
    model, *_ = booster.boost(make_model())
    path = str(tmp_path / "ckpt")
    booster.save_model(model, path, **save_kwargs)
    booster.wait_async_saves()
    return booster, model, path


def test_model_files_are_plain_safetensors(tmp_path) -> None:
    booster, model, path = _plain(tmp_path, shard=True, size_per_shard=0.0005)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert files[0].startswith("model-00001-of-") and len(files) > 1
    loaded = {}
    for f in files:
        loaded.update(load_file(os.path.join(path, f)))
    reference_state = model.state_dict()
    assert loaded.keys() == reference_state.keys()
    for k, v in reference_state.items():
        torch.testing.assert_close(loaded[k], v)
    _, _, single = _plain(tmp_path / "single", use_async=True)
    assert os.listdir(single) == ["model.safetensors", MODEL_INDEX] or set(os.listdir(single)) == {
        "model.safetensors",
        MODEL_INDEX,
    }


def test_corrupt_or_incomplete_is_refused(tmp_path) -> None:
    booster, model, path = _plain(tmp_path, shard=True, size_per_shard=0.0005)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    victim = os.path.join(path, files[-1])
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="CRC-32"):
        booster.load_model(model, path)
    open(victim, "wb").write(bytes(data[:-4]))
    with pytest.raises(CheckpointError, match="truncated"):
        booster.load_model(model, path)
    os.remove(victim)
    with pytest.raises(CheckpointError, match="missing"):
        booster.load_model(model, path)
    os.remove(os.path.join(path, MODEL_INDEX))
    with pytest.raises(CheckpointError, match="not a complete"):
        booster.load_model(model, path)


def test_other_models_checkpoint_is_refused(tmp_path) -> None:
    booster, _, path = _plain(tmp_path)
    other = nn.Sequential(nn.Linear(6, 4))
    with pytest.raises(ValueError, match="missing"):
        booster.load_model(other, path)
    wider = make_model()
    wider.head = nn.Linear(16, 5)
    with pytest.raises(ValueError, match="another model"):
        booster.load_model(wider, path)


class _SavePretrainedOnly:
    """A config with only ``save_pretrained`` (duck-typed like a Hugging Face config)."""

    def save_pretrained(self, directory: str) -> None:
        with open(os.path.join(directory, "config.json"), "w") as file:
            json.dump({"model_type": "toy", "hidden": 16}, file)


def test_duck_typed_config_is_saved_with_the_weights(tmp_path) -> None:
    model = make_model()
    model.config = _SavePretrainedOnly()
    model.generation_config = None
    booster = Booster()
    boosted, *_ = booster.boost(model)
    booster.save_model(boosted, str(tmp_path / "a"), use_async=True)
    booster.wait_async_saves()
    config = json.load(open(tmp_path / "a" / "config.json"))
    assert config == {"model_type": "toy", "hidden": 16, "architectures": ["Net"]}
    assert not os.path.exists(tmp_path / "a" / "generation_config.json")
    _, _, plain = _plain(tmp_path / "b")  # no config attribute: no config file
    assert not os.path.exists(os.path.join(plain, "config.json"))


# The kill-mid-write tests (sync and async) are in test_checkpoint_integrity.py.


def _gpt2() -> nn.Module:
    import transformers

    config = tiny_gpt2_config()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _save_gpt2(rank: int, world_size: int, path: str) -> None:
    booster = make_booster("ddp")
    model, *_ = booster.boost(_gpt2())
    booster.save_model(model, path, shard=True, size_per_shard=0.05)


def _check_gpt2_dir(path: str, reference: nn.Module, ids: torch.Tensor) -> None:
    import transformers

    config = json.load(open(os.path.join(path, "config.json")))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_embd"] == 32
    assert os.path.isfile(os.path.join(path, "generation_config.json"))
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) > 1  # sharded, with an index
    loaded = transformers.GPT2LMHeadModel.from_pretrained(path)  # no hand-written config
    loaded.eval()
    torch.testing.assert_close(loaded(ids).logits, reference(ids).logits)
    auto = transformers.AutoModelForCausalLM.from_pretrained(path)
    auto.eval()
    torch.testing.assert_close(auto(ids).logits, reference(ids).logits)


def test_gpt2_from_pretrained(tmp_path) -> None:
    """save_model writes config.json itself: from_pretrained loads world 1 and world 2 saves."""
    pytest.importorskip("transformers")
    model = _gpt2()
    model.eval()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    booster = Booster()
    boosted, *_ = booster.boost(model)
    path = str(tmp_path / "gpt2")
    booster.save_model(boosted, path, shard=True, size_per_shard=0.05)
    _check_gpt2_dir(path, model, ids)
    back = _gpt2()
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    Booster().load_model(back, path)
    back.eval()
    torch.testing.assert_close(back(ids).logits, model(ids).logits)
    sharded = str(tmp_path / "gpt2-w2")
    spawn(_save_gpt2, 2, args=(sharded,))
    _check_gpt2_dir(sharded, model, ids)


def _slices_and_precisions(rank: int, world_size: int, root: str) -> None:
    from colossal.checkpoint_io import TensorReader

    # ZeRO bf16 (model in bf16, fp32 masters in the optimizer) -> fp32 DDP and FSDP.
    booster = make_booster("zero1", "bf16")
    model = make_model()
    optimizer = make_optimizer(model)
    model, optimizer, *_ = booster.boost(model, optimizer)
    train_steps(model, optimizer, booster, range(2), rank, world_size)
    booster.save_model(model, f"{root}/bf16/model")
    booster.save_optimizer(optimizer, f"{root}/bf16/optim")
    masters = optimizer.state_dict()["state"]  # full states (collective)
    calls: list[tuple[str, object]] = []
    original = TensorReader.read

    def spy(self: TensorReader, name: str, index: object = None) -> torch.Tensor:
        calls.append((name, index))
        return original(self, name, index)

    TensorReader.read = spy  # type: ignore[method-assign]
    try:
        for plugin in ("ddp", "fsdp"):
            calls.clear()
            target, tmodel, topt, _ = _boost(plugin)
            target.load_model(tmodel, f"{root}/bf16/model")
            target.load_optimizer(topt, f"{root}/bf16/optim")
            state = {
                k: target.checkpoint_io.to_full(v) for k, v in tmodel.unwrap().state_dict().items()
            }
            saved = booster.checkpoint_io.model_state(model)
            for name, value in saved.items():
                torch.testing.assert_close(state[name].cpu(), value.float().cpu(), msg=name)
            if plugin == "fsdp":  # only this rank's rows of every weight were read
                assert all(index is not None for name, index in calls if name.endswith("weight")), (
                    calls
                )
                assert all(
                    isinstance(index, tuple) and all(isinstance(i, slice) for i in index)
                    for _, index in calls
                    if index is not None
                )
            else:
                assert all(index is None for _, index in calls)
            # the plain optimizer dropped ZeRO's master weights but kept Adam's moments
            exp_avg = target.checkpoint_io.to_full(
                topt.state[topt.param_groups[0]["params"][0]]["exp_avg"]
            )
            torch.testing.assert_close(exp_avg.cpu(), masters[0]["exp_avg"].cpu())
            assert "master_param" not in topt.state[topt.param_groups[0]["params"][0]]
    finally:
        TensorReader.read = original  # type: ignore[method-assign]


def test_fsdp_reads_slices_and_bf16_loads_into_fp32(tmp_path) -> None:
    spawn(_slices_and_precisions, 2, args=(str(tmp_path),))


def _model_only_into_bf16_zero(rank: int, world_size: int, root: str) -> float:
    booster = make_booster("ddp")
    model, *_ = booster.boost(make_model())
    booster.save_model(model, f"{root}/model")
    saved = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    booster = make_booster("zero2", precision="bf16")
    fresh = make_model(seed=99)
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.0)  # the step keeps the masters
    fresh, optimizer, *_ = booster.boost(fresh, optimizer)
    booster.load_model(fresh, f"{root}/model")  # no optimizer checkpoint: masters must follow
    train_steps(fresh, optimizer, booster, range(1), rank, world_size)
    worst = 0.0
    for name, param in fresh.unwrap().named_parameters():
        expected = saved[name].to(torch.bfloat16).float()
        worst = max(worst, float((param.detach().float() - expected).abs().max()))
    return worst


def test_model_checkpoint_alone_updates_zero_master_weights(tmp_path) -> None:
    # After loading only the model, ZeRO's fp32 masters must take the loaded weights, or the
    # next step writes the old weights back into the model.
    for worst in spawn(_model_only_into_bf16_zero, 2, args=(str(tmp_path),)):
        assert worst == 0.0
