"""Run a script as the ranks of a job, each in a fresh interpreter with no group launched.

ColossalAI's scripts call ``colossalai.launch(...)`` themselves, so the harness must not
create the default group first (``colossal.core.testing.spawn`` does). Every rank runs
``python script.py`` with torchrun's environment variables; all ranks are killed as soon
as one fails or the timeout passes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from colossal.core.testing import free_port


@dataclass(frozen=True)
class RankResult:
    """What one rank printed and how it ended."""

    rank: int
    returncode: int
    output: str


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def run_ranks(
    script: Path, world_size: int, args: list[str] | None = None, timeout: float = 180.0
) -> list[RankResult]:
    """Run ``script`` on ``world_size`` ranks in its directory; returns each rank's result.

    Each rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (a free port), one thread, and ``args`` after the script path.

    Raises:
        AssertionError: A rank failed or the job ran past ``timeout`` (outputs attached).
    """
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    logs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            COLOSSAL_ACCELERATOR="cpu",
        )
        log = (script.parent / f"rank{rank}.log").open("w+")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), *(args or [])],
                cwd=script.parent,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    failed = False
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                failed = True
                break
            time.sleep(0.1)
    finally:
        _kill(procs)
    results = []
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        log.seek(0)
        results.append(RankResult(rank, proc.returncode, log.read()))
        log.close()
    if failed or any(r.returncode != 0 for r in results):
        report = "\n".join(f"--- rank {r.rank} (exit {r.returncode})\n{r.output}" for r in results)
        raise AssertionError(f"{script.name} failed or timed out after {timeout}s:\n{report}")
    return results
