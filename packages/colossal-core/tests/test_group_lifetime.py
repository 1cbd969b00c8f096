"""Tearing process groups down never deadlocks: groups are kept alive until the process exits.

The race (see colossal.core.group_lifetime): a gloo worker frees a barrier, and with it the
works issued before it, while holding the group's queue lock; freeing their tensors needs the
GIL. If the main thread drops the last reference to the group at that moment (here: a DDP
model freed after the group was destroyed), each waits for the other. Without keep-alive the
cycle below hung within ~50 rounds on this machine (a 2-core VM); with it, none of the
rounds may hang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

CYCLES = 150

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from colossal.core import destroy
    from colossal.core.group_lifetime import kept_alive_count

    torch.set_num_threads(1)
    rank, store_dir, cycles = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(cycles):
        store = dist.FileStore(f"{store_dir}/store{i}", 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        sub = dist.new_group([0, 1])
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
        model(torch.randn(2, 16)).sum().backward()
        t = torch.ones(1000)
        dist.all_reduce(t)
        dist.all_reduce(torch.ones(8), group=sub)
        del t  # only the finished work still holds it now
        dist.barrier()
        destroy()  # then the DDP model, the group's last other holder, is freed
        del model, sub
    print("kept alive:", kept_alive_count(), flush=True)
    """
)


def test_keep_alive_is_idempotent_and_passes_none_through() -> None:
    from colossal.core.group_lifetime import keep_alive, kept_alive_count

    assert keep_alive(None) is None
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = kept_alive_count()
        group = dist.new_group([0])
        assert keep_alive(group) is group
        assert keep_alive(group) is group
        assert kept_alive_count() == before + 1
    finally:
        from colossal.core import destroy

        destroy()
    assert not dist.is_initialized()


def test_destroy_then_free_never_hangs(tmp_path) -> None:
    script = tmp_path / "cycle.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path), str(CYCLES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            # A timeout only stops a hang: the rounds take a few seconds in all.
            out, err = proc.communicate(timeout=240)
            outputs.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank hung tearing its groups down (rounds of {CYCLES})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (code, out, err) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited {code}:\n{out}\n{err}"
        # default group and the subgroup of every round: none was freed
        assert f"kept alive: {2 * CYCLES}" in out, out


def test_run_isolated_kills_what_a_command_leaves_behind(tmp_path) -> None:
    import subprocess

    from colossal.core.testing import LeftoverProcessError, run_isolated

    pid_file = tmp_path / "child.pid"
    # The command exits at once but leaves a grandchild sleeping in its session.
    code = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))"
    )
    with pytest.raises(LeftoverProcessError, match="left processes"):
        run_isolated([sys.executable, "-c", code], timeout=60)
    pid = int(pid_file.read_text())
    _assert_gone(pid)
    # A hung command: the timeout kills the whole session, grandchildren included.
    pid_file.unlink()
    code_hang = code + "; import time; time.sleep(600)"
    with pytest.raises(subprocess.TimeoutExpired):
        run_isolated([sys.executable, "-c", code_hang], timeout=5)
    _assert_gone(int(pid_file.read_text()))
    done = run_isolated([sys.executable, "-c", "print('ok')"], timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n")


def _assert_gone(pid: int) -> None:
    import time

    for _ in range(100):  # SIGKILL is delivered asynchronously; the zombie is reaped by init
        try:
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} is still running")


EXIT_RUNS = 8

EXIT_SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from colossal.core import destroy, group_lifetime

    torch.set_num_threads(1)
    rank, store_path = int(sys.argv[1]), sys.argv[2]
    if sys.argv[3] == "no-drain":
        group_lifetime.WORKER_DRAIN_SECONDS = 0
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    for _ in range(5):
        model(torch.randn(8, 64)).sum().backward()  # all-reduces issued inside backward()
    destroy()  # then straight into interpreter shutdown
    """
)


def test_exit_right_after_backward_never_aborts(tmp_path) -> None:
    # Catches: a gloo worker freeing a backward-issued work (its captured thread-local state
    # holds a Python object) after interpreter shutdown began -> "terminate called without an
    # active exception". Without let_workers_finish ("no-drain") this aborted 5 of 20 runs of
    # examples/zero_in_ddp_script/train_ddp.py and some of these rounds.
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mode = os.environ.get("COLOSSAL_TEST_EXIT_MODE", "drain")  # "no-drain" shows the abort
    for run in range(EXIT_RUNS):
        store = tmp_path / f"store{run}"
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), str(rank), str(store), mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(2)
        ]
        try:
            results = [(p.communicate(timeout=120), p.returncode) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for rank, ((out, err), code) in enumerate(results):
            assert code == 0, f"run {run} rank {rank} exited {code}:\n{out}\n{err}"
