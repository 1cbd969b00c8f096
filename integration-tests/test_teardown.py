"""Every plugin's 2-rank train_gpt.py run exits, 20 times in a row (no teardown deadlock).

Issue 12: one rank of ``train_gpt.py --plugin ddp`` printed its final loss and never exited,
because freeing the DDP model after ``destroy_process_group()`` raced a gloo worker thread for
the GIL (see colossal.core.group_lifetime). The race is rare per run, so each plugin runs 20
times; teardown_driver.py forks the ranks from one preloaded process so that the 80 runs
cost seconds each, and every rank still leaves through the normal interpreter exit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colossal.core.testing import run_isolated

pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = int(os.environ.get("COLOSSAL_TEARDOWN_RUNS", "20"))
ARGS = ["--iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--no-progress",
        "--block", "16", "--n-layer", "1", "--n-embd", "32", "--n-head", "2"]  # fmt: skip


@pytest.mark.parametrize("plugin", ["ddp", "fsdp", "zero1", "zero2"])
def test_two_rank_example_always_exits(plugin: str, tmp_path) -> None:
    cmd = [
        sys.executable, os.path.join(HERE, "teardown_driver.py"), "--runs", str(RUNS),
        "--timeout", "90", os.path.join(ROOT, "examples", "train_gpt.py"),
        "--plugin", plugin, "--out", str(tmp_path), *ARGS,
    ]  # fmt: skip
    try:
        # The driver stops a hung run itself; this timeout only stops a hung driver.
        done = run_isolated(cmd, timeout=90 * (RUNS + 2), cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the teardown driver itself hung:\n{exc.output}\n{exc.stderr}")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert f"all {RUNS} runs of 2 ranks exited cleanly" in done.stdout, done.stdout
