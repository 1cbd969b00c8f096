from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest

import colossal.cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli_env() -> dict[str, str]:
    """Environment for `python -m colossal.cli.main` subprocesses: same imports as this test."""
    paths = [str(Path(p).resolve()) for p in sys.path if p and os.path.isdir(p)]
    here = {str(Path(p).resolve().parents[1]) for p in colossal.cli.__path__}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*sorted(here), *paths])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def colossal_cmd() -> list[str]:
    return [sys.executable, "-m", "colossal.cli.main"]


def default_sigint() -> None:
    """``preexec_fn`` restoring SIGINT's default action in a child process.

    A test run started in the background of a non-interactive shell (``nohup cmd &``) ignores
    SIGINT, and children inherit that; a child that must stop on SIGINT needs it back.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def port_is_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (as a restarted torchrun would)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True
