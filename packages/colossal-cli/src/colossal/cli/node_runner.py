"""Starting the launch commands: one local torchrun, or one ssh session per node.

Each node's output is streamed line by line with a ``[host]`` prefix. When a node exits with a
non-zero code, or the user presses Ctrl-C, every other node is stopped (closing an ssh session
started with ``-tt`` hangs up the remote watchdog, which stops torchrun and its ranks) and the
launcher returns a non-zero code.

Every command runs under :mod:`colossal.cli.watchdog`, which holds the read end of a pipe whose
write end only this process holds: when the launcher dies, however it dies (SIGKILL included),
each watchdog stops its command's whole process tree (torchrun and its ranks, or the ssh session
and through it the remote ones).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from colossal.cli.launch_command import STOP_GRACE

__all__ = ["run_local", "run_nodes", "watched"]

logger = logging.getLogger(__name__)

#: Extra seconds the launcher waits for a watchdog that is stopping its tree.
_WATCHDOG_SLACK = 5.0


@contextmanager
def _launcher_pipe() -> Iterator[int]:
    """A pipe whose write end only this process holds; yields the read end for watchdogs.

    Both ends are closed on exit; the kernel closes the write end if this process dies.
    """
    read_end, write_end = os.pipe()  # not inheritable: only pass_fds hands the read end on
    try:
        yield read_end
    finally:
        os.close(read_end)
        os.close(write_end)


def watched(argv: list[str], fd: int, grace: float = STOP_GRACE) -> list[str]:
    """``argv`` run under :mod:`colossal.cli.watchdog`, watching the pipe ``fd``."""
    return [sys.executable, "-m", "colossal.cli.watchdog", "--fd", str(fd), "--grace",
            f"{grace:g}", "--", *argv]  # fmt: skip


def _stop(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    """SIGTERM a watchdog; it stops its tree within ``grace``; SIGKILL it if it hangs."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace + _WATCHDOG_SLACK)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_local(argv: list[str], grace: float = STOP_GRACE) -> int:
    """Run one command in the foreground, sharing the terminal; Ctrl-C stops it.

    The command runs under :mod:`colossal.cli.watchdog`, so its whole process tree (torchrun
    and the ranks it starts) is stopped if this process dies.

    Args:
        argv: The command (torchrun's).
        grace: Seconds its processes get between SIGTERM and SIGKILL when it is stopped.

    Returns:
        The command's exit code (130 after Ctrl-C, 128+N after signal N).
    """
    logger.info("running: %s", " ".join(argv))
    with _launcher_pipe() as fd:
        proc = subprocess.Popen(watched(argv, fd, grace), pass_fds=(fd,))
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # The watchdog and torchrun got the SIGINT from the terminal too, or only this
            # process did: either way the watchdog stops the tree within `grace`.
            _stop(proc, grace)
            return 130
    return 128 - code if code < 0 else code


def _pump(host: str, stream: TextIO | None, out: TextIO, lock: threading.Lock) -> None:
    if stream is None:
        return
    for line in stream:
        line = line.rstrip("\r\n").replace("\r", "")
        with lock:
            out.write(f"[{host}] {line}\n")
            out.flush()


def run_nodes(
    commands: list[tuple[str, list[str]]],
    out: TextIO | None = None,
    poll: float = 0.1,
    grace: float = STOP_GRACE,
) -> int:
    """Start every node's command, stream output with host prefixes, stop all on a failure.

    Each command runs under :mod:`colossal.cli.watchdog`, which stops it (and so closes its
    ssh session) if this process dies.

    Args:
        commands: ``(hostname, argv)`` per node.
        out: Where prefixed output goes (stdout by default).
        poll: Seconds between checks of the nodes' state.
        grace: Seconds a node's processes get between SIGTERM and SIGKILL when stopped.

    Returns:
        0 when every node succeeded; otherwise the first failing node's code (1 when it was
        killed by a signal), or 130 after Ctrl-C.
    """
    with _launcher_pipe() as fd:
        return _run_nodes(commands, sys.stdout if out is None else out, poll, grace, fd)


def _run_nodes(
    commands: list[tuple[str, list[str]]], out: TextIO, poll: float, grace: float, fd: int
) -> int:
    lock = threading.Lock()
    procs: list[tuple[str, subprocess.Popen[str]]] = []
    pumps: list[threading.Thread] = []
    failed: tuple[str, int] | None = None
    try:
        for host, argv in commands:
            logger.info("node %s: %s", host, " ".join(argv))
            proc = subprocess.Popen(
                watched(argv, fd, grace),
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,  # Ctrl-C reaches only us; we stop the nodes ourselves
            )
            procs.append((host, proc))
            thread = threading.Thread(target=_pump, args=(host, proc.stdout, out, lock))
            thread.daemon = True
            thread.start()
            pumps.append(thread)
        while failed is None:
            codes = [(h, p.poll()) for h, p in procs]  # poll every node, no short-circuit
            failed = next(((h, c) for h, c in codes if c not in (None, 0)), None)
            if all(c is not None for _, c in codes):
                break
            time.sleep(poll)
        if failed is None:
            failed = next(((h, p.returncode) for h, p in procs if p.returncode != 0), None)
    except KeyboardInterrupt:
        with lock:
            out.write("interrupted: stopping every node\n")
        _stop_all(procs, grace, signal.SIGINT)
        return 130
    finally:
        if failed is not None:
            with lock:
                hint = " (ssh could not connect or log in?)" if failed[1] == 255 else ""
                out.write(
                    f"node {failed[0]} exited with code {failed[1]}{hint}: stopping every node\n"
                )
        _stop_all(procs, grace)
        for thread in pumps:
            thread.join(timeout=5)
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 1


def _stop_all(
    procs: list[tuple[str, subprocess.Popen[str]]], grace: float, first: int | None = None
) -> None:
    if first is not None:
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(first)
    for _, proc in procs:
        _stop(proc, grace)  # type: ignore[arg-type]
