"""Starting the launch commands: one local torchrun, or one ssh session per node.

Each node's output is streamed line by line with a ``[host]`` prefix. When a node exits with a
non-zero code, or the user presses Ctrl-C, every other node is stopped (closing an ssh session
started with ``-tt`` sends SIGHUP to the remote torchrun, which stops its workers) and the
launcher returns a non-zero code.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

__all__ = ["run_local", "run_nodes"]

logger = logging.getLogger(__name__)

#: Seconds a node gets to exit after SIGTERM before it is killed.
STOP_GRACE = 10.0


def _stop(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_local(argv: list[str]) -> int:
    """Run one command in the foreground, sharing the terminal; Ctrl-C stops it.

    Returns:
        The command's exit code (130 after Ctrl-C, 128+N after signal N).
    """
    logger.info("running: %s", " ".join(argv))
    proc = subprocess.Popen(argv)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # The child got the SIGINT from the terminal too; give torchrun time to stop workers.
        _stop(proc)
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
    commands: list[tuple[str, list[str]]], out: TextIO | None = None, poll: float = 0.1
) -> int:
    """Start every node's command, stream output with host prefixes, stop all on a failure.

    Args:
        commands: ``(hostname, argv)`` per node.
        out: Where prefixed output goes (stdout by default).
        poll: Seconds between checks of the nodes' state.

    Returns:
        0 when every node succeeded; otherwise the first failing node's code (1 when it was
        killed by a signal), or 130 after Ctrl-C.
    """
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    procs: list[tuple[str, subprocess.Popen[str]]] = []
    pumps: list[threading.Thread] = []
    failed: tuple[str, int] | None = None
    try:
        for host, argv in commands:
            logger.info("node %s: %s", host, " ".join(argv))
            proc = subprocess.Popen(
                argv,
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
        _stop_all(procs, signal.SIGINT)
        return 130
    finally:
        if failed is not None:
            with lock:
                hint = " (ssh could not connect or log in?)" if failed[1] == 255 else ""
                out.write(
                    f"node {failed[0]} exited with code {failed[1]}{hint}: stopping every node\n"
                )
        _stop_all(procs)
        for thread in pumps:
            thread.join(timeout=5)
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 1


def _stop_all(procs: list[tuple[str, subprocess.Popen[str]]], first: int | None = None) -> None:
    if first is not None:
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(first)
    for _, proc in procs:
        _stop(proc)  # type: ignore[arg-type]
