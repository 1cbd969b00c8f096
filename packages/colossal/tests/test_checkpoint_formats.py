"""load_model reads what users already have; single-file saves; clear errors for other files."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from booster_testlib import make_booster, make_model, make_optimizer, tiny_gpt2_config, train_steps
from safetensors.torch import load_file, save_file
from torch import nn

from colossal.booster import Booster
from colossal.checkpoint_io import CheckpointError
from colossal.core.testing import spawn

LOGGER = "colossal.checkpoint_io.template"


def _state(seed: int = 5) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_model(seed).state_dict().items()}


def _load(path: str, caplog: pytest.LogCaptureFixture) -> tuple[dict[str, torch.Tensor], str]:
    """Load ``path`` into a model of other values; its state and what load_model logged."""
    fresh = make_model(seed=77)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        Booster().load_model(fresh, path)
    found = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(found) == 1, found
    return fresh.state_dict(), found[0]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)


def _hf_sharded(directory: str, state: dict[str, torch.Tensor]) -> None:
    """Two safetensors shards and the index Hugging Face writes (no sizes, no checksums)."""
    os.makedirs(directory)
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: state[k].contiguous() for k in keys}, os.path.join(directory, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())},
             "weight_map": {k: f for f, keys in halves.items() for k in keys}}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as file:
        json.dump(index, file)


# ---- every format, and what load_model says it found ------------------------------------------


def test_colossal_directory(tmp_path, caplog) -> None:
    model = make_model(seed=5)
    Booster().save_model(model, str(tmp_path / "ck"), shard=True, size_per_shard=0.0005)
    state, found = _load(str(tmp_path / "ck"), caplog)
    _assert_equal(state, _state())
    assert "Colossal checkpoint directory" in found


def test_hf_directory_with_model_safetensors(tmp_path, caplog) -> None:
    os.makedirs(tmp_path / "hf")
    save_file(_state(), str(tmp_path / "hf" / "model.safetensors"))
    state, found = _load(str(tmp_path / "hf"), caplog)
    _assert_equal(state, _state())
    assert "Hugging Face model directory" in found and "model.safetensors" in found


def test_hf_directory_with_sharded_safetensors(tmp_path, caplog) -> None:
    _hf_sharded(str(tmp_path / "hf"), _state())
    state, found = _load(str(tmp_path / "hf"), caplog)
    _assert_equal(state, _state())
    assert "Hugging Face model directory" in found and "2 safetensors shards" in found


def test_hf_directory_with_pytorch_model_bin(tmp_path, caplog) -> None:
    os.makedirs(tmp_path / "hf")
    torch.save(_state(), tmp_path / "hf" / "pytorch_model.bin")
    state, found = _load(str(tmp_path / "hf"), caplog)
    _assert_equal(state, _state())
    assert "Hugging Face model directory" in found and "pytorch_model.bin" in found


def test_single_safetensors_file(tmp_path, caplog) -> None:
    save_file(_state(), str(tmp_path / "weights.safetensors"))
    state, found = _load(str(tmp_path / "weights.safetensors"), caplog)
    _assert_equal(state, _state())
    assert "safetensors file" in found


@pytest.mark.parametrize("prefix", ["", "module."])
def test_torch_saved_state_dict(tmp_path, caplog, prefix) -> None:
    """A plain or a DDP-wrapped model's ``state_dict`` saved with ``torch.save``."""
    torch.save({prefix + k: v for k, v in _state().items()}, tmp_path / "model.pt")
    state, found = _load(str(tmp_path / "model.pt"), caplog)
    _assert_equal(state, _state())  # caught: "module.head.weight" reported as unexpected
    assert "torch.save'd state dict" in found


def test_prefix_is_kept_when_the_model_has_it(tmp_path) -> None:
    """Only a prefix the model lacks is dropped: a model whose names start with it loads as is."""
    wrapper = nn.Module()
    wrapper.module = make_model(seed=5)
    torch.save(wrapper.state_dict(), tmp_path / "wrapped.pt")
    fresh = nn.Module()
    fresh.module = make_model(seed=77)
    Booster().load_model(fresh, str(tmp_path / "wrapped.pt"))
    _assert_equal(fresh.module.state_dict(), _state())


# ---- save_model(shard=False) to a .safetensors path writes that one file ----------------------


@pytest.mark.parametrize("use_async", [False, True])
def test_save_model_to_a_safetensors_file(tmp_path, caplog, use_async) -> None:
    with open(tmp_path / "notes.txt", "w") as file:
        file.write("mine")
    booster = Booster()
    model, *_ = booster.boost(make_model(seed=5))
    path = str(tmp_path / "weights.safetensors")
    booster.save_model(model, path, use_async=use_async)
    booster.wait_async_saves()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "weights.safetensors"]
    _assert_equal(load_file(path), _state())  # a plain safetensors file (caught: a directory)
    state, found = _load(path, caplog)
    _assert_equal(state, _state())


