"""Booster.enable_lora under HybridParallelPlugin trains like one process.

Each layout adds peft LoRA adapters to a tiny Llama or GPT-2 (tied embeddings), trains
3 steps through the Booster and is compared with a single-process peft model trained on the
whole batch, in fp32: the losses (averaged over data-parallel ranks, on the last stage), the
adapter weights this rank holds, the base weights (bitwise unchanged), ZeRO managing only
the adapters, and the adapter written by ``save_lora_as_pretrained`` (every stage's, equal
to the reference's); under tensor parallelism the adapters are split with their base
layers. What a wrong composition gives: base weights that move or get
optimizer state, adapter gradients reduced over the wrong group, a clipped step whose norm
counts a stage twice or misses one (or a replicated adapter tp times), an adapter
input gradient all-reduced twice, a saved adapter holding only the writer's stage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hybrid_testlib import MODELS, full, global_batch, make_optimizer, mean_over, rows

from colossal.booster import Booster
from colossal.core import shard_spec
from colossal.core.testing import distributed_test, relative_error

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 3
TOL = 2e-5
CLIP = 0.05  # below the adapters' gradient norms: every clipped step differs unclipped
TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_proj"]}
LAYOUTS: list[tuple[str, str, float, dict[str, Any]]] = [
    ("llama", "adamw", 0.0, {"tp_size": 1, "pp_size": 2, "zero_stage": 1, "num_microbatches": 2}),
    ("gpt2", "sgd", CLIP, {"tp_size": 1, "pp_size": 2, "zero_stage": 1, "num_microbatches": 2}),
    ("llama", "sgd", CLIP, {"tp_size": 1, "pp_size": 1, "zero_stage": 2}),
    ("gpt2", "adamw", 0.0, {"tp_size": 1, "pp_size": 4, "num_microbatches": 4}),
]


def lora_config(model_name: str) -> Any:
    """Rank-4 adapters on attention and MLP projections (fan-in-fan-out for GPT-2's Conv1D)."""
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[model_name],
                           fan_in_fan_out=model_name == "gpt2")


def _reference(model_name: str, kind: str, max_norm: float) -> tuple[list[float], Any]:
    """Losses and the peft model after ``STEPS`` steps of one process on the global batch."""
    model = peft.get_peft_model(MODELS[model_name](), lora_config(model_name))
    opt = make_optimizer(model, kind)
    losses = []
    for step in range(STEPS):
        loss = model(**global_batch(step)).loss
        opt.zero_grad()
        loss.backward()
        if max_norm:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            assert norm > max_norm, norm
        opt.step()
        losses.append(loss.item())
    return losses, model


def _micro_step(booster: Booster, model: Any, optimizer: Any, batch: dict) -> float | None:
    if booster.plugin.pp_size > 1:
        out = booster.execute_pipeline(iter([batch]), model, lambda o, mb: o.loss, optimizer)
        return None if out["loss"] is None else out["loss"].item()
    loss = model(**batch).loss
    booster.backward(loss, optimizer)
    return loss.item()


def _check_layout(model_name: str, kind: str, max_norm: float, kwargs: dict[str, Any],
                  directory: Path) -> None:
    from colossal.booster.plugin import HybridParallelPlugin

    what = f"{model_name} {kind} clip={max_norm} {kwargs}"
    ref_losses, ref = _reference(model_name, kind, max_norm)
    plugin = HybridParallelPlugin(precision="fp32", max_norm=max_norm, **kwargs)
    booster = Booster(plugin=plugin)
    model = booster.enable_lora(MODELS[model_name](), lora_config=lora_config(model_name))
    prefix = "base_model.model."
    initial = {n.removeprefix(prefix): p.detach().clone()
               for n, p in model.named_parameters(remove_duplicate=False)}
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, kind))
    held = dict(model.unwrap().named_parameters())
    assert held and any("lora_" in n for n in held), what
    for name, p in held.items():
        assert p.requires_grad == ("lora_" in name), f"{what}: {name}"
        assert optimizer.manages(p) == p.requires_grad, f"{what}: ZeRO and {name}"
    if kwargs["tp_size"] > 1:  # q/v: lora_B split by columns; down_proj: lora_A by rows
        split = {n for n, p in held.items() if "lora_" in n and shard_spec(p) is not None}
        assert split and all(("lora_B" in n) != ("down_proj" in n) for n in split), split
        assert len(split) * 2 == sum("lora_" in n for n in held), f"{what}: {split}"

    dp_rank = plugin.parallel_dims.coordinate("dp")
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _micro_step(booster, model, optimizer, rows(global_batch(step), dp_rank,
                                                            plugin.dp_size))
        optimizer.step()
        if loss is not None:
            losses.append(mean_over(loss, plugin.dp_group))
    if losses:
        err = relative_error(torch.tensor(losses), torch.tensor(ref_losses))
        assert err <= TOL, f"{what}: losses {losses} vs {ref_losses}"
    states = getattr(optimizer, "optim", optimizer).state
    state_numel = sum(p.numel() for p in states)
    trainable = sum(p.numel() for p in held.values() if p.requires_grad)
    assert 0 < state_numel <= trainable, f"{what}: optimizer state for {state_numel} elements"
    expected = {n.removeprefix(prefix): p.detach()
                for n, p in ref.named_parameters(remove_duplicate=False)}
    trained = 0
    for name, p in model.unwrap().named_parameters():
        if p.requires_grad:
            moved = not torch.equal(expected[name], initial[name])  # lora_A waits for lora_B
            assert moved == (not torch.equal(full(p), initial[name])), f"{what}: {name} moved?"
            trained += moved
            err = relative_error(full(p), expected[name])
            assert err <= TOL, f"{what}: {name} relative error {err:.2e}"
        else:
            assert torch.equal(full(p), initial[name]), f"{what}: base weight {name} changed"
    assert trained, f"{what}: no adapter trained"

    booster.save_lora_as_pretrained(model, str(directory), use_safetensors=True)
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        saved = load_file(str(directory / "adapter_model.safetensors"))
        wanted = peft.get_peft_model_state_dict(ref)
        assert saved.keys() == wanted.keys(), f"{what}: {sorted(saved)} vs {sorted(wanted)}"
        for name, value in wanted.items():
            err = relative_error(saved[name], value)
            assert err <= TOL, f"{what}: saved {name} relative error {err:.2e}"
    dist.barrier()


