"""examples/train_gpt.py end to end: plugins agree, and a resume under another plugin matches."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys

import pytest

from colossal.core.testing import free_port, run_isolated

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--iters", "40", "--eval-interval", "20", "--eval-iters", "4", "--no-progress"]


def _torchrun(*args: str, timeout: float = 300) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={free_port()}", os.path.join(ROOT, "examples", "train_gpt.py"), *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_isolated(cmd, timeout=timeout, env=env, cwd=ROOT)  # kills every rank on timeout
    assert done.returncode == 0, f"train_gpt.py failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _final(out: str) -> float:
    found = re.findall(r"final val loss (\d+\.\d+)", out)
    assert found, out
    return float(found[-1])


def test_train_gpt_resume_across_plugins(tmp_path) -> None:
    metrics = tmp_path / "metrics.json"
    straight = _final(_torchrun("--plugin", "ddp", "--out", str(tmp_path / "a"),
                                "--metrics-json", str(metrics), *SHORT))
    written = json.loads(metrics.read_text())  # what benchmarks/main_job.py reads
    assert len(written["iter_ms"]) == 40 and min(written["iter_ms"]) > 0
    assert written["final_val"] == pytest.approx(straight, abs=1e-4) and written["world"] == 2
    first = _torchrun(
        "--plugin", "zero2", "--out", str(tmp_path / "b"), "--save-interval", "20",
        "--stop-after", "20", "--async-save", *SHORT,
    )  # fmt: skip
    assert "stopping after iteration 20" in first
    ckpt = tmp_path / "b" / "checkpoint"
    assert (ckpt / "latest").read_text() == "iter-0000020"
    assert (ckpt / "iter-0000020" / "train_state.json").is_file()
    resumed_out = _torchrun("--plugin", "fsdp", "--out", str(tmp_path / "b"), "--resume", *SHORT)
    resumed = _final(resumed_out)
    assert resumed == pytest.approx(straight, abs=2e-3)
    assert straight < 3.5  # it learned (starts at ~4.2 = ln(vocab))
    png = tmp_path / "b" / "loss.png"
    if importlib.util.find_spec("matplotlib") is not None:  # the examples extra draws it
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_without_checkpoint_is_a_clear_error(tmp_path) -> None:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), "--resume",
           "--out", str(tmp_path), *SHORT]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = run_isolated(cmd, timeout=120, env=env, cwd=ROOT)
    assert done.returncode != 0
    assert "no complete checkpoint" in done.stderr
