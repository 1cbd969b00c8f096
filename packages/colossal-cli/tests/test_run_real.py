from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable

from conftest import cli_env, default_sigint, free_port

from colossal.cli.node_runner import run_nodes

RANK_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    expected = int(sys.argv[1])
    assert world == expected, (world, expected)
    dist.init_process_group("gloo")
    assert dist.get_rank() == rank and dist.get_world_size() == world
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t
    if len(sys.argv) > 2 and rank == int(sys.argv[2]):
        print(f"rank {rank} fails on purpose", flush=True)
        sys.exit(3)
    dist.barrier()
    print(f"rank {rank}/{world} ok sum={t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


def _script(tmp_path) -> str:
    path = tmp_path / "ranks.py"
    path.write_text(RANK_SCRIPT)
    return str(path)


def test_real_run_two_processes(tmp_path, colossal_cmd) -> None:
    cmd = [*colossal_cmd, "run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           _script(tmp_path), "2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0/2 ok sum=3" in done.stdout
    assert "rank 1/2 ok sum=3" in done.stdout


def test_real_run_failure_is_nonzero(tmp_path, colossal_cmd) -> None:
    cmd = [*colossal_cmd, "run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           _script(tmp_path), "2", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode != 0
    assert "rank 1 fails on purpose" in done.stdout


def test_run_nodes_prefixes_and_stops_all_on_failure(tmp_path) -> None:
    out = tmp_path / "out.txt"
    marker = tmp_path / "survivor"
    # nodeA only finishes (and leaves the marker) if it is waited for instead of stopped.
    slow = (
        f"import time; print('up', flush=True); time.sleep(30); open({str(marker)!r}, 'w'); "
        "print('finished', flush=True)"
    )
    commands = [
        ("nodeA", [sys.executable, "-c", slow]),
        ("nodeB", [sys.executable, "-c",
                   "import time, sys; time.sleep(1); print('bye'); sys.exit(4)"]),
    ]  # fmt: skip
    with out.open("w") as f:
        code = run_nodes(commands, out=f)
    assert code == 4
    text = out.read_text()
    assert "[nodeA] up" in text and "[nodeB] bye" in text
    assert "node nodeB exited with code 4: stopping every node" in text
    # run_nodes returns after the nodes it stopped are gone: nodeA was stopped, not completed.
    assert "[nodeA] finished" not in text, text
    assert not marker.exists(), "nodeA ran to completion: it was waited for, not stopped"


def test_run_nodes_all_succeed(tmp_path) -> None:
    out = tmp_path / "out.txt"
    commands = [(f"n{i}", [sys.executable, "-c", f"print('hello {i}')"]) for i in range(3)]
    with out.open("w") as f:
        assert run_nodes(commands, out=f) == 0
    assert sorted(out.read_text().splitlines()) == ["[n0] hello 0", "[n1] hello 1", "[n2] hello 2"]


def _wait_for(path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_ctrl_c_stops_every_node(tmp_path) -> None:
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(f"""
        import sys
        from colossal.cli.node_runner import run_nodes
        def sleeper(name):
            return ("import os, pathlib, time; "
                    f"pathlib.Path({str(tmp_path)!r}, {{name!r}}).write_text(str(os.getpid())); "
                    "time.sleep(60); "
                    f"pathlib.Path({str(tmp_path)!r}, {{name!r}} + '_done').write_text('')")
        sys.exit(run_nodes([("a", [sys.executable, "-c", sleeper("pid_a")]),
                            ("b", [sys.executable, "-c", sleeper("pid_b")])]))
    """)
    )
    # default_sigint: the driver must stop on SIGINT even when this test run ignores SIGINT
    # (started in the background of a non-interactive shell: `nohup bash .ci/run &`).
    proc = subprocess.Popen([sys.executable, str(driver)], env=cli_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=default_sigint)  # fmt: skip
    _wait_for(tmp_path / "pid_a")
    _wait_for(tmp_path / "pid_b")
    pids = {name: int((tmp_path / f"pid_{name}").read_text()) for name in "ab"}
    assert all(_alive(pid) for pid in pids.values())  # the check below can fail
    proc.send_signal(signal.SIGINT)
    try:
        # Only stops a hang: the sleepers would finish on their own after 60 s.
        out, _ = proc.communicate(timeout=30)
    finally:
        _kill_leftovers(proc, pids.values())
    assert proc.returncode == 130, out
    assert "interrupted: stopping every node" in out
    # run_nodes waits for every node it stopped, so they are gone by the time it returns,
    # and they were stopped (no "done" marker), not waited for until their sleep ended.
    assert [name for name, pid in pids.items() if _alive(pid)] == []
    assert not list(tmp_path.glob("*_done")), "a node ran to completion instead of being stopped"


def test_ctrl_c_stops_local_run(tmp_path, colossal_cmd) -> None:
    script = tmp_path / "sleepy.py"
    script.write_text(
        textwrap.dedent(f"""
        import os, pathlib, time
        pathlib.Path({str(tmp_path)!r}, "rank" + os.environ["RANK"]).write_text(str(os.getpid()))
        time.sleep(60)
    """)
    )
    cmd = [*colossal_cmd, "run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script)]  # fmt: skip
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, preexec_fn=default_sigint)  # fmt: skip
    _wait_for(tmp_path / "rank0")
    _wait_for(tmp_path / "rank1")
    pids = [int((tmp_path / f"rank{rank}").read_text()) for rank in (0, 1)]
    proc.send_signal(signal.SIGINT)  # to the launcher only, as a test cannot press Ctrl-C
    try:
        proc.communicate(timeout=40)  # only stops a hang
    finally:
        # The ranks may take a moment to exit after the launcher: poll (only stops a hang).
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [rank for rank, pid in enumerate(pids) if _alive(pid)]
        _kill_leftovers(proc, pids)
    assert proc.returncode == 130
    assert survivors == [], f"ranks {survivors} survived"


def _kill_leftovers(proc: subprocess.Popen, pids: Iterable[int]) -> None:
    """Kill the driver and the given node pids if a failed check left them running."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    return os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)