def _check_model_checkpoint(kwargs: dict[str, Any], directory: Path) -> None:
    """``save_model`` writes the PeftModel's state dict (peft's names, full tensors), as the
    other plugins do, and ``load_model`` reads it back into another layout's shards."""
    from safetensors.torch import load_file

    from colossal.booster.plugin import HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(precision="fp32", **kwargs))
    model = booster.enable_lora(MODELS["llama"](), lora_config=lora_config("llama"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # lora_B starts at zero
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    model, *_ = booster.boost(model)
    booster.save_model(model, str(directory))
    saved: dict[str, torch.Tensor] = {}
    for file in directory.glob("*.safetensors"):
        saved.update(load_file(str(file)))
    assert saved.keys() == expected.keys(), sorted(saved.keys() ^ expected.keys())[:5]
    for name, value in expected.items():
        assert torch.equal(saved[name], value), name
    other = Booster(plugin=HybridParallelPlugin(precision="fp32", tp_size=1, pp_size=1))
    again, *_ = other.boost(other.enable_lora(MODELS["llama"](), lora_config=lora_config("llama")))
    other.load_model(again, str(directory))
    for name, p in again.unwrap().named_parameters():
        assert torch.equal(p.detach(), expected["base_model.model." + name]), name


@distributed_test(4)
def test_lora_pipeline_zero_layouts(rank: int, world_size: int, tmp_path: Path) -> None:
    """pp2 x dp2 (ZeRO-1, AdamW), GPT-2 pp2 x dp2 with tied embeddings on two stages and
    clipping, dp4 ZeRO-2 with clipping, pp4: one spawn (imports dominate the time)."""
    for i, (model_name, kind, max_norm, kwargs) in enumerate(LAYOUTS):
        _check_layout(model_name, kind, max_norm, kwargs, tmp_path / f"layout{i}")


@distributed_test(2)
def test_lora_tp2_with_clipping(rank: int, world_size: int, tmp_path: Path) -> None:
    """Llama tp2: q/v column-parallel (replicated lora_A, split lora_B; their input enters
    the tp region once for the attention), down_proj row-parallel (split lora_A); the
    clipped SGD step sees replicated adapters counted once in the norm; the model
    checkpoint; lora_dropout keeping the replicated adapters equal."""
    _check_layout("llama", "sgd", CLIP, {"tp_size": 2, "pp_size": 1}, tmp_path / "tp2")
    _check_model_checkpoint({"tp_size": 2, "pp_size": 1}, tmp_path / "tp2-model")
    _check_dropout_keeps_replicas_equal()


def _check_dropout_keeps_replicas_equal() -> None:
    """With lora_dropout > 0 under tp2, replicated adapters stay equal over the tp ranks."""
    from colossal.booster.plugin import HybridParallelPlugin

    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    config = lora_config("llama")
    config.lora_dropout = 0.5
    model = booster.enable_lora(MODELS["llama"](), lora_config=config)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, "adamw"))
    model.train()
    torch.manual_seed(dist.get_rank())  # the global RNG may differ over the ranks
    for step in range(2):
        optimizer.zero_grad()
        booster.backward(model(**rows(global_batch(step), 0, 2)).loss, optimizer)
        optimizer.step()
    for name, p in model.unwrap().named_parameters():
        if p.requires_grad and shard_spec(p) is None:
            copies = [torch.empty_like(p) for _ in range(2)]
            dist.all_gather(copies, p.detach().contiguous())
            assert torch.equal(copies[0], copies[1]), f"{name} differs over tp"


@distributed_test(4)
def test_lora_tp2_with_zero_and_pipeline(rank: int, world_size: int, tmp_path: Path) -> None:
    """Llama tp2 x dp2 with ZeRO-2 (AdamW), then tp2 x pp2 (SGD); tp2 x pp2's model
    checkpoint."""
    _check_layout("llama", "adamw", 0.0, {"tp_size": 2, "pp_size": 1, "zero_stage": 2},
                  tmp_path / "tp2dp2")
    _check_layout("llama", "sgd", 0.0, {"tp_size": 2, "pp_size": 2, "num_microbatches": 2},
                  tmp_path / "tp2pp2")
    _check_model_checkpoint({"tp_size": 2, "pp_size": 2, "num_microbatches": 2},
                            tmp_path / "tp2pp2-model")


@distributed_test(2)
def test_lora_tp_refusals(rank: int, world_size: int) -> None:
    """Sequence parallelism with tp and adapters on fused GPT-2 projections are refused."""
    from colossal.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32",
                                  enable_sequence_parallelism=True)
    assert not plugin.support_lora()
    with pytest.raises(NotImplementedError, match=r"tp_size=2.*sequence parallelism off"):
        Booster(plugin=plugin).enable_lora(MODELS["llama"](), lora_config=lora_config("llama"))
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    model = booster.enable_lora(MODELS["gpt2"](), lora_config=lora_config("gpt2"))
    with pytest.raises(NotImplementedError, match=r"GPT2FusedLinearConv1D_Col.*tp_size=1"):
        booster.boost(model, make_optimizer(model, "sgd"))
