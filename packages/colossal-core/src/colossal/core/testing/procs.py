"""Run a command whose process tree cannot outlive the test that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["LeftoverProcessError", "run_isolated"]


class LeftoverProcessError(RuntimeError):
    """The command exited but left processes of its session running (they were killed)."""


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal still exists
        return True
    return True


def _kill_session(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_isolated(
    cmd: Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in a session of its own and make sure none of its processes survive.

    ``torchrun`` and the forking test drivers start grandchildren; ``subprocess.run(...,
    timeout=...)`` kills only the direct child, so a hung rank would outlive the test. Here the
    whole session is killed when the timeout expires, and a command that exits while leaving
    members of its session running is an error (they are killed too).

    Args:
        cmd: The command and its arguments.
        timeout: Seconds after which the command counts as hung; it only stops a hang.
        env: The environment (the current one when ``None``).
        cwd: The working directory.

    Returns:
        The finished process with its captured ``stdout`` and ``stderr`` (text).

    Raises:
        subprocess.TimeoutExpired: The command did not finish in time (its output attached).
        LeftoverProcessError: The command finished but processes of its session remained.
    """
    # Output goes to files, not pipes: a leftover grandchild holding a pipe open would make
    # reading it wait for the timeout instead of reporting the leftover at once.
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out_file,
            stderr=err_file,
            text=True,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except BaseException as exc:
            _kill_session(proc.pid)
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                out, err = _read(out_file), _read(err_file)
                raise subprocess.TimeoutExpired(
                    list(cmd), timeout, output=out, stderr=err
                ) from None
            raise
        leftover = _session_alive(proc.pid)
        if leftover:
            _kill_session(proc.pid)
        out, err = _read(out_file), _read(err_file)
    if leftover:
        raise LeftoverProcessError(
            f"{cmd[0]} exited with {proc.returncode} but left processes of its session running "
            f"(killed now); its output:\n{out}\n{err}"
        )
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _read(handle: Any) -> str:
    handle.flush()
    handle.seek(0)
    return handle.read()
