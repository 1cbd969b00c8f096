"""Booster.enable_lora under MoeHybridParallelPlugin trains like one peft process.

World 4, ep 2 x moe_dp 2 and tp 2 x ep 2 (ZeRO-1), a tiny Mixtral with rank-4 adapters on
the attention projections, fp32 AdamW over ``model.parameters()`` (frozen ones included, as
users write it) with clipping active. Compared with a single-process peft model trained on
the whole global batch: the losses, the clipped norms, the adapters this rank holds, the
base weights (experts included) bitwise unchanged, the adapter ``save_lora_as_pretrained``
writes (merged into a fresh Mixtral it equals the reference merged) and the model checkpoint
(peft's names, every expert gathered).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_hybrid_testlib import (
    MAX_NORM,
    RTOL,
    batch,
    expected_part,
    held_whole,
    mean_over,
    mixtral,
    rows,
)

from colossal.booster import Booster
from colossal.core import shard_spec
from colossal.core.comm import all_gather_object
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.zero import is_expert_param

peft = pytest.importorskip("peft")

STEPS = 2
PREFIX = "base_model.model."  # peft's prefix of the Hugging Face model's names


def _lora_config() -> object:
    return peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"]
    )


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _reference() -> tuple[list[float], list[float], torch.nn.Module]:
    """Losses, clipped norms and the peft model after ``STEPS`` steps on the global batch."""
    torch.manual_seed(1)  # the adapters' initialization, as on every rank below
    model = peft.get_peft_model(mixtral(), _lora_config())
    opt = _adamw(model)
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, model


@distributed_test(4, timeout=150, comm_timeout=60)
def test_lora_ep2_dp2_and_tp2_ep2_match_single_process_peft(rank: int, world_size: int) -> None:
    """Catches: LoRA refused, the experts not made expert-parallel inside a PeftModel (or
    replaced on the wrapper, losing peft's names), frozen experts given a ZeRO part or moved,
    adapter gradients not averaged over dp, a norm over frozen weights, under tp 2 the
    adapters not split with their layers (or the experts tensor-split), a saved adapter or
    model missing an ep rank's experts or a tp part, or using the inner model's names."""
    torch.set_num_threads(1)
    ref_losses, ref_norms, ref = _reference()
    assert min(ref_norms) > 2 * MAX_NORM, ref_norms
    root = all_gather_object(tempfile.mkdtemp(prefix="moe_lora_") if rank == 0 else None)[0]
    assert root is not None
    try:
        for i, layout in enumerate(({"ep_size": 2}, {"tp_size": 2, "ep_size": 2})):
            _check_layout(rank, ref_losses, ref_norms, ref, Path(root) / str(i), layout)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def _check_layout(
    rank: int,
    ref_losses: list[float],
    ref_norms: list[float],
    ref: torch.nn.Module,
    root: Path,
    layout: dict[str, int],
) -> None:
    from colossal.booster.plugin import MoeHybridParallelPlugin

    plugin = MoeHybridParallelPlugin(precision="fp32", zero_stage=1, max_norm=MAX_NORM, **layout)
    assert plugin.support_lora()
    booster = Booster(plugin=plugin)
    torch.manual_seed(1)
    model = booster.enable_lora(mixtral(), lora_config=_lora_config())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    boosted, optimizer, *_ = booster.boost(model, _adamw(model))
    held = dict(boosted.unwrap().named_parameters())
    assert sum(is_expert_param(p) for p in held.values()) == 4, sorted(held)
    for name, p in held.items():
        assert p.requires_grad == ("lora_" in name), (layout, name)
        assert optimizer.manages(p) == p.requires_grad, (layout, name)
    if plugin.tp_size > 1:  # q/v: lora_B split by columns, o_proj: lora_A by rows
        split = [n for n, p in held.items() if "lora_" in n and shard_spec(p) is not None]
        assert len(split) * 2 == sum("lora_" in n for n in held), split
    dp_rank = plugin.parallel_dims.coordinate("dp")
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = boosted(**rows(batch(step), dp_rank, plugin.dp_size)).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        norms.append(optimizer.get_grad_norm())
        losses.append(mean_over(loss.item(), plugin.dp_group))
    assert_rel_close(torch.tensor(losses), torch.tensor(ref_losses), RTOL, f"{layout} losses")
    assert_rel_close(torch.tensor(norms), torch.tensor(ref_norms), RTOL, f"{layout} norms")
    optimizer.wait_params()
    whole = dict(ref.named_parameters())
    for name, p in held.items():  # the boosted model holds the model inside the PeftModel
        if p.requires_grad:
            assert_rel_close(held_whole(p), whole[PREFIX + name].detach(), RTOL, name)
        else:
            start = expected_part(p, initial[PREFIX + name], plugin.ep_group)
            assert torch.equal(held_whole(p), start), f"{layout}: frozen {name} changed"
    _check_saved(rank, booster, boosted, ref, root)


def _check_saved(
    rank: int, booster: Booster, boosted: object, ref: torch.nn.Module, root: Path
) -> None:
    """The adapter merged into a fresh Mixtral, and the model checkpoint, equal the reference."""
    from safetensors.torch import load_file

    booster.save_lora_as_pretrained(boosted, str(root / "adapter"), use_safetensors=True)
    booster.save_model(boosted, str(root / "model"))
    dist.barrier()
    if rank != 0:
        return
    expected = {k: v.detach().clone() for k, v in ref.state_dict().items()}  # peft's names
    saved: dict[str, torch.Tensor] = {}
    for file in (root / "model").glob("*.safetensors"):
        saved.update(load_file(str(file)))
    assert sorted(saved) == sorted(expected), sorted(saved.keys() ^ expected.keys())[:6]
    for name, value in expected.items():
        assert_rel_close(saved[name], value, RTOL, f"saved {name}")
    merged = peft.PeftModel.from_pretrained(mixtral(), str(root / "adapter")).merge_and_unload()
    want = dict(copy.deepcopy(ref).merge_and_unload().named_parameters())
    got = dict(merged.named_parameters())
    assert sorted(got) == sorted(want)
    for name, q in want.items():
        assert_rel_close(got[name].detach(), q.detach(), RTOL, f"merged {name}")
