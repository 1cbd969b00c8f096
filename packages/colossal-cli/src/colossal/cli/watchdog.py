"""Run one command; stop its whole process tree when the launcher goes away.

``colossal run`` starts each torchrun (and, for a multi-node job, each ssh session and each
remote torchrun) as ``python -m colossal.cli.watchdog [--fd N] --grace S -- ARGV...``. The
watchdog starts ``ARGV`` and waits for it. It stops everything below it (the command, torchrun's
ranks, their own children) when:

- the launcher is gone: end of file on ``--fd`` (the read end of a pipe whose write end only the
  launcher holds; the kernel closes it however the launcher dies, SIGKILL included), or the
  watchdog's parent process changed (the launcher, or under ssh the sshd session, exited);
- the watchdog gets SIGTERM, SIGHUP (an ssh connection that drops hangs up the remote
  terminal) or SIGINT, unless it was started with that signal ignored (SIGHUP under
  ``nohup``, SIGINT in ``cmd &`` of a non-interactive shell): then it stays ignored;
- the command exits while processes it started still run (ranks whose torchrun was killed).

Stopping sends SIGTERM to every process of the tree, then SIGKILL to those still running after
``--grace`` seconds. On Linux the watchdog is a child subreaper (``PR_SET_CHILD_SUBREAPER``):
ranks whose torchrun died are re-parented to it rather than to init, so it still finds them.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

__all__ = ["descendants", "main", "stop_tree"]
#: Seconds between checks of the command, the launcher's pipe and the parent pid.
POLL = 0.2
_PR_SET_CHILD_SUBREAPER = 36


def _set_child_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _proc_table() -> dict[int, tuple[int, str]]:
    """``pid -> (ppid, state)`` of every process in ``/proc`` (empty where there is none)."""
    table: dict[int, tuple[int, str]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 2:
            table[int(name)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int, *, include_zombies: bool = False) -> list[int]:
    """Every process below ``pid`` (children first, then theirs), from ``/proc``.

    Args:
        pid: The root; not itself included.
        include_zombies: Also list processes that exited and wait to be reaped.

    Returns:
        The pids in breadth-first order; empty where ``/proc`` does not exist.
    """
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in table.items():
        children.setdefault(parent, []).append(child)
    out: list[int] = []
    queue = sorted(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        if include_zombies or table[child][1] != "Z":
            out.append(child)
        queue.extend(sorted(children.get(child, [])))
    return out


def _reap() -> dict[int, int]:
    """Collect every exited child without blocking: ``pid -> exit code`` (128+N for signal N)."""
    done: dict[int, int] = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        code = os.waitstatus_to_exitcode(status)
        done[pid] = 128 - code if code < 0 else code


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(grace: float, root: int | None = None) -> dict[int, int]:
    """SIGTERM every process below ``root``; SIGKILL those still running after ``grace`` s.

    Processes that appear below ``root`` during the grace period (e.g. workers an agent
    restarts) get SIGTERM too. Children of this process are reaped as they exit.

    Args:
        grace: Seconds between SIGTERM and SIGKILL.
        root: The tree's root (this process by default); not itself signalled.

    Returns:
        ``pid -> exit code`` of the children of this process reaped meanwhile.
    """
    root = os.getpid() if root is None else root
    reaped: dict[int, int] = {}
    termed: set[int] = set()
    deadline = time.monotonic() + grace
    while True:
        reaped.update(_reap())
        alive = descendants(root)
        if not alive:
            return reaped
        if time.monotonic() >= deadline:
            break
        new = [pid for pid in alive if pid not in termed]
        _signal(new, signal.SIGTERM)
        termed.update(new)
        time.sleep(0.05)
    kill_deadline = time.monotonic() + 10.0
    while alive and time.monotonic() < kill_deadline:
        _signal(alive, signal.SIGKILL)
        time.sleep(0.05)
        reaped.update(_reap())
        alive = descendants(root)
    return reaped


def _say(text: str) -> None:
    """Write to stderr, which may be a terminal that hung up: never let that raise."""
    try:
        sys.stderr.write(f"colossal run: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def _launcher_gone(fd: int | None, ppid: int) -> str | None:
    """Why the launcher is known to be gone, or None while it runs."""
    if os.getppid() != ppid:
        return f"the launcher (pid {ppid}) exited"
    if fd is None:
        return None
    try:
        ready, _, _ = select.select([fd], [], [], 0)
        if ready and not os.read(fd, 4096):
            return "the launcher exited (its pipe closed)"
    except OSError:
        return "the launcher's pipe failed"
    return None


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m colossal.cli.watchdog",
        description="Run ARGV; stop its process tree when the launcher goes away.",
    )
    parser.add_argument(
        "--fd",
        type=int,
        default=None,
        help="Read end of the launcher's pipe (end of file: launcher gone).",
    )
    parser.add_argument(
        "--grace",
        type=float,
        required=True,
        help="Seconds between SIGTERM and SIGKILL when stopping.",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ARGV...")
    args = parser.parse_args(list(argv))
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given: write python -m colossal.cli.watchdog [options] -- ARGV")
    if not args.grace > 0:
        parser.error(f"--grace must be > 0 seconds, got {args.grace}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the watchdog (see the module docstring).

    Args:
        argv: ``[--fd N] --grace S -- COMMAND...`` (``sys.argv[1:]`` by default).

    Returns:
        The command's exit code (128+N when signal N ended it), or 128+N after the watchdog
        stopped the tree on signal N (129 when the launcher went away).
    """
    args = _parse(sys.argv[1:] if argv is None else argv)
    ppid = os.getppid()
    requested: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        # Started with it ignored (SIGHUP under nohup, SIGINT in `cmd &` of a script): the
        # caller asked this job to outlive that signal; keep it ignored.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, on_signal)
    _set_child_subreaper()
    try:
        child = subprocess.Popen(args.command)  # close_fds: the launcher's pipe stays here
    except OSError as exc:
        _say(f"cannot start {args.command[0]!r}: {exc}")
        return 127
    code: int | None = None
    reason: str | None = None
    while code is None and reason is None:
        if requested:
            reason = f"got {signal.Signals(requested[0]).name}"
            break
        reason = _launcher_gone(args.fd, ppid)
        done = _reap()
        if child.pid in done:
            code = child.returncode = done[child.pid]
        elif reason is None:
            if args.fd is not None:
                try:
                    select.select([args.fd], [], [], POLL)
                except OSError:
                    time.sleep(POLL)
            else:
                time.sleep(POLL)
    if reason is not None:
        left = descendants(os.getpid())
        _say(
            f"{reason}: stopping {_processes(len(left))} (SIGTERM, SIGKILL after {args.grace:g} s)"
        )
        done = stop_tree(args.grace)
        if child.pid in done:
            child.returncode = done[child.pid]
        return 128 + requested[0] if requested else 128 + signal.SIGHUP
    left = descendants(os.getpid())
    if left:
        _say(f"{args.command[0]} exited with code {code}; stopping the {_processes(len(left))} "
             f"it left running (SIGTERM, SIGKILL after {args.grace:g} s)")  # fmt: skip
        stop_tree(args.grace)
    assert code is not None  # the loop ends with a reason or with the child's exit code
    return code


if __name__ == "__main__":
    sys.exit(main())
