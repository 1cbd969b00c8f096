"""`colossal benchmark --cpu --nproc 2` and `colossal check -i` with every package installed."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ("ddp", "fsdp", "zero1", "zero2")


def _colossal(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    script = shutil.which("colossal")
    cmd = [script] if script else [sys.executable, "-m", "colossal.cli.main"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)  # fmt: skip


def test_benchmark_cpu_two_ranks_end_to_end(tmp_path) -> None:
    out = tmp_path / "bench" / "result.json"
    done = _colossal("benchmark", "--cpu", "--nproc", "2", "--steps", "3", "--output", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
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
    png = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:4] == b"\x89PNG"
    else:
        assert "pip install 'colossal-cli[plot]'" in done.stdout


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
