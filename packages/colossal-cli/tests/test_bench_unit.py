from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

import colossal.cli.bench.command as command
from colossal.cli.bench.configs import (
    PLUGIN_FAMILIES,
    BenchConfig,
    enumerate_configs,
    filter_configs,
)
from colossal.cli.bench.gpt import GPT, MODEL_SIZES, gpt_config
from colossal.cli.bench.report import (
    build_table,
    format_bytes,
    json_document,
    table_cells,
    write_chart,
)
from colossal.cli.bench.runner import (
    BenchSettings,
    failure_row,
    reason_from_output,
    run_all,
    worker_command,
)
from colossal.cli.main import cli

NOW = ["TorchDDPPlugin", "TorchFSDPPlugin", "LowLevelZeroPlugin"]


def test_enumerate_current_plugins() -> None:
    names = [c.name for c in enumerate_configs(2, NOW, ("fp32", "bf16"))]
    assert names == ["ddp", "ddp-bf16", "fsdp", "fsdp-bf16", "zero1", "zero2", "zero1-bf16",
                     "zero2-bf16"]  # fmt: skip
    ddp_bf16 = enumerate_configs(2, ["TorchDDPPlugin"], ("bf16",))[0]
    assert ddp_bf16.mixed_precision == "bf16" and ddp_bf16.plugin_kwargs == {}
    zero2 = enumerate_configs(2, ["LowLevelZeroPlugin"])[1]
    assert zero2.plugin_kwargs == {"stage": 2, "precision": "fp32"}


def test_enumerate_future_plugins() -> None:
    names = [c.name for c in enumerate_configs(4, ["GeminiPlugin", "HybridParallelPlugin"])]
    assert names == [
        "gemini-static", "gemini-auto", "hybrid-tp1-pp2-dp2", "hybrid-tp1-pp4-dp1",
        "hybrid-tp2-pp1-dp2", "hybrid-tp2-pp2-dp1", "hybrid-tp4-pp1-dp1",
    ]  # fmt: skip
    assert set(PLUGIN_FAMILIES) >= set(NOW)


def test_enumerate_errors() -> None:
    with pytest.raises(ValueError, match="at least 1 device, got 0"):
        enumerate_configs(0, NOW)
    with pytest.raises(ValueError, match="unknown precision fp8"):
        enumerate_configs(2, NOW, ("fp8",))
    with pytest.raises(ValueError, match="unknown plugin 'Foo'"):
        enumerate_configs(2, ["Foo"])


def test_filter() -> None:
    configs = enumerate_configs(2, NOW, ("fp32", "bf16"))
    assert [c.name for c in filter_configs(configs, "zero*")] == [
        "zero1", "zero2", "zero1-bf16", "zero2-bf16"]  # fmt: skip
    assert [c.name for c in filter_configs(configs, "ddp,fsdp-bf16")] == [
        "ddp", "ddp-bf16", "fsdp-bf16"]  # fmt: skip
    assert filter_configs(configs, None) == configs
    with pytest.raises(ValueError, match="matches no configuration; available: ddp, ddp-bf16"):
        filter_configs(configs, "gemini")


def test_resolve_devices() -> None:
    assert command.resolve_devices(None, True, None, 0) == 2
    assert command.resolve_devices(None, True, 3, 0) == 3
    assert command.resolve_devices(2, False, None, 8) == 2
    with pytest.raises(click.UsageError, match="needs 4 CUDA devices but this machine has 1; "
                       "run on CPU processes instead with --cpu --nproc 4"):  # fmt: skip
        command.resolve_devices(4, False, None, 1)
    with pytest.raises(click.UsageError, match="add --cpu"):
        command.resolve_devices(None, False, 2, 0)
    with pytest.raises(click.UsageError, match="cannot be used together"):
        command.resolve_devices(2, True, None, 8)
    with pytest.raises(click.UsageError, match="choose the devices"):
        command.resolve_devices(None, False, None, 8)


