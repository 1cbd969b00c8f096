"""Booster.enable_lora / save_lora_as_pretrained (peft) under DDP, ZeRO-2 and FSDP2.

A tiny GPT-2 with LoRA on its attention trains at world 2 like one process on the global
batch: the base weights stay bitwise unchanged, the adapters change and match the reference,
and the saved adapter loads with ``peft.PeftModel.from_pretrained`` and gives the trained
model's outputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from booster_testlib import make_booster, tiny_gpt2_config
from torch import nn

from colossal.booster import Booster
from colossal.core.testing import distributed_test

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

STEPS = 3
BATCH, SEQ = 4, 8
TOL = 1e-5


def make_gpt2(seed: int = 7) -> nn.Module:
    config = tiny_gpt2_config()
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # deterministic
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def lora_config() -> object:
    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True
    )


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, 64, (BATCH, SEQ), generator=g)


def _train(model: nn.Module, optimizer: object, step_fn: object, rank: int, world: int) -> None:
    n = BATCH // world
    for step in range(STEPS):
        ids = tokens(step)[rank * n : (rank + 1) * n]
        loss = model(input_ids=ids, labels=ids).loss
        step_fn(loss)
        optimizer.step()
        optimizer.zero_grad()


def _reference() -> dict[str, torch.Tensor]:
    """One process, the global batch: the adapter weights after STEPS steps."""
    model = peft.get_peft_model(make_gpt2(), lora_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer, lambda loss: loss.backward(), 0, 1)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter of a boosted model (collective under FSDP)."""
    from torch.distributed.tensor import DTensor

    inner = model.unwrap()
    out = {}
    for name, p in inner.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().float().cpu()
    return out


PLUGINS = ["ddp", "zero2", "fsdp"]


@distributed_test(2)
def test_lora_trains_adapters_only(rank: int, world_size: int, tmp_path: Path) -> None:
    """Adapters train like the reference, the base stays put, and the saved adapter loads.

    One spawn runs every plugin (importing transformers and peft dominates the time).
    Catches: base weights that move (not frozen, or ZeRO writing its masters back), adapter
    gradients not averaged over the ranks (differs from the reference), ZeRO sharding frozen
    parameters, and saving FSDP2 shards (or nothing) instead of the full adapter.
    """
    reference = _reference()
    for plugin in PLUGINS:
        _check_plugin(plugin, rank, world_size, tmp_path / plugin, reference)


def _check_plugin(
    plugin: str, rank: int, world_size: int, directory: Path, reference: dict
) -> None:
    booster = make_booster(plugin)
    assert booster.plugin.support_lora()
    model = booster.enable_lora(make_gpt2(), lora_config=lora_config())
    assert isinstance(model, peft.PeftModel)
    frozen0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert adapters0 and all("lora_" in n for n in adapters0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen ones are skipped
    model, optimizer, *_ = booster.boost(model, optimizer)
    if plugin == "zero2":
        params = list(model.unwrap().parameters())
        assert all(optimizer.manages(p) == p.requires_grad for p in params), (
            "ZeRO must shard only the trainable (adapter) parameters"
        )
    _train(model, optimizer, lambda loss: booster.backward(loss, optimizer), rank, world_size)

    params = _full_params(model)
    assert params.keys() == frozen0.keys() | adapters0.keys()
    for name, value in frozen0.items():
        assert torch.equal(params[name], value), f"{plugin}: base weight {name} changed"
    for name, value in reference.items():
        assert not torch.equal(params[name], adapters0[name]), f"{plugin}: {name} did not train"
        torch.testing.assert_close(
            params[name], value, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{plugin} {n}: {m}"
        )

    booster.save_lora_as_pretrained(model, str(directory), use_safetensors=plugin == "fsdp")
    weights = "adapter_model.safetensors" if plugin == "fsdp" else "adapter_model.bin"
    assert (directory / weights).is_file() and (directory / "adapter_config.json").is_file()
    assert json.loads((directory / "adapter_config.json").read_text())["r"] == 4

    ids = tokens(99)
    with torch.no_grad():
        trained = model(input_ids=ids).logits.float()
        loaded = peft.PeftModel.from_pretrained(make_gpt2(), str(directory))
        expected = loaded(input_ids=ids).logits
    torch.testing.assert_close(
        trained, expected, rtol=TOL, atol=TOL, msg=lambda m: f"{plugin} loaded adapter: {m}"
    )

    # pretrained_dir: the saved adapter comes back, trainable, under a new booster.
    again = make_booster(plugin).enable_lora(make_gpt2(), pretrained_dir=str(directory))
    for name, value in reference.items():
        param = again.get_parameter(name)
        assert param.requires_grad, name
        torch.testing.assert_close(
            param.detach(), value, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{plugin} {n}: {m}"
        )


def test_lora_refusals(tmp_path: Path) -> None:
    """Quantization, a missing config, boosted models and models without adapters fail."""
    booster = Booster()
    with pytest.raises(ValueError, match="bitsandbytes"):
        booster.enable_lora(make_gpt2(), lora_config=lora_config(), quantize=True)
    with pytest.raises(ValueError, match="bitsandbytes"):
        booster.enable_lora(make_gpt2(), lora_config=lora_config(), bnb_quantization_config={})
    with pytest.raises(ValueError, match="lora_config=peft.LoraConfig"):
        booster.enable_lora(make_gpt2())
    with pytest.raises(TypeError, match="LoraConfig"):
        booster.enable_lora(make_gpt2(), lora_config={"r": 4})
    with pytest.raises(ValueError, match="not a directory"):
        booster.enable_lora(make_gpt2(), pretrained_dir=str(tmp_path / "missing"))
    plain = make_gpt2()
    boosted, *_ = booster.boost(plain)
    with pytest.raises(ValueError, match="before booster.boost"):
        booster.enable_lora(boosted, lora_config=lora_config())
    with pytest.raises(ValueError, match="before booster.boost"):
        booster.enable_lora(plain, lora_config=lora_config())
    with pytest.raises(ValueError, match="no LoRA adapter"):
        booster.save_lora_as_pretrained(boosted, str(tmp_path / "x"))

    from colossal.booster.plugin import Plugin

    class NoLora(Plugin):
        configure = get_checkpoint_io = lambda self, *a: None  # noqa: E731

    with pytest.raises(NotImplementedError, match="does not support LoRA") as refused:
        Booster(plugin=NoLora()).enable_lora(make_gpt2(), lora_config=lora_config())
    for name in ("TorchDDPPlugin", "LowLevelZeroPlugin", "TorchFSDPPlugin", "GeminiPlugin",
                 "HybridParallelPlugin"):  # every plugin that supports LoRA is named
        assert name in str(refused.value)


def test_import_does_not_load_peft() -> None:
    code = (
        "import sys, colossal.booster\n"
        "from colossal.booster import Booster\n"
        "assert 'peft' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
