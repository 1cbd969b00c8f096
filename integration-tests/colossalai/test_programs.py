"""ColossalAI-style programs (``programs/``) run unchanged through ``import colossalai``.

Each program under ``programs/`` is written the way ColossalAI's public tests and examples
use its API (read the docstring of each): the unit-test-like ones start their two ranks with
``colossalai.testing.spawn`` and ``colossalai.launch(rank=..., world_size=..., host=...,
port=..., backend="gloo")``; ``train_models.py`` runs under torchrun with
``colossalai.launch_from_torch()``. Every program checks its own results (against a
single-process reference, an exact round trip, or a loss that must fall) and ends by printing
``<name>: OK``; here each runs on 2 CPU processes with one thread each, and must exit 0 with
that line. The ``colossalai`` package is colossalai-compat, served by Colossal's packages.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from colossal.core.testing import free_port

pytest.importorskip("colossalai")
pytest.importorskip("transformers")

PROGRAMS = Path(__file__).resolve().parent / "programs"
#: Program -> how it starts its 2 ranks: "spawn" (itself) or "torchrun".
LAUNCH = {
    "booster_plugins": "spawn",
    "checkpoint_io": "spawn",
    "cluster": "spawn",
    "shardformer_layers": "spawn",
    "zero_optimizer": "spawn",
    "lazy_init": "spawn",
    "train_models": "torchrun",
}


GRACE_S = 10.0


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(
    cmd: Sequence[str], timeout: float, env: dict[str, str], cwd: Path
) -> tuple[int, str, str]:
    """Run ``cmd`` in its own session; kill the session on timeout or if it outlives it.

    Like ``colossal.core.testing.run_isolated``, with a grace period: the multiprocessing
    fork server and resource tracker that ``colossalai.testing.spawn`` starts exit on their
    own just after the program (when they see its pipes close), so the session is given
    ``GRACE_S`` seconds to empty before anything left counts as a leftover.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, text=True, env=env, cwd=cwd,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            deadline = time.monotonic() + GRACE_S
            while _session_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            leftover = _session_alive(proc.pid)
            if leftover:
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert not leftover, f"processes outlived the program by {GRACE_S} s:\n{stdout}\n{stderr}"
    return proc.returncode, stdout, stderr


def test_every_program_is_listed() -> None:
    """Catches: a program added under programs/ that this suite never runs."""
    assert sorted(p.stem for p in PROGRAMS.glob("*.py")) == sorted(LAUNCH)


@pytest.mark.parametrize("name", sorted(LAUNCH))
def test_program_passes_as_written(name: str, tmp_path: Path) -> None:
    """Catches: any ColossalAI name, argument or behaviour a program uses that Colossal lacks
    or gets wrong (each program asserts its own results; see its docstring)."""
    script = str(PROGRAMS / f"{name}.py")
    if LAUNCH[name] == "torchrun":
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--master_port={free_port()}", script,
        ]  # fmt: skip
    else:
        cmd = [sys.executable, script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    returncode, stdout, stderr = _run(cmd, timeout=420, env=env, cwd=tmp_path)
    out = stdout + stderr
    assert returncode == 0, f"{name} failed:\n{out[-6000:]}"
    assert f"{name}: OK" in stdout, out[-6000:]