def test_gpus_on_cpu_machine_suggests_cpu(monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    res = CliRunner().invoke(cli, ["benchmark", "--gpus", "2"])
    assert res.exit_code == 2
    assert "--gpus 2 needs 2 CUDA devices but this machine has 0" in res.output
    assert "--cpu --nproc 2" in res.output


def test_missing_meta_package_message(monkeypatch) -> None:
    def missing() -> list[str]:
        raise ModuleNotFoundError("No module named 'colossal.booster'", name="colossal.booster")

    monkeypatch.setattr(command, "installed_plugins", missing)
    res = CliRunner().invoke(cli, ["benchmark", "--cpu", "--nproc", "2"])
    assert res.exit_code == 1
    assert "pip install colossal" in res.output


def test_list_with_fake_plugins(monkeypatch) -> None:
    monkeypatch.setattr(command, "installed_plugins", lambda: ["LowLevelZeroPlugin"])
    res = CliRunner().invoke(cli, ["benchmark", "--cpu", "--list", "--filter", "zero2"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "zero2: LowLevelZeroPlugin({'stage': 2, 'precision': 'fp32'})"


def _ok_row(cfg: BenchConfig) -> dict:
    return {**cfg.to_dict(), "status": "ok", "error": None, "step_time_s": 0.0125,
            "tokens_per_s": 40960.0, "peak_model_state_bytes": 3 * 2**20,
            "comm_bytes_per_step": None}  # fmt: skip


def test_run_all_continues_after_failures_and_reports(tmp_path) -> None:
    configs = enumerate_configs(2, NOW)

    def fake(cfg: BenchConfig, settings: BenchSettings) -> dict:
        if cfg.name == "fsdp":
            raise RuntimeError("boom")
        if cfg.name == "zero1":
            return failure_row(cfg, "oom", "rank 1: OutOfMemoryError: CUDA out of memory")
        return _ok_row(cfg)

    seen = []
    rows = run_all(configs, BenchSettings(2, True), on_done=lambda c, r: seen.append(c.name),
                   run=fake)  # fmt: skip
    assert seen == ["ddp", "fsdp", "zero1", "zero2"]
    assert [r["status"] for r in rows] == ["ok", "failed", "oom", "ok"]
    assert table_cells(rows[0]) == ["ddp", "12.5 ms", "40,960", "3.0 MiB", "not tracked", "ok"]
    assert table_cells(rows[1]) == ["fsdp", "-", "-", "-", "-", "failed: RuntimeError: boom"]
    assert table_cells(rows[2])[-1] == "oom: rank 1: OutOfMemoryError: CUDA out of memory"
    console = Console(record=True, width=200)
    console.print(build_table(rows))
    text = console.export_text()
    assert all(name in text for name in ("ddp", "fsdp", "zero1", "zero2"))
    doc = json.loads(json.dumps(json_document(rows, {"devices": 2})))
    assert doc["benchmark"] == "colossal benchmark" and len(doc["rows"]) == 4
    assert doc["rows"][1]["error"] == "RuntimeError: boom"


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (None, 0, 1023, 1536, 3 * 2**20, 5 * 2**40)] == [
        "-", "0 B", "1023 B", "1.5 KiB", "3.0 MiB", "5.0 TiB"]  # fmt: skip


def _assert_png(path, size: tuple[int, int]) -> None:
    """A complete PNG of ``size`` (width, height) pixels with some content."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == size
    assert len(data) > 10_000, len(data)  # two bar charts with titles and labels, not a blank


def test_chart(tmp_path, monkeypatch) -> None:
    rows = [_ok_row(c) for c in enumerate_configs(2, NOW)]
    path = write_chart(tmp_path / "c.png", rows)  # matplotlib is in the test extra
    assert path == tmp_path / "c.png"
    _assert_png(path, (960, 400))  # 4 configurations: figsize 9.6x4 inches at 100 dpi
    failed = [failure_row(enumerate_configs(1, NOW)[0], "failed", "x")]
    assert write_chart(tmp_path / "d.png", failed) == "no chart: no configuration succeeded"
    assert not (tmp_path / "d.png").exists()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert "pip install 'colossal-cli[plot]'" in str(write_chart(tmp_path / "e.png", rows))


def test_benchmark_output_writes_json_and_png(tmp_path, monkeypatch) -> None:
    """``benchmark --output`` through the CLI, with the runs faked (no meta-package needed)."""
    monkeypatch.setattr(command, "installed_plugins", lambda: list(NOW))
    seen: list[tuple[str, BenchSettings]] = []

    def fake_run_all(configs, settings, on_done=None):
        rows = []
        for i, cfg in enumerate(configs):
            seen.append((cfg.name, settings))
            rows.append({**_ok_row(cfg), "tokens_per_s": 1000.0 * (i + 1)})
            if on_done is not None:
                on_done(cfg, rows[-1])
        return rows

    monkeypatch.setattr(command, "run_all", fake_run_all)
    out = tmp_path / "res" / "bench.json"
    res = CliRunner().invoke(cli, [
        "benchmark", "--cpu", "--nproc", "2", "--filter", "ddp,zero*", "--steps", "2",
        "--model-size", "small", "--seq-len", "16", "--batch-size", "3", "--output", str(out),
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert [name for name, _ in seen] == ["ddp", "zero1", "zero2"]
    assert seen[0][1] == BenchSettings(2, True, steps=2, model_size="small", seq_len=16,
                                       batch_size=3)  # fmt: skip
    doc = json.loads(out.read_text())
    assert [r["name"] for r in doc["rows"]] == ["ddp", "zero1", "zero2"]
    assert doc["settings"] == {"devices": 2, "cpu": True, "steps": 2, "warmup": 1,
                               "model_size": "small", "seq_len": 16, "batch_size": 3,
                               "timeout": 600.0}  # fmt: skip
    png = out.with_suffix(".png")
    assert f"wrote {out} and {png}" in " ".join(res.output.split())
    _assert_png(png, (800, 400))


def test_worker_command_exact() -> None:
    cfg = enumerate_configs(2, ["LowLevelZeroPlugin"])[0]
    cmd = worker_command(cfg, BenchSettings(2, True, steps=3, seq_len=32), "/o.json", 1234)
    assert cmd[1:] == [
        "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1", "--node_rank=0",
        "--master_addr=127.0.0.1", "--master_port=1234", "-m", "colossal.cli.bench.worker",
        "--config", json.dumps(cfg.to_dict()), "--out", "/o.json", "--steps", "3", "--warmup",
        "1", "--model-size", "tiny", "--seq-len", "32", "--batch-size", "4",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        BenchSettings(2, True, steps=0)


def test_gpt_sizes() -> None:
    for name in ("tiny", "small"):
        cfg = gpt_config(name, 32)
        assert sum(p.numel() for p in GPT(cfg).parameters()) == cfg.num_params()
    assert set(MODEL_SIZES) == {"tiny", "small", "medium", "gpt2"}
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        gpt_config("huge", 32)


_TORCHRUN_ABORT = """\
all good on rank 0
terminate called without an active exception
E1122 21:36:31 api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 3872)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
worker FAILED
------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3871)  (SIGTERM)
  error_file: <N/A>
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_21:36:31
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 3872)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 3872
======================================================
"""

_TORCHRUN_EXCEPTION = """\
Traceback (most recent call last):
  File "worker.py", line 3, in <module>
ValueError: batch size 3 does not divide 4
[rank1]: ValueError: batch size 3 does not divide 4
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 12)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (_TORCHRUN_ABORT, "rank 1 killed by SIGABRT: terminate called without an active exception"),
        (_TORCHRUN_EXCEPTION, "rank 1 exit code 1: ValueError: batch size 3 does not divide 4"),
        ("KeyError: 'x'\n", "KeyError: 'x'"),
        ("", "no output"),
    ],
)
def test_failure_reason_names_rank_signal_and_error(text: str, expected: str) -> None:
    assert reason_from_output(text) == expected
