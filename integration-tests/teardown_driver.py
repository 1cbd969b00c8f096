"""Run a 2-rank script many times and fail on the first run whose processes do not all exit.

Used by test_teardown.py. Importing torch and transformers takes seconds per process, so this
driver imports them once and forks the two ranks of every run from itself. Each rank then runs
the script exactly as ``torchrun`` would (``__main__``, torchrun's environment variables) and
leaves through the normal interpreter exit (locals freed, atexit hooks, module teardown):
the path on which a gloo teardown deadlock shows up.

    python3 teardown_driver.py --runs 20 --timeout 60 SCRIPT [ARGS...]

Prints one line per run and a summary; exits 1 on the first hung or failed run, after killing
its ranks and printing their output.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per run (stops a hang)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--preload",
        default="transformers.models.gpt2.modeling_gpt2,matplotlib.pyplot,tqdm",
        help="modules imported once before forking (lazy packages import on first use)",
    )
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p.parse_args()


def preload(modules: str) -> None:
    import importlib

    import torch

    torch.set_num_threads(1)
    import colossal.booster.plugin as plugins

    for name in plugins.__all__:  # the package imports its plugins on first use
        getattr(plugins, name)

    for name in filter(None, modules.split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the script reports it in its own way


def rank_main(rank: int, nproc: int, port: int, script: str, args: list[str], log: str) -> None:
    """In the forked child: run the script as rank ``rank`` and exit like the interpreter does."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    sys.argv = [script, *args]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the rank's log
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    # Leave through the interpreter's own shutdown, as a script run by torchrun does.
    raise SystemExit(code)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_all(pids: dict[int, int], timeout: float) -> dict[int, int | None]:
    """Exit status per rank (None for a rank still running at the deadline)."""
    codes: dict[int, int | None] = {rank: None for rank in pids}
    deadline = time.monotonic() + timeout
    while any(c is None for c in codes.values()) and time.monotonic() < deadline:
        for rank, pid in pids.items():
            if codes[rank] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return codes


def one_run(opts: argparse.Namespace, index: int, logdir: str) -> bool:
    port = free_port()
    pids: dict[int, int] = {}
    logs = {rank: os.path.join(logdir, f"run{index}-rank{rank}.log") for rank in range(opts.nproc)}
    for rank in range(opts.nproc):
        pid = os.fork()
        if pid == 0:
            rank_main(rank, opts.nproc, port, opts.script, opts.args, logs[rank])
        pids[rank] = pid
    start = time.monotonic()
    codes = wait_all(pids, opts.timeout)
    hung = [rank for rank, code in codes.items() if code is None]
    for rank in hung:
        os.kill(pids[rank], signal.SIGKILL)
        os.waitpid(pids[rank], 0)
    ok = not hung and all(code == 0 for code in codes.values())
    took = time.monotonic() - start
    print(f"run {index + 1}: exit codes {codes} ({took:.1f} s)", flush=True)
    if not ok:
        what = f"ranks {hung} did not exit within {opts.timeout:.0f} s" if hung else "failed"
        print(f"FAILED run {index + 1}: {what}", flush=True)
        for rank, path in logs.items():
            with open(path, encoding="utf-8", errors="replace") as fh:
                print(f"--- rank {rank} output (last 40 lines) ---\n"
                      + "".join(fh.readlines()[-40:]), flush=True)  # fmt: skip
    return ok


def main() -> int:
    opts = parse_args()
    preload(opts.preload)
    # No `with`/`finally` between here and the fork: a forked rank leaves by raising
    # SystemExit through these frames and must not run the parent's clean-up.
    logdir = tempfile.mkdtemp(prefix="teardown-")
    for index in range(opts.runs):
        if not one_run(opts, index, logdir):
            return 1
    shutil.rmtree(logdir, ignore_errors=True)
    print(f"all {opts.runs} runs of {opts.nproc} ranks exited cleanly", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
