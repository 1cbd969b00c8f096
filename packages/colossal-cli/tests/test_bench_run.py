"""Configurations run for real in torchrun subprocesses (2 CPU ranks, tiny GPT)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from conftest import cli_env

from colossal.cli.bench.configs import BenchConfig, enumerate_configs
from colossal.cli.bench.gpt import GPT, gpt_config
from colossal.cli.bench.runner import BenchSettings, run_one

SETTINGS = BenchSettings(2, True, steps=2, warmup=1, seq_len=32, batch_size=2, timeout=120)
HAS_META = importlib.util.find_spec("colossal.booster") is not None


@pytest.fixture(autouse=True)
def _worker_env(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])


def test_failing_configuration_gives_a_reason() -> None:
    cfg = BenchConfig("broken", "NoSuchPlugin")
    row = run_one(cfg, SETTINGS)
    assert row["status"] == "failed"
    assert row["step_time_s"] is None and row["tokens_per_s"] is None
    # With the meta-package: the missing plugin; without it: the missing module.
    assert row["error"].startswith("rank ")
    assert ("NoSuchPlugin" in row["error"]) or ("colossal.booster" in row["error"]), row


@pytest.mark.skipif(not HAS_META, reason="needs the colossal meta-package (colossal.booster)")
def test_ddp_fsdp_zero2_measurements() -> None:
    cfg = gpt_config("tiny", SETTINGS.seq_len)
    params = list(GPT(cfg).parameters())
    param_bytes = cfg.num_params() * 4
    configs = {c.name: c for c in enumerate_configs(2, ["TorchDDPPlugin", "TorchFSDPPlugin",
                                                        "LowLevelZeroPlugin"])}  # fmt: skip
    rows = {name: run_one(configs[name], SETTINGS) for name in ("ddp", "fsdp", "zero2")}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row)
        assert row["world_size"] == 2 and row["model_params"] == cfg.num_params()
        assert row["tokens_per_s"] == pytest.approx(2 * 32 * 2 / row["step_time_s"])
    ddp, fsdp, zero2 = rows["ddp"], rows["fsdp"], rows["zero2"]
    # DDP: one all-reduce of every gradient; params + grads + Adam exp_avg/exp_avg_sq + steps.
    assert ddp["comm_bytes_per_step"] == param_bytes
    assert ddp["comm_source"] == "torch ddp hook"
    assert ddp["peak_model_state_bytes"] == 4 * param_bytes + 4 * len(params)
    # FSDP2: all-gather in forward and backward, one reduce-scatter of the gradients.
    assert fsdp["comm_bytes_per_step"] == 3 * param_bytes
    assert fsdp["peak_model_state_bytes"] < ddp["peak_model_state_bytes"] / 1.8
    # ZeRO-2 through colossal.core.comm: reduce-scatter of grads + all-gather of params
    # (flat buffers padded to a multiple of the world size).
    assert zero2["comm_source"] == "colossal.core.comm"
    assert 2 * param_bytes <= zero2["comm_bytes_per_step"] <= 2 * param_bytes + 64
    assert zero2["memory_source"] == "memory_report"
    # ZeRO-2 at 2 ranks: the parameters, half the gradients (a slice kept across steps) and
    # half of Adam's two states: 2.5 x the parameter bytes, DDP's 4 x over 1.6.
    assert zero2["peak_model_state_bytes"] <= 2.5 * param_bytes + 1024
    assert zero2["peak_model_state_bytes"] < ddp["peak_model_state_bytes"] / 1.55
    assert os.environ.get("COLOSSAL_ACCELERATOR") != "cpu"  # set only for the workers
