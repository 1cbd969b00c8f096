"""End-to-end runs of the examples under torchrun, with every package installed."""

from __future__ import annotations

import os
import re
import sys

import pytest

from colossal.core.testing import free_port, run_isolated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}", os.path.join(ROOT, script), *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = run_isolated(cmd, timeout=timeout, env=env, cwd=ROOT)  # kills every rank on timeout
    assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("nproc", [2, 4])
def test_core_demo(nproc: int) -> None:
    out = _torchrun("examples/core_demo.py", nproc, "--numel", "1000")
    expected = sum(range(nproc))
    assert f"every element is {expected} (expected {expected}) on {nproc}/{nproc} ranks" in out
    assert "| all_reduce | [0, 1] | 1 | 4000 |" in out


def test_zero_example_matches_ddp() -> None:
    ddp = _torchrun("examples/zero_in_ddp_script/train_ddp.py", 2, "--steps", "60")
    zero = _torchrun("examples/zero_in_ddp_script/train_zero.py", 2, "--steps", "60")
    losses = [re.findall(r"loss (\d+\.\d+)", out) for out in (ddp, zero)]
    assert losses[0] and losses[0] == losses[1], f"DDP {losses[0]} vs ZeRO {losses[1]}"
    assert float(losses[0][-1]) < float(losses[0][0]), "the example did not learn"
