"""A two-node `colossal run` over ssh to this machine (localhost + 127.0.0.1 as the nodes).

Needs an sshd binary the test can start on a free port with its own keys; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import cli_env, free_port
from test_run_orphans import PID_SCRIPT as TERM_PID_SCRIPT
from test_run_orphans import _pids, kill_leftovers, wait_until_gone
from test_run_real import RANK_SCRIPT

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/usr/bin/sshd")


def _wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.1)
    return False


@pytest.fixture
def ssh_localhost(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """Start a private sshd; yield (dir with an `ssh` wrapper using its keys, port)."""
    sshd = next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)
    if sshd is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("no sshd/ssh/ssh-keygen on this machine (e.g. apt-get install openssh-server)")
    d = tmp_path / "ssh"
    d.mkdir(mode=0o700)
    for key in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)],
                       check=True, capture_output=True)  # fmt: skip
    shutil.copy(d / "user_key.pub", d / "authorized_keys")
    port = free_port()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
        f"PubkeyAuthentication yes\nStrictModes no\nUsePAM no\nPermitRootLogin yes\n"
        f"PidFile {d / 'sshd.pid'}\nPermitUserEnvironment no\n"
    )
    os.makedirs("/run/sshd", exist_ok=True) if os.geteuid() == 0 else None
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(d / "sshd_config")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        if not _wait_port(port, 10):
            proc.kill()
            out = proc.communicate()[0].decode(errors="replace")[-500:]
            pytest.skip(f"sshd could not be started by the test: {out.strip()}")
        bindir = tmp_path / "bin"
        bindir.mkdir()
        wrapper = bindir / "ssh"
        wrapper.write_text(
            f"#!/bin/sh\nexec {shutil.which('ssh')} -i {d / 'user_key'} -o IdentitiesOnly=yes "
            f'-o UserKnownHostsFile={d / "known_hosts"} -F /dev/null "$@"\n'
        )
        wrapper.chmod(0o755)
        probe = subprocess.run([str(wrapper), "-o", "BatchMode=yes", "-o",
                                "StrictHostKeyChecking=accept-new", "-p", str(port),
                                "127.0.0.1", "true"], capture_output=True, text=True,
                               timeout=20)  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"ssh to the test's sshd failed: {probe.stderr.strip()[-300:]}")
        yield bindir, port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


#: Rank 0 records its pid and its torchrun agent's pid, then sleeps; rank 1 fails once rank 0
#: has started, so only stopping the job can end rank 0 before its sleep does (had it been
#: waited for, it would leave ``rank0_done``).
PID_SCRIPT = textwrap.dedent(
    """
    import os, pathlib, sys, time
    here = pathlib.Path(sys.argv[1])
    if os.environ["RANK"] == "0":
        (here / "rank0.tmp").write_text(f"{os.getpid()} {os.getppid()}")
        (here / "rank0.tmp").rename(here / "rank0")
        time.sleep(120)
        (here / "rank0_done").write_text("")
    else:
        while not (here / "rank0").exists():
            time.sleep(0.1)
        print("rank 1 fails on purpose", flush=True)
        sys.exit(3)
    """
)


def _command(tmp_path: Path, colossal_cmd: list[str], bindir: Path, port: int, *args: str,
             script_text: str = RANK_SCRIPT,
             master_port: int | None = None) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    script = tmp_path / "ranks.py"
    script.write_text(script_text)
    env = cli_env()
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["MY_JOB_SETTING"] = "a b'c"  # forwarded with the whole environment
    master_port = free_port() if master_port is None else master_port
    cmd = [*colossal_cmd, "run", "--host", "localhost,127.0.0.1", "--master_addr", "127.0.0.1",
           "--master_port", str(master_port), "--ssh-port", str(port), "--nproc_per_node", "1",
           str(script), *args]  # fmt: skip
    return cmd, env


def _run(tmp_path: Path, colossal_cmd: list[str], bindir: Path, port: int, *args: str,
         script_text: str = RANK_SCRIPT) -> subprocess.CompletedProcess[str]:  # fmt: skip
    cmd, env = _command(tmp_path, colossal_cmd, bindir, port, *args, script_text=script_text)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_two_nodes_over_ssh(tmp_path, colossal_cmd, ssh_localhost) -> None:
    script = RANK_SCRIPT + "\nprint('forwarded:', repr(os.environ.get('MY_JOB_SETTING')))\n"
    done = _run(tmp_path, colossal_cmd, *ssh_localhost, "2", script_text=script)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "[localhost] rank 0/2 ok sum=3" in lines, done.stdout
    assert "[127.0.0.1] rank 1/2 ok sum=3" in lines, done.stdout
    for host in ("localhost", "127.0.0.1"):
        assert f'[{host}] forwarded: "a b\'c"' in lines, done.stdout


def test_failing_node_stops_the_job(tmp_path, colossal_cmd, ssh_localhost) -> None:
    done = _run(tmp_path, colossal_cmd, *ssh_localhost, str(tmp_path), script_text=PID_SCRIPT)
    assert done.returncode == 1, done.stdout + done.stderr  # torchrun: a worker failed
    assert "[127.0.0.1] rank 1 fails on purpose" in done.stdout
    assert "node 127.0.0.1 exited with code 1: stopping every node" in done.stdout
    worker, agent = map(int, (tmp_path / "rank0").read_text().split())
    # The other node's ssh session was closed; its torchrun gets SIGHUP and stops its worker.
    deadline = time.monotonic() + 30
    while (_alive(worker) or _alive(agent)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(worker), "rank 0's worker on the other node survived"
    assert not _alive(agent), "the other node's torchrun survived"
    # Stopped, not completed: rank 0 never got past its sleep.
    assert not (tmp_path / "rank0_done").exists(), "rank 0 ran to completion: it was waited for"


def test_sigkilled_launcher_stops_the_remote_ranks(tmp_path, colossal_cmd, ssh_localhost) -> None:
    """The launcher's watchdogs close the ssh sessions; each remote watchdog, hung up, stops
    its torchrun and rank (rank 1 ignores SIGTERM: it needs the SIGKILL after --stop_grace)."""
    master_port = free_port()
    cmd, env = _command(tmp_path, colossal_cmd, *ssh_localhost, str(tmp_path),
                        script_text=TERM_PID_SCRIPT, master_port=master_port)  # fmt: skip
    cmd[cmd.index("--nproc_per_node"):cmd.index("--nproc_per_node")] = ["--stop_grace", "2"]
    with (tmp_path / "out.txt").open("w") as out:
        launcher = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out,
                                    stderr=subprocess.STDOUT)  # fmt: skip
    pids: dict[str, int] = {}
    try:
        pids = _pids(tmp_path, 2)
        assert pids["agent0"] != pids["agent1"]  # one torchrun per node
        assert all(_alive(pid) for pid in pids.values())  # the checks below can fail
        launcher.kill()
        launcher.wait()
        left = wait_until_gone(pids, master_port, timeout=30)
    finally:
        kill_leftovers([launcher.pid, *pids.values()])
    log = (tmp_path / "out.txt").read_text()
    assert left == [], f"{left} outlived the SIGKILLed launcher\n{log}"
    assert (tmp_path / "rank0_term").exists(), f"rank 0 got no SIGTERM before SIGKILL\n{log}"
    assert not list(tmp_path.glob("*_done")), "a rank ran to completion"
