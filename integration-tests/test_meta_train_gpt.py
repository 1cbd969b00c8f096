"""examples/train_gpt.py end to end: plugins agree, and a resume under another plugin matches."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from colossal.core.testing import free_port

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--iters", "40", "--eval-interval", "20", "--eval-iters", "4", "--no-progress"]


def _torchrun(*args: str, timeout: float = 300) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", os.path.join(ROOT, "examples", "train_gpt.py"), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, f"train_gpt.py failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _final(out: str) -> float:
    found = re.findall(r"final val loss (\d+\.\d+)", out)
    assert found, out
    return float(found[-1])


def test_train_gpt_resume_across_plugins(tmp_path) -> None:
    straight = _final(_torchrun("--plugin", "ddp", "--out", str(tmp_path / "a"), *SHORT))
    first = _torchrun(
        "--plugin", "zero2", "--out", str(tmp_path / "b"), "--save-interval", "20",
        "--stop-after", "20", "--async-save", *SHORT,
    )  # fmt: skip
    assert "stopping after iteration 20" in first
    resumed = _final(
        _torchrun("--plugin", "fsdp", "--out", str(tmp_path / "b"), "--resume", *SHORT)
    )
    assert resumed == pytest.approx(straight, abs=2e-3)
    assert straight < 3.5  # it learned (starts at ~4.2 = ln(vocab))
