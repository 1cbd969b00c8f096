"""The exact commands ``colossal run`` starts: torchrun locally, or torchrun over ssh per node.

Nothing here starts a process; :mod:`colossal.cli.node_runner` does. Keeping the commands pure
makes them testable word for word.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from colossal.cli.hostfile import HostInfo

__all__ = [
    "NOT_FORWARDED_ENV_NAMES",
    "STOP_GRACE",
    "NOT_FORWARDED_ENV_PREFIXES",
    "LaunchSpec",
    "build_node_commands",
    "build_torchrun_command",
    "forwarded_env",
    "parse_extra_launch_args",
]

LOOPBACK = ("localhost", "127.0.0.1", "::1")
#: Seconds a job's processes get between SIGTERM and SIGKILL when it is stopped (default).
STOP_GRACE = 10.0

#: Variables never forwarded to remote nodes: they describe this host, this login session or
#: this terminal, or are set per node/process by the shell, ssh, a job scheduler or torchrun.
NOT_FORWARDED_ENV_NAMES = frozenset({
    # this host and this shell
    "HOSTNAME", "HOST", "HOSTTYPE", "MACHTYPE", "OSTYPE", "PWD", "OLDPWD", "SHLVL", "_",
    "HOME", "USER", "LOGNAME", "USERNAME", "SHELL", "MAIL", "TMPDIR", "PS1", "PS2", "PS4",
    "PROMPT_COMMAND", "BASHOPTS", "SHELLOPTS", "BASH", "BASH_ENV", "ENV", "IFS", "CDPATH",
    "HISTFILE",
    # the terminal and the desktop session
    "TERM", "TERMCAP", "COLORTERM", "COLUMNS", "LINES", "LS_COLORS", "DISPLAY",
    "WAYLAND_DISPLAY", "XAUTHORITY", "DBUS_SESSION_BUS_ADDRESS", "SESSION_MANAGER", "TMUX",
    "TMUX_PANE", "STY", "WINDOW", "WINDOWID", "VTE_VERSION", "GPG_AGENT_INFO", "GPG_TTY",
    "KRB5CCNAME", "MOTD_SHOWN", "INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET",
    "LISTEN_PID", "LISTEN_FDS",
    # set by torchrun for each node and worker (torchrun sets them again remotely)
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
    "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})  # fmt: skip
#: Variables never forwarded when their name starts with one of these.
NOT_FORWARDED_ENV_PREFIXES = (
    "SSH_",  # SSH_AUTH_SOCK, SSH_CONNECTION, SSH_TTY...: this login's agent and connection
    "XDG_",  # XDG_RUNTIME_DIR, XDG_SESSION_ID...: per-host, per-login directories and ids
    "TERM_",  # TERM_PROGRAM, TERM_SESSION_ID
    "BASH_FUNC_",  # exported shell functions (not valid names for `export`)
    "SLURM_", "PBS_", "PMI_", "PMIX_", "OMPI_", "LSB_",  # a scheduler's per-node/task values
    "TORCHELASTIC_",  # the agent's state (run id, restart count, error file) on this node
)  # fmt: skip

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class LaunchSpec:
    """What to launch, independent of where.

    Attributes:
        user_script: The script path, or a module name when ``module`` is set.
        user_args: Arguments for the script.
        nproc_per_node: Processes per node.
        master_addr: Rendezvous host (a node name or IP for multi-node jobs).
        master_port: Rendezvous port.
        module: Run ``user_script`` as ``python -m user_script``.
        extra_launch_args: Additional torchrun options, e.g. ``("--max_restarts=1",)``.
        python: The Python executable that runs torchrun (this interpreter by default).
        stop_grace: Seconds the job's processes get between SIGTERM and SIGKILL when the job
            is stopped (a failed node, Ctrl-C, the launcher or its ssh connection gone).
    """

    user_script: str
    user_args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    module: bool = False
    extra_launch_args: tuple[str, ...] = ()
    python: str = field(default_factory=lambda: sys.executable)
    stop_grace: float = STOP_GRACE

    def __post_init__(self) -> None:
        if not self.user_script:
            raise ValueError("no script given; write `colossal run [options] train.py [args]`")
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master_port must be in 1..65535, got {self.master_port}")
        if not self.stop_grace > 0:
            raise ValueError(
                f"--stop_grace must be a positive number of seconds, got {self.stop_grace}"
            )


def parse_extra_launch_args(text: str | None) -> tuple[str, ...]:
    """Turn ``"max_restarts=1,monitor_interval=2"`` into torchrun options.

    Each comma-separated entry ``key=value`` becomes ``--key=value``; a bare ``key`` becomes
    ``--key``.

    Raises:
        ValueError: An empty entry or an empty key.
    """
    if not text:
        return ()
    out = []
    for item in text.split(","):
        item = item.strip().lstrip("-")
        key = item.split("=", 1)[0]
        if not key:
            raise ValueError(
                f"--extra_launch_args {text!r} has an empty entry; write key=value[,key=value]"
            )
        out.append(f"--{item}")
    return tuple(out)


def build_torchrun_command(
    spec: LaunchSpec, num_nodes: int = 1, node_rank: int = 0, nproc: int | None = None
) -> list[str]:
    """The ``python -m torch.distributed.run ...`` argv of one node.

    Args:
        spec: What to launch.
        num_nodes: Nodes in the job.
        node_rank: This node's rank.
        nproc: Processes on this node (``spec.nproc_per_node`` by default).
    """
    cmd = [
        spec.python, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc or spec.nproc_per_node}",
        f"--nnodes={num_nodes}",
        f"--node_rank={node_rank}",
        f"--master_addr={spec.master_addr}",
        f"--master_port={spec.master_port}",
        *spec.extra_launch_args,
    ]  # fmt: skip
    if spec.module:
        cmd.append("-m")
    return [*cmd, spec.user_script, *spec.user_args]


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of ``environ`` (``os.environ`` by default) exported on every remote node.

    The whole environment is forwarded, sorted by name, except: variables in
    :data:`NOT_FORWARDED_ENV_NAMES` or starting with one of :data:`NOT_FORWARDED_ENV_PREFIXES`
    (host-, login- or terminal-specific, or set per node by a scheduler or torchrun), and names
    a POSIX shell cannot ``export`` (e.g. ``a.b``, ``BASH_FUNC_f%%``).
    """
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(environ.items())
        if _ENV_NAME.fullmatch(k)
        and k not in NOT_FORWARDED_ENV_NAMES
        and not k.startswith(NOT_FORWARDED_ENV_PREFIXES)
    }


