"""Async saves snapshot in the background; the boosted optimizer's step waits for the snapshot."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from booster_testlib import batch, make_model, make_optimizer
from safetensors.torch import load_file
from torch import nn

import colossal.core.io.writer as writer_mod
from colossal.booster import Booster
from colossal.checkpoint_io import MODEL_INDEX, OPTIMIZER_INDEX
from colossal.checkpoint_io.index import read_index
from colossal.checkpoint_io.template import unwrap_model


def _step(booster: Booster, model: nn.Module, optimizer, step: int) -> None:
    x, y = batch(step)
    booster.backward(nn.functional.mse_loss(model(x), y), optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _saved(directory: str, index_name: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(read_index(directory, index_name, True)["weight_map"].values())):
        out.update(load_file(f"{directory}/{file}"))
    return out


@pytest.mark.parametrize("same_directory", [False, True])
def test_step_waits_for_background_snapshot(tmp_path, monkeypatch, same_directory) -> None:
    copies = []
    stage = writer_mod.stage_tensors

    def slow_stage(*args) -> None:  # a slow snapshot: the step surely comes first
        time.sleep(0.3)
        stage(*args)
        copies.append(threading.current_thread().name)

    monkeypatch.setattr(writer_mod, "stage_tensors", slow_stage)
    booster = Booster()
    model = make_model()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model))
    _step(booster, model, optimizer, 0)
    params = {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()}
    named = dict(unwrap_model(model).named_parameters())
    live = optimizer.unwrap().state
    exp_avg = {f"{n}.exp_avg": live[p]["exp_avg"].clone() for n, p in named.items()}
    model_dir = f"{tmp_path}/ck" if same_directory else f"{tmp_path}/model"
    optim_dir = f"{tmp_path}/ck" if same_directory else f"{tmp_path}/optim"
    booster.save_model(model, model_dir, use_async=True)
    # In one directory too, the optimizer's save does not wait for the model's to commit.
    booster.save_optimizer(optimizer, optim_dir, use_async=True)
    assert copies == []  # both saves returned before their snapshots were taken
    _step(booster, model, optimizer, 1)  # step() must wait for the snapshots first
    assert len(copies) == 2 and all("snapshot" in name for name in copies)
    changed = [n for n, p in named.items() if not torch.equal(p, params[n])]
    assert changed  # the step did change the weights, so the files below could be wrong
    booster.wait_async_saves()
    saved = _saved(model_dir, MODEL_INDEX)
    for name, value in params.items():
        assert torch.equal(saved[name], value), name
    state = _saved(optim_dir, OPTIMIZER_INDEX)
    assert set(exp_avg) <= set(state)
    for key, value in exp_avg.items():
        assert torch.equal(state[key], value), key


def test_model_without_optimizer_snapshots_before_returning(tmp_path, monkeypatch) -> None:
    copies = []
    stage = writer_mod.stage_tensors

    def recording_stage(*args) -> None:
        stage(*args)
        copies.append(threading.current_thread().name)

    monkeypatch.setattr(writer_mod, "stage_tensors", recording_stage)
    booster = Booster()
    model, *_ = booster.boost(make_model())
    before = {n: p.detach().clone() for n, p in unwrap_model(model).named_parameters()}
    booster.save_model(model, f"{tmp_path}/model", use_async=True)
    assert copies == [threading.current_thread().name]  # copied on the caller's thread
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # nothing fences this: the snapshot must already be taken
    booster.wait_async_saves()
    saved = _saved(f"{tmp_path}/model", MODEL_INDEX)
    for name, value in before.items():
        assert torch.equal(saved[name], value), name
