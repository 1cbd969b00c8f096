"""Checkpoints of tensors placed along several axes load under one process, and the reverse.

ZeRO x TP 2 x PP 2 x DP 2 (8 ranks: each optimizer state is a ZeRO flat range of a
tensor-parallel block, owned by one pipeline stage, GPT-2's tied embedding on two stages;
stage 1, as the plugin refuses ZeRO-2 under a pipeline, like ColossalAI: its states are laid
out as stage 2's)
and Gemini x TP 2 x DP 2 (4 ranks: a chunk piece of a tensor-parallel block) save after two
AdamW steps; a plain single process (DDP at world 1) loads model and optimizer and takes the
third step, which must match the parallel run's own third step. The reverse: the single
process's checkpoint continues in each layout. What it catches: a state gathered from the
wrong axis or rank (values differ), a part read through the wrong composition on load (the
third step differs), the tied weight's state saved from two stages or none (a strict load
fails), Adam restarting without its moments (an update about three times too large).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hybrid_testlib import global_batch, gpt2, make_optimizer, rows
from safetensors.torch import load_file

from colossal.booster import Booster
from colossal.core.testing import relative_error, spawn

STEPS = 2
TOLERANCE = 2e-5  # rounding of another reduction order; a lost moment is ~1e-1


def _saved(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of a model checkpoint directory, by name (fp32)."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("model") and name.endswith(".safetensors"):
            out.update({k: v.float() for k, v in load_file(os.path.join(directory, name)).items()})
    return out


def _step(booster: Booster, model: Any, optimizer: Any, step: int) -> None:
    plugin = booster.plugin
    if plugin is None:
        batch = global_batch(step)
    else:
        batch = rows(global_batch(step), plugin.rank, plugin.world_size)
    optimizer.zero_grad()
    if getattr(plugin, "pp_size", 1) > 1:
        booster.execute_pipeline(iter([batch]), model, lambda o, mb: o.loss, optimizer)
    else:
        booster.backward(model(**batch).loss, optimizer)
    optimizer.step()


def _boost(plugin: Any) -> tuple[Booster, Any, Any]:
    booster = Booster(plugin=plugin)
    model = gpt2()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, "adamw"))
    return booster, model, optimizer


def _plugin(kind: str) -> Any:
    from colossal.booster.plugin import GeminiPlugin, HybridParallelPlugin

    if kind == "hybrid":
        return HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, num_microbatches=2,
                                    precision="fp32")
    return GeminiPlugin(tp_size=2, precision="fp32", placement_policy="static",
                        chunk_config_dict={"chunk_size": 4096})


def _parallel(rank: int, world_size: int, kind: str, root: str) -> None:
    """Load the single process's save and step; train, save and step in the layout."""
    booster, model, optimizer = _boost(_plugin(kind))
    booster.load_model(model, f"{root}/single")
    booster.load_optimizer(optimizer, f"{root}/single")
    _step(booster, model, optimizer, STEPS)
    booster.save_model(model, f"{root}/{kind}_from_single", shard=True)
    booster, model, optimizer = _boost(_plugin(kind))
    for step in range(STEPS):
        _step(booster, model, optimizer, step)
    booster.save_model(model, f"{root}/{kind}", shard=True, size_per_shard=1)
    booster.save_optimizer(optimizer, f"{root}/{kind}", shard=True, size_per_shard=1)
    _step(booster, model, optimizer, STEPS)
    booster.save_model(model, f"{root}/{kind}_continued", shard=True)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: other tensors {sorted(set(got) ^ set(want))}"
    common = sorted(got)
    err = relative_error(torch.cat([got[k].flatten() for k in common]),
                         torch.cat([want[k].flatten() for k in common]))
    assert err <= TOLERANCE, f"{what}: error {err:.1e}"


@pytest.mark.parametrize(("kind", "world"), [("hybrid", 8), ("gemini", 4)])
def test_saves_load_in_one_process_and_the_reverse(tmp_path: Any, kind: str, world: int) -> None:
    torch.set_num_threads(1)
    root = str(tmp_path)
    booster, model, optimizer = _boost(None)
    for step in range(STEPS):
        _step(booster, model, optimizer, step)
    booster.save_model(model, f"{root}/single", shard=True, size_per_shard=1)
    booster.save_optimizer(optimizer, f"{root}/single", shard=True, size_per_shard=1)
    _step(booster, model, optimizer, STEPS)
    booster.save_model(model, f"{root}/single_continued", shard=True)
    spawn(_parallel, world, args=(kind, root), timeout=600)
    single = _saved(f"{root}/single_continued")
    _close(_saved(f"{root}/{kind}_from_single"), single, f"single -> {kind}")
    booster, model, optimizer = _boost(None)  # the layout's save continued in one process
    booster.load_model(model, f"{root}/{kind}")
    booster.load_optimizer(optimizer, f"{root}/{kind}")
    _step(booster, model, optimizer, STEPS)
    booster.save_model(model, f"{root}/{kind}_in_single", shard=True)
    _close(_saved(f"{root}/{kind}_in_single"), _saved(f"{root}/{kind}_continued"),
           f"{kind} -> single")