# ---- what is not a checkpoint: the error says what it is --------------------------------------


def _write(path, data: bytes) -> str:
    with open(path, "wb") as file:
        file.write(data)
    return str(path)


def test_bad_files_are_described(tmp_path) -> None:
    model = make_model()
    cases = {
        _write(tmp_path / "x.txt", b"hello\n"): "x.txt is a text file, not a checkpoint",
        _write(tmp_path / "c.json", b'{"a": 1}'): "c.json is a JSON file, not a checkpoint",
        _write(tmp_path / "r.bin", bytes(range(256))): "r.bin is a binary file of 256 bytes",
        _write(tmp_path / "e.pt", b""): "e.pt is an empty file",
        _write(tmp_path / "bad.safetensors", b"\x10" + b"\x00" * 7 + b"{garbage"):
            "bad.safetensors is not a valid safetensors file",
    }
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    cases[str(tmp_path / "list.pt")] = "list.pt is a torch.save'd list, not a state dict"
    torch.save({"model": _state(), "step": torch.tensor(3), "epoch": 2}, tmp_path / "full.pt")
    cases[str(tmp_path / "full.pt")] = "entries ['epoch', 'model'] are not tensors"
    os.makedirs(tmp_path / "run1")
    _write(tmp_path / "run1" / "log.txt", b"loss 1.0")
    cases[str(tmp_path / "run1")] = "holds no model checkpoint (log.txt)"
    for path, message in cases.items():
        with pytest.raises(CheckpointError) as info:
            Booster().load_model(model, path)
        assert message in str(info.value), (path, str(info.value))
        assert "no checkpoint at" not in str(info.value)  # the path exists: say what it is
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Booster().load_model(model, str(tmp_path / "missing"))


# ---- another model's optimizer state is refused by every plugin alike -------------------------


def _other_models_optimizer(rank: int, world: int, path: str, plugin: str) -> str | None:
    booster = make_booster(plugin)
    model = make_model()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model))
    train_steps(model, optimizer, booster, range(1), rank, world)
    booster.save_optimizer(optimizer, path)
    other = make_model()
    other.head = nn.Linear(16, 5)  # same names, another shape
    other_booster = make_booster(plugin)
    other, other_opt, *_ = other_booster.boost(other, make_optimizer(other))
    try:
        other_booster.load_optimizer(other_opt, path)
    except CheckpointError as err:
        return str(err)
    return None


def test_other_models_optimizer_state_is_refused_under_ddp_like_zero(tmp_path) -> None:
    [ddp] = spawn(_other_models_optimizer, 1, args=(str(tmp_path / "ddp"), "ddp"))
    [zero] = spawn(_other_models_optimizer, 1, args=(str(tmp_path / "zero"), "zero2"))
    assert ddp is not None, "DDP loaded another model's optimizer state"
    assert "'head.weight.exp_avg' has shape (3, 16)" in ddp and "(5, 16)" in ddp, ddp
    assert ddp == zero


# ---- world 2 -------------------------------------------------------------------------------


def _load_foreign_at_world_2(rank: int, world: int, root: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for path in (os.path.join(root, "hf"), os.path.join(root, "ddp.pt")):
        booster = make_booster("ddp")
        model, *_ = booster.boost(make_model(seed=77))
        booster.load_model(model, path)
        out.append({k: v.clone() for k, v in model.unwrap().state_dict().items()})
    return out


def test_foreign_formats_load_at_world_2(tmp_path) -> None:
    _hf_sharded(str(tmp_path / "hf"), _state())
    torch.save({"module." + k: v for k, v in _state().items()}, tmp_path / "ddp.pt")
    for per_rank in spawn(_load_foreign_at_world_2, 2, args=(str(tmp_path),)):
        for state in per_rank:
            _assert_equal(state, _state())


# ---- Hugging Face loads every save, whichever names the shards took -------------------------


def test_from_pretrained_loads_after_repeated_saves(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    path = str(tmp_path / "gpt2")
    booster = Booster()
    torch.manual_seed(0)
    model, *_ = booster.boost(transformers.GPT2LMHeadModel(tiny_gpt2_config()))
    for step in range(3):  # the names alternate: the second save must not reuse the first's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (step + 1))
        booster.save_model(model, path)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(path)
        want = model.state_dict()
        for key, value in loaded.state_dict().items():
            torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)
