"""launch() tears the process groups down at a clean exit, and not after an uncaught error."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from colossal.core import launch

    # Registered before launch, so it runs after launch's own exit hook (LIFO).
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    launch(rank=0, world_size=1, host="127.0.0.1", port={port}, verbose=False)
    print("initialized after launch:", dist.is_initialized(), flush=True)
    if {fail}:
        raise RuntimeError("planted failure")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(("fail", "destroyed"), [(False, True), (True, False)])
def test_groups_destroyed_only_at_clean_exit(fail: bool, destroyed: bool) -> None:
    code = SCRIPT.format(port=_free_port(), fail=fail)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode != 0) == fail, done.stderr
    assert "initialized after launch: True" in done.stdout, done.stdout + done.stderr
    assert f"initialized at exit: {not destroyed}" in done.stdout, done.stdout + done.stderr


def test_destroy_without_group_is_a_no_op() -> None:
    from colossal.core import destroy

    destroy()  # nothing initialized in this process: must not raise
    import torch.distributed as dist

    assert not dist.is_initialized()
