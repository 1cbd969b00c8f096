"""Ranks started by `colossal run` end when their launcher dies, even by SIGKILL.

Before the watchdog, a SIGKILLed launcher left torchrun and every rank running: they went on
writing into the job's directories and held the rendezvous port, so a restart failed with
EADDRINUSE.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import cli_env, free_port, port_is_free
from test_run_real import _alive, _wait_for

from colossal.cli.watchdog import descendants

#: Each rank records "pid agent_pid" and sleeps. Rank 0 exits on SIGTERM and leaves a marker
#: (it was asked first); rank 1 ignores SIGTERM, so only SIGKILL ends it. A rank that outlives
#: its sleep leaves ``rank<N>_done``.
PID_SCRIPT = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    here, rank = pathlib.Path(sys.argv[1]), os.environ["RANK"]
    if rank == "0":
        def on_term(signum, frame):
            (here / "rank0_term").write_text("")
            sys.exit(143)
        signal.signal(signal.SIGTERM, on_term)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    (here / f"rank{rank}.tmp").write_text(f"{os.getpid()} {os.getppid()}")
    (here / f"rank{rank}.tmp").rename(here / f"rank{rank}")
    time.sleep(120)
    (here / f"rank{rank}_done").write_text("")
    """
)


def _pids(here: Path, ranks: int) -> dict[str, int]:
    """``rank<N>`` and ``agent<N>`` (that rank's torchrun) pids, once every rank wrote them."""
    out = {}
    for rank in range(ranks):
        _wait_for(here / f"rank{rank}", timeout=90)
        worker, agent = map(int, (here / f"rank{rank}").read_text().split())
        out[f"rank{rank}"], out[f"agent{rank}"] = worker, agent
    return out


def wait_until_gone(pids: dict[str, int], port: int, timeout: float = 20) -> list[str]:
    """Poll until every pid is gone and ``port`` is free; the names still running, else []."""
    deadline = time.monotonic() + timeout
    while True:
        left = [name for name, pid in pids.items() if _alive(pid)]
        if not port_is_free(port):
            left.append(f"port {port}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_leftovers(pids: list[int]) -> None:
    """SIGKILL what a failed check left running, with everything below it."""
    for pid in pids:
        if _alive(pid):
            below = descendants(pid)
            for p in [pid, *below]:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_sigkilled_launcher_takes_its_ranks_along(tmp_path: Path, colossal_cmd) -> None:
    script = tmp_path / "pids.py"
    script.write_text(PID_SCRIPT)
    port = free_port()
    cmd = [*colossal_cmd, "run", "--nproc_per_node", "2", "--master_port", str(port),
           "--stop_grace", "2", str(script), str(tmp_path)]  # fmt: skip
    with (tmp_path / "out.txt").open("w") as out:
        launcher = subprocess.Popen(cmd, env=cli_env(), stdout=out, stderr=subprocess.STDOUT)
    pids: dict[str, int] = {}
    try:
        pids = _pids(tmp_path, 2)
        assert pids["agent0"] == pids["agent1"]
        # Both checks below can fail: the job runs and torchrun's store listens on the port.
        assert all(_alive(pid) for pid in pids.values())
        assert not port_is_free(port)
        launcher.kill()  # as the OOM killer or a preemption would
        launcher.wait()
        left = wait_until_gone(pids, port)
    finally:
        kill_leftovers([launcher.pid, *pids.values()])
    log = (tmp_path / "out.txt").read_text()
    assert left == [], f"{left} outlived the SIGKILLed launcher\n{log}"
    assert (tmp_path / "rank0_term").exists(), f"rank 0 got no SIGTERM before SIGKILL\n{log}"
    assert not list(tmp_path.glob("*_done")), "a rank ran to completion"
    assert "colossal run: the launcher" in log, log


def test_ranks_get_default_sigint_under_an_ignoring_launcher(tmp_path, colossal_cmd) -> None:
    """A job started with SIGINT ignored (``nohup colossal run ... &``) still has ranks that
    Ctrl-C's signal stops: the launcher keeps SIGINT ignored, as the shell asked, but torchrun
    installs its own handler before it starts the ranks, so they get the default action.
    """
    script = tmp_path / "sigint.py"
    script.write_text(
        "import os, signal, sys\n"
        "h = signal.getsignal(signal.SIGINT)\n"
        "state = 'default' if h is signal.default_int_handler else repr(h)\n"
        "# one write per line: under PYTHONUNBUFFERED print's pieces interleave across ranks\n"
        "os.write(1, f\"rank {os.environ['RANK']} sigint {state}\\n\".encode())\n"
    )
    cmd = [*colossal_cmd, "run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script)]  # fmt: skip

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    done = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=ignore_sigint)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 sigint default" in done.stdout, done.stdout
    assert "rank 1 sigint default" in done.stdout, done.stdout


def test_watchdog_stops_what_its_command_left_behind(tmp_path: Path) -> None:
    """A command that exits while its children still run (a torchrun killed under its ranks):
    the children are stopped, including one ignoring SIGTERM, and its exit code is kept."""
    child = tmp_path / "child"
    orphaner = (
        "import os, signal, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)'], "
        "start_new_session=True)\n"
        f"open({str(child)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(0.5)\n"
        "sys.exit(5)\n"
    )
    cmd = [sys.executable, "-m", "colossal.cli.watchdog", "--grace", "1", "--", sys.executable,
           "-c", orphaner]  # fmt: skip
    done = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=60)
    pid = int(child.read_text())
    try:
        assert done.returncode == 5, done.stderr
        assert not _alive(pid), "the orphan ignoring SIGTERM outlived the watchdog"
        assert "left running" in done.stderr, done.stderr
    finally:
        kill_leftovers([pid])


@pytest.mark.parametrize("ignored", [False, True])
def test_watchdog_sighup_stops_unless_ignored(tmp_path: Path, ignored: bool) -> None:
    """SIGHUP (a dropped ssh connection) stops the tree, unless the watchdog was started with
    SIGHUP ignored: `nohup colossal run ...` must outlive the terminal that started it."""
    body = (
        "import pathlib, time\n"
        f"here = pathlib.Path({str(tmp_path)!r})\n"
        "(here / 'started').write_text('')\n"
        "time.sleep(3)\n"
        "(here / 'finished').write_text('')\n"
    )
    cmd = [sys.executable, "-m", "colossal.cli.watchdog", "--grace", "1", "--", sys.executable,
           "-c", body]  # fmt: skip

    def sighup_disposition() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)

    watchdog = subprocess.Popen(cmd, env=cli_env(), stderr=subprocess.PIPE, text=True,
                                preexec_fn=sighup_disposition)  # fmt: skip
    try:
        _wait_for(tmp_path / "started")
        watchdog.send_signal(signal.SIGHUP)
        _, err = watchdog.communicate(timeout=30)
    finally:
        kill_leftovers([watchdog.pid])
    if ignored:
        assert watchdog.returncode == 0, err
        assert (tmp_path / "finished").exists(), "the command was stopped despite nohup"
    else:
        assert watchdog.returncode == 128 + signal.SIGHUP, err
        assert "got SIGHUP: stopping 1 process (" in err, err
        assert not (tmp_path / "finished").exists(), "the command was not stopped"
