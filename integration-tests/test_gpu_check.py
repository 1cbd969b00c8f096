"""The GPU check's pieces, where a machine without a GPU can run them.

``tools/gpu_check.sh`` needs CUDA; here it must refuse in one line. Its measurement script
runs on CPU at toy sizes (``--device cpu --tiny``), and its report is rendered from that
script's real output plus recorded step outcomes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_in_one_line_without_cuda(tmp_path: Path) -> None:
    """Catches: a check that runs on CPU and reports CPU numbers as a GPU's."""
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120, env=_env())
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], proc.stdout
    assert not (tmp_path / "o").exists()


def _measure(tmp_path: Path, *sections: str) -> list[dict]:
    out = tmp_path / "gpu_check.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                    "--tiny", "--no-compile", "--sections", *sections, "--json", str(out)],
                   check=True, capture_output=True, text=True, timeout=300, env=_env())
    return json.loads(out.read_text())["rows"]


def test_measurements_compare_like_with_like(tmp_path: Path) -> None:
    """Each row's ours and peer compute the same thing, and its ratio is ours / peer.

    Catches: a kernel timed against a different operation (a norm without its weight, attention
    without the causal mask, Adam without weight decay, a float8 linear reading its weight in
    the wrong layout: differences of order 1e-1 and more), a Booster step whose model or batch
    differs from the plain loop's (another loss), and a ratio taken the wrong way round.
    """
    rows = _measure(tmp_path, "adam", "norms", "attention", "fp8", "llama")
    assert [r["section"] for r in rows] == ["adam", "rms_norm", "layer_norm", "attention",
                                            "fp8_linear", "llama_step"]
    for r in rows:  # float8 rounds each operand to 2^-4: a few percent; the rest agree exactly
        assert r["diff"] < (0.1 if r["section"] == "fp8_linear" else 1e-4), r
        assert r["ratio"] == pytest.approx(r["ours_ms"] / r["peer_ms"]), r
        assert r["ours_ms"] > 0 and r["peer_ms"] > 0, r
    (tmp_path / "steps.tsv").write_text("gpu_check_bench\t0\t12\npytest_kernels\t1\t30\n"
                                        "kernels_bench\t124\t60\n")
    (tmp_path / "pytest_kernels.log").write_text("...\n1 failed, 1 passed in 3.0s\n")
    (tmp_path / "pytest_kernels.xml").write_text(
        '<testsuite><testcase name="a"/><testcase name="b"><failure/></testcase></testsuite>')
    (tmp_path / "kernels_bench.log").write_text("step 1\n")
    report = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_report.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert report.returncode == 1, report.stdout + report.stderr
    table = {ln.split(" | ")[0].lstrip("| "): ln for ln in report.stdout.splitlines()
             if ln.startswith("| ") and not ln.startswith("| step")}
    assert list(table) == ["gpu_check_bench", "pytest_kernels", "kernels_bench"]
    assert "| ok | 12 |" in table["gpu_check_bench"]
    assert f"= {rows[0]['ratio']:.3f}" in table["gpu_check_bench"]
    assert table["gpu_check_bench"].count(" = ") == len(rows)
    assert "| failed (1) | 30 |" in table["pytest_kernels"]
    assert "1 passed, 1 failed, 0 skipped" in table["pytest_kernels"]
    assert "log: 1 failed, 1 passed in 3.0s" in table["pytest_kernels"]
    assert "| timed out | 60 |" in table["kernels_bench"]