def _check_master(hosts: list[HostInfo], master_addr: str | None) -> str:
    if master_addr is None:
        names = ",".join(h.hostname for h in hosts)
        raise ValueError(
            f"a multi-node job ({len(hosts)} nodes: {names}) needs --master_addr: the host name "
            f"or IP address of one node that every node can reach, e.g. --master_addr "
            f"{hosts[0].hostname}"
        )
    all_local = all(h.hostname in LOOPBACK for h in hosts)
    if master_addr in LOOPBACK and not all_local:
        raise ValueError(
            f"--master_addr {master_addr!r} cannot be used on several machines: the other nodes "
            f"would connect to themselves; give a host name or IP address of one node, e.g. "
            f"--master_addr {hosts[0].hostname}"
        )
    return master_addr


def _nproc_per_host(hosts: list[HostInfo], nproc_per_node: int | None) -> list[int]:
    if nproc_per_node is not None:
        return [nproc_per_node] * len(hosts)
    slots = [h.slots or 1 for h in hosts]
    if len(set(slots)) > 1:
        listed = ", ".join(f"{h.hostname}={s}" for h, s in zip(hosts, slots, strict=True))
        raise ValueError(
            f"the hosts have different slot counts ({listed}); torchrun needs the same number "
            "of processes on every node, so pass --nproc_per_node N"
        )
    return slots


def build_node_commands(
    spec: LaunchSpec,
    hosts: list[HostInfo],
    nproc_per_node: int | None,
    ssh_port: int | None = None,
    workdir: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[tuple[str, list[str]]]:
    """One ``ssh host 'cd ... && export ... && exec <watchdog> -- <torchrun>'`` per node.

    ``<watchdog>`` is ``python -m colossal.cli.watchdog --grace S``: it stops torchrun and its
    ranks when the ssh connection drops (the remote terminal hangs up) or its sshd session
    ends, so colossal-cli must be importable by ``spec.python`` on every node.

    Args:
        spec: What to launch; its ``master_addr`` is ignored in favour of the checked one.
        hosts: The nodes, in node-rank order.
        nproc_per_node: Processes per node; None takes the hosts' slot counts (default 1).
        ssh_port: ``ssh -p`` port (ssh's default when None).
        workdir: Directory to run in on every node (the current one by default).
        environ: Environment to forward from (``os.environ`` by default).

    Returns:
        ``(hostname, argv)`` per node.

    Raises:
        ValueError: ``spec.master_addr`` is empty/loopback for a multi-machine job, or the
            hosts' slot counts differ and ``nproc_per_node`` is None.
    """
    master = _check_master(hosts, spec.master_addr or None)
    nprocs = _nproc_per_host(hosts, nproc_per_node)
    workdir = os.getcwd() if workdir is None else workdir
    env = forwarded_env(environ)
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    spec = LaunchSpec(**{**spec.__dict__, "master_addr": master})
    out = []
    for rank, (host, nproc) in enumerate(zip(hosts, nprocs, strict=True)):
        watchdog = [spec.python, "-m", "colossal.cli.watchdog", "--grace", f"{spec.stop_grace:g}"]
        torchrun = build_torchrun_command(spec, len(hosts), rank, nproc)
        remote = f"cd {shlex.quote(workdir)} && "
        if exports:
            remote += f"export {exports} && "
        remote += f"exec {shlex.join([*watchdog, '--', *torchrun])}"
        ssh = ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
        if ssh_port is not None:
            ssh += ["-p", str(ssh_port)]
        out.append((host.hostname, [*ssh, host.hostname, remote]))
    return out
