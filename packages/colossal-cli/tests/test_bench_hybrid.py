"""Gemini and hybrid-parallel benchmark rows: which layouts are offered, the workload they train,
and (with the meta-package) real 2-rank runs of hybrid TP2, PP2 and Gemini static."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from click.testing import CliRunner
from conftest import cli_env

import colossal.cli.bench.command as command
import colossal.cli.bench.workload as workload
from colossal.cli.bench.configs import (
    BenchConfig,
    enumerate_configs,
    split_supported,
    unsupported_reason,
)
from colossal.cli.bench.gpt import gpt_config
from colossal.cli.bench.runner import BenchSettings, run_one
from colossal.cli.main import cli

HAS_META = importlib.util.find_spec("colossal.booster") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
SETTINGS = BenchSettings(2, True, steps=2, warmup=1, seq_len=32, batch_size=2, timeout=180)


def test_hybrid_rows_train_the_hf_workload() -> None:
    configs = {c.name: c for c in enumerate_configs(2, ["GeminiPlugin", "HybridParallelPlugin"])}
    assert list(configs) == ["gemini-static", "gemini-auto", "hybrid-tp1-pp2-dp1",
                             "hybrid-tp2-pp1-dp1"]  # fmt: skip
    assert configs["gemini-static"].workload == "gpt"
    pp2 = configs["hybrid-tp1-pp2-dp1"]
    assert pp2.workload == "hf-gpt2"
    assert pp2.plugin_kwargs == {"tp_size": 1, "pp_size": 2, "precision": "fp32",
                                 "microbatch_size": 1}  # fmt: skip
    assert BenchConfig.from_dict(pp2.to_dict()) == pp2
    bf16 = enumerate_configs(2, ["HybridParallelPlugin"], ("bf16",))
    assert [c.name for c in bf16] == ["hybrid-tp1-pp2-dp1-bf16", "hybrid-tp2-pp1-dp1-bf16"]
    with pytest.raises(ValueError, match="workload='bert' must be one of"):
        BenchConfig("x", "HybridParallelPlugin", workload="bert")


def test_layouts_the_model_cannot_take_are_left_out_with_the_reason() -> None:
    configs = enumerate_configs(4, ["HybridParallelPlugin"])
    tiny = gpt_config("tiny", 64)  # 2 layers, 2 heads
    kept, dropped = split_supported(configs, tiny)
    assert [c.name for c in kept] == ["hybrid-tp1-pp2-dp2", "hybrid-tp2-pp1-dp2",
                                      "hybrid-tp2-pp2-dp1"]  # fmt: skip
    assert [(c.name, why) for c, why in dropped] == [
        ("hybrid-tp1-pp4-dp1", "2 layers do not fill pp_size=4 pipeline stages"),
        ("hybrid-tp4-pp1-dp1", "2 attention heads do not split over tp_size=4"),
    ]
    small = gpt_config("small", 64)  # 4 layers, 4 heads: every layout of 4 ranks
    assert split_supported(configs, small) == (configs, [])
    assert unsupported_reason(enumerate_configs(4, ["LowLevelZeroPlugin"])[0], tiny) is None


def test_list_shows_the_workload_and_the_skipped_layouts(monkeypatch) -> None:
    monkeypatch.setattr(command, "installed_plugins", lambda: ["HybridParallelPlugin"])
    res = CliRunner().invoke(cli, ["benchmark", "--cpu", "--nproc", "4", "--list",
                                   "--filter", "tp2"])  # fmt: skip
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # rich wraps long lines
    assert "hybrid-tp2-pp2-dp1: HybridParallelPlugin({'tp_size': 2, 'pp_size': 2, " in text
    assert "'microbatch_size': 1}), model hf-gpt2" in text
    res = CliRunner().invoke(cli, ["benchmark", "--cpu", "--nproc", "4", "--list",
                                   "--filter", "tp4"])  # fmt: skip
    assert res.exit_code == 2
    assert "the tiny model can run none of the selected configurations" in res.output
    assert "2 attention heads do not split over tp_size=4" in " ".join(res.output.split())
    res = CliRunner().invoke(cli, ["benchmark", "--cpu", "--nproc", "4", "--list", "--filter",
                                   "tp4", "--model-size", "small"])  # fmt: skip
    assert res.exit_code == 0 and "hybrid-tp4-pp1-dp1" in res.output


class _Booster:
    """Records what a step asks of the Booster (no distributed setup needed)."""

    def __init__(self, pipeline: bool) -> None:
        self.plugin = type("P", (), {"support_pipeline": lambda _self: pipeline})()
        self.calls: list[tuple] = []

    def execute_pipeline(self, data_iter, model, criterion, optimizer, return_loss):
        batch = next(data_iter)
        self.calls.append(("pipeline", sorted(batch), criterion(_Out(), batch), return_loss))
        return {"loss": None}

    def backward(self, loss, optimizer) -> None:
        self.calls.append(("backward", float(loss)))


class _Out:
    loss = torch.tensor(2.5)


def test_steps_of_each_workload() -> None:
    tokens = torch.arange(10).reshape(2, 5)
    hf = BenchConfig("h", "HybridParallelPlugin", workload="hf-gpt2")
    booster = _Booster(pipeline=True)
    assert workload.make_step(hf, booster, object(), "opt")(tokens) is None
    assert booster.calls == [("pipeline", ["input_ids", "labels", "shift_labels"],
                              _Out.loss, True)]  # fmt: skip
    seen = {}

    def hf_model(**batch):
        seen.update(batch)
        return _Out()

    booster = _Booster(pipeline=False)
    assert float(workload.make_step(hf, booster, hf_model, "opt")(tokens)) == 2.5
    assert torch.equal(seen["input_ids"], tokens[:, :-1])
    assert torch.equal(seen["shift_labels"], tokens[:, 1:])  # targets already shifted
    assert booster.calls == [("backward", 2.5)]
    booster = _Booster(pipeline=True)  # the plain GPT is called directly, even so
    step = workload.make_step(BenchConfig("g", "GeminiPlugin"), booster,
                              lambda idx, tgt: (idx - tgt).float().mean(), "opt")  # fmt: skip
    assert float(step(tokens)) == -1.0 and booster.calls == [("backward", -1.0)]


def test_data_replica(monkeypatch) -> None:
    monkeypatch.setattr(workload.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(workload.dist, "get_world_size", lambda: 4)
    assert workload.data_replica(object()) == (3, 4)  # ddp, fsdp, zero, gemini: every rank
    dims = type("D", (), {"coordinate": lambda _self, axis: {"dp": 1}[axis]})()
    hybrid = type("H", (), {"parallel_dims": dims, "dp_size": 2})()
    assert workload.data_replica(hybrid) == (1, 2)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="needs transformers (the colossal meta-package)")
def test_hf_workload_has_the_gpt_parameter_count() -> None:
    cfg = gpt_config("tiny", 32)
    model = workload.hf_gpt2(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert not model.config.tie_word_embeddings and model.config.n_positions == 32


def test_hf_workload_without_transformers_says_how_to_get_it(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ModuleNotFoundError, match="pip install colossal"):
        workload.hf_gpt2(gpt_config("tiny", 32))


@pytest.fixture
def _worker_env(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", cli_env()["PYTHONPATH"])


@pytest.mark.skipif(not HAS_META, reason="needs the colossal meta-package (colossal.booster)")
@pytest.mark.usefixtures("_worker_env")
def test_hybrid_and_gemini_rows_run() -> None:
    cfg = gpt_config("tiny", SETTINGS.seq_len)
    param_bytes = cfg.num_params() * 4
    configs = {c.name: c for c in enumerate_configs(2, ["GeminiPlugin", "HybridParallelPlugin"])}
    rows = {name: run_one(configs[name], SETTINGS)
            for name in ("hybrid-tp2-pp1-dp1", "hybrid-tp1-pp2-dp1", "gemini-static")}
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row)
        assert row["world_size"] == 2 and row["model_params"] == cfg.num_params()
        assert row["tokens_per_s"] == pytest.approx(2 * 32 * 2 / row["step_time_s"])
        assert row["comm_source"] == "colossal.core.comm" and row["comm_bytes_per_step"] > 0
        # near ln(512) = 6.24 after 3 steps at lr 1e-4; the mean over the holding ranks
        assert 5.5 < row["final_loss"] < 7.0, (name, row)
    # DDP would hold 4 x the parameters (params, grads, Adam's two states): each of these
    # holds about half of them.
    for name in rows:
        assert rows[name]["peak_model_state_bytes"] < 0.6 * 4 * param_bytes, (name, rows[name])
    assert rows["hybrid-tp1-pp2-dp1"]["workload"] == "hf-gpt2"
    assert os.environ.get("COLOSSAL_ACCELERATOR") != "cpu"  # set only for the workers
