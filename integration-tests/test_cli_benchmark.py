"""`colossal benchmark --cpu --nproc 2` and `colossal check -i` with every package installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from colossal.cli.bench.gpt import GPT, gpt_config
from colossal.cli.bench.report import COLUMNS
from colossal.core.testing import run_isolated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = (
    "ddp", "fsdp", "zero1", "zero2", "gemini-static", "gemini-auto",
    "hybrid-tp1-pp2-dp1", "hybrid-tp2-pp1-dp1",
)
#: The table's header, spelled out so that a renamed column fails here.
HEADER = ["configuration", "step time", "tokens/s", "model state / rank", "comm / step", "status"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _colossal(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    script = shutil.which("colossal")
    cmd = [script] if script else [sys.executable, "-m", "colossal.cli.main"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    # Its own session: a timeout kills the benchmark's ranks too, never leaving one behind.
    return run_isolated([*cmd, *args], timeout=timeout, env=env, cwd=ROOT)


def test_benchmark_cpu_two_ranks_end_to_end(tmp_path) -> None:
    out = tmp_path / "bench" / "result.json"
    done = _colossal("benchmark", "--cpu", "--nproc", "2", "--steps", "3", "--output", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    header = [ln for ln in done.stdout.splitlines() if ln.startswith("┃")]
    assert len(header) == 1, done.stdout
    assert [cell.strip() for cell in header[0].split("┃")[1:-1]] == HEADER == list(COLUMNS)
    table_lines = [ln for ln in done.stdout.splitlines() if ln.startswith("│")]
    assert [ln.split("│")[1].strip() for ln in table_lines] == list(CONFIGS), done.stdout
    assert all(ln.rstrip().endswith("ok     │") or "│ ok" in ln for ln in table_lines)

    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "colossal benchmark"
    assert doc["settings"]["devices"] == 2 and doc["settings"]["steps"] == 3
    rows = {r["name"]: r for r in doc["rows"]}
    assert list(rows) == list(CONFIGS)
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert row["world_size"] == 2
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
        assert row["peak_model_state_bytes"] > 0
        assert row["comm_bytes_per_step"] > 0, name  # every row is tracked on CPU
    param_bytes = rows["ddp"]["model_params"] * 4
    assert rows["ddp"]["comm_bytes_per_step"] == param_bytes
    assert rows["zero2"]["peak_model_state_bytes"] < rows["zero1"]["peak_model_state_bytes"]
    assert rows["zero1"]["peak_model_state_bytes"] < rows["ddp"]["peak_model_state_bytes"]
    # The integration session installs every package's test extra, matplotlib included.
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and png[12:16] == b"IHDR" and png[-8:-4] == b"IEND"
    assert len(png) > 10_000, len(png)


def test_benchmark_sizes_reach_the_workers(tmp_path) -> None:
    """Non-default --model-size/--seq-len/--batch-size end to end (one configuration)."""
    out = tmp_path / "sizes.json"
    done = _colossal("benchmark", "--cpu", "--nproc", "2", "--filter", "ddp", "--steps", "2",
                     "--model-size", "small", "--seq-len", "16", "--batch-size", "3",
                     "--output", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GPT small, seq 16, batch 3/rank, 2 CPU processes" in done.stdout
    doc = json.loads(out.read_text())
    settings = doc["settings"]
    assert (settings["model_size"], settings["seq_len"], settings["batch_size"]) == ("small", 16, 3)
    assert settings["steps"] == 2 and settings["devices"] == 2
    [row] = doc["rows"]
    assert row["name"] == "ddp" and row["status"] == "ok", row
    # The workers built the "small" GPT with 16 positions (not the tiny default's sizes).
    params = sum(p.numel() for p in GPT(gpt_config("small", 16)).parameters())
    assert row["model_params"] == params
    assert row["comm_bytes_per_step"] == params * 4  # DDP all-reduces every fp32 gradient
    # tokens/s counts 3 samples x 16 tokens on each of the 2 ranks per step.
    assert row["tokens_per_s"] == pytest.approx(2 * 3 * 16 / row["step_time_s"], rel=1e-6)


def test_benchmark_filter_and_list() -> None:
    done = _colossal("benchmark", "--cpu", "--list", "--filter", "zero*", "--precision", "bf16")
    assert done.returncode == 0, done.stderr
    assert [ln.split(":")[0] for ln in done.stdout.splitlines()] == ["zero1-bf16", "zero2-bf16"]


def test_check_installation_all_packages() -> None:
    done = _colossal("check", "-i")
    assert done.returncode == 0, done.stdout + done.stderr
    for dist in ("colossal", "colossal-cli", "colossal-core", "colossal-kernels", "colossal-zero"):
        assert f"│ {dist} " in done.stdout, dist
    assert "Declared version ranges" in done.stdout and "│ NO" not in done.stdout
    assert "| cpu_adam | cpu |" in done.stdout
    assert "Installation OK" in done.stdout
