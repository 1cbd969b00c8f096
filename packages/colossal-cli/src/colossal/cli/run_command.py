"""``colossal run``: start a training script with torchrun on one node or several over ssh."""

from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import os
import shlex
import sys
from dataclasses import dataclass

import click

from colossal.cli.hostfile import HostInfo, filter_hosts, parse_host_list, parse_hostfile
from colossal.cli.launch_command import (
    LOOPBACK,
    STOP_GRACE,
    LaunchSpec,
    build_node_commands,
    build_torchrun_command,
    parse_extra_launch_args,
)
from colossal.cli.node_runner import run_local, run_nodes

__all__ = ["LaunchPlan", "check_user_script", "misplaced_option_error", "plan_launch", "run"]


@dataclass(frozen=True)
class LaunchPlan:
    """The commands of one ``colossal run``.

    Attributes:
        local: The torchrun argv when the job runs on this machine only, else None.
        nodes: ``(hostname, ssh argv)`` per node of a multi-node job (empty when local).
    """

    local: list[str] | None
    nodes: list[tuple[str, list[str]]]


def _select_hosts(
    host: str | None,
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    num_nodes: int,
) -> list[HostInfo]:
    if host is not None and hostfile is not None:
        raise ValueError("--host and --hostfile cannot be used together; pick one")
    if host is None and hostfile is None:
        if include is not None or exclude is not None:
            raise ValueError("--include/--exclude need a host list: add --host or --hostfile")
        if num_nodes > 1:
            raise ValueError(
                f"--num_nodes {num_nodes} needs the nodes' names: add --host h1,h2 or "
                "--hostfile FILE"
            )
        return []
    hosts = parse_host_list(host) if host is not None else parse_hostfile(hostfile or "")
    hosts = filter_hosts(hosts, include, exclude)
    if num_nodes > 0:
        if num_nodes > len(hosts):
            raise ValueError(
                f"--num_nodes {num_nodes} is more than the {len(hosts)} available hosts "
                f"({', '.join(h.hostname for h in hosts)})"
            )
        hosts = hosts[:num_nodes]
    return hosts


def plan_launch(
    user_script: str,
    user_args: tuple[str, ...] = (),
    *,
    host: str | None = None,
    hostfile: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int = -1,
    nproc_per_node: int | None = None,
    master_addr: str | None = None,
    master_port: int = 29500,
    ssh_port: int | None = None,
    extra_launch_args: str | None = None,
    module: bool = False,
    workdir: str | None = None,
    environ: dict[str, str] | None = None,
    stop_grace: float = STOP_GRACE,
) -> LaunchPlan:
    """Validate ``colossal run``'s options and build its commands (nothing is started).

    Raises:
        ValueError: Inconsistent options, a malformed hostfile, or a multi-node job without
            a usable ``master_addr``.
        FileNotFoundError: The hostfile does not exist.
    """
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node must be >= 1, got {nproc_per_node}")
    hosts = _select_hosts(host, hostfile, include, exclude, num_nodes)
    extra = parse_extra_launch_args(extra_launch_args)
    local_only = not hosts or (len(hosts) == 1 and hosts[0].hostname in LOOPBACK)
    if local_only:
        slots = hosts[0].slots if hosts else None
        spec = LaunchSpec(
            user_script, tuple(user_args), nproc_per_node or slots or 1,
            master_addr or "127.0.0.1", master_port, module, extra, stop_grace=stop_grace,
        )  # fmt: skip
        return LaunchPlan(build_torchrun_command(spec), [])
    if len(hosts) == 1 and master_addr is None:
        master_addr = hosts[0].hostname  # one remote node rendezvouses with itself
    spec = LaunchSpec(
        user_script, tuple(user_args), nproc_per_node or 1, master_addr or "", master_port,
        module, extra, stop_grace=stop_grace,
    )  # fmt: skip
    nodes = build_node_commands(spec, hosts, nproc_per_node, ssh_port, workdir, environ)
    return LaunchPlan(None, nodes)


def _module_found(name: str, cwd: str) -> bool:
    """Whether ``python -m name`` run in ``cwd`` finds the top-level package of ``name``.

    Only the top-level name is looked up, so nothing of the user's is imported.
    """
    top = name.split(".", 1)[0]
    try:
        if importlib.util.find_spec(top) is not None:
            return True
    except (ImportError, ValueError):
        pass
    # `python -m` puts the working directory first on sys.path; this process may not have it.
    return importlib.machinery.PathFinder.find_spec(top, [cwd, *sys.path]) is not None


def check_user_script(user_script: str, module: bool = False, cwd: str | None = None) -> None:
    """Check that what ``colossal run`` would start exists, before any process is started.

    A script must be a file (or a directory with ``__main__.py``, which Python also runs),
    relative to ``cwd``; every node of a multi-node job runs in that same directory. With
    ``module`` (``-m``) the name must be a dotted module name whose top-level package this
    Python can find from ``cwd``.

    Args:
        user_script: The script path, or the module name with ``module``.
        module: ``colossal run -m``.
        cwd: Directory the job runs in (the current one by default).

    Raises:
        FileNotFoundError: The script or module does not exist; the message names the path.
        ValueError: The script is a directory without ``__main__.py``, or ``module`` is set
            and the name is not a dotted module name.
    """
    cwd = os.getcwd() if cwd is None else cwd
    if module:
        if not all(part.isidentifier() for part in user_script.split(".")):
            raise ValueError(
                f"-m {user_script!r} is not a module name (dotted identifiers such as "
                "pkg.train); to run a file, drop -m: colossal run train.py"
            )
        if not _module_found(user_script, cwd):
            raise FileNotFoundError(
                f"-m {user_script!r}: no module {user_script.split('.')[0]!r} in {cwd!r} or "
                "on this Python's sys.path; nothing was started"
            )
        return
    path = os.path.join(cwd, os.path.expanduser(user_script))
    if os.path.isfile(path):
        return
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "__main__.py")):
            return
        raise ValueError(
            f"script {user_script!r} is a directory ({os.path.abspath(path)}) without "
            "__main__.py; give the training script's path, e.g. "
            f"colossal run {os.path.join(user_script, 'train.py')}"
        )
    hint = ""
    if not user_script.endswith(".py") and all(p.isidentifier() for p in user_script.split(".")):
        hint = f"; to run the module {user_script!r}, add -m: colossal run -m {user_script}"
    raise FileNotFoundError(
        f"script {user_script!r} does not exist (looked for {os.path.abspath(path)}); "
        f"nothing was started{hint}"
    )


def misplaced_option_error(user_script: str, known_options: list[str]) -> str | None:
    """The usage error for a "script" that is really a mistyped option, else None.

    ``colossal run`` passes unknown options after the script through to it, so a mistyped
    option *before* the script (``--nprocs_per_node 2 train.py``) would otherwise be taken for
    the script's name.

    Args:
        user_script: The first argument that was not one of ``colossal run``'s options.
        known_options: Every option string of ``colossal run`` (e.g. ``--nproc_per_node``).

    Returns:
        A message naming the option and the closest known option, or None when
        ``user_script`` does not start with ``-``.
    """
    if not user_script.startswith("-") or user_script == "-":
        return None
    name = user_script.split("=", 1)[0]
    close = difflib.get_close_matches(name, known_options, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else "see `colossal run --help` for the options"
    return (
        f"no such option: {name} ({hint}); options of `colossal run` go before the script, "
        "its own arguments after it: colossal run [OPTIONS] SCRIPT [ARGS]..."
    )


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    help="Launch a distributed job with torchrun on this node, or on several nodes over ssh.",
)
@click.option("--host", help="Comma-separated hosts to run on, e.g. host1,host2.")
@click.option("--hostfile", type=click.Path(dir_okay=False), help="File with one host per line.")
@click.option("--include", help="Only these hosts of the host list (comma-separated).")
@click.option("--exclude", help="Skip these hosts of the host list (comma-separated).")
@click.option("--num_nodes", "--num-nodes", type=int, default=-1, show_default=True,
              help="Use the first K hosts (-1: all).")  # fmt: skip
@click.option("--nproc_per_node", "--nproc-per-node", type=int, default=None,
              help="Processes per node [default: the hosts' slots, else 1].")  # fmt: skip
@click.option("--master_addr", "--master-addr", help="Rendezvous host (required for >1 node).")
@click.option("--master_port", "--master-port", type=int, default=29500, show_default=True)
@click.option("--ssh-port", "--ssh_port", type=int, default=None, help="Port of ssh on the nodes.")
@click.option("--extra_launch_args", "--extra-launch-args",
              help="More torchrun options as key=value[,key=value].")  # fmt: skip
@click.option("--stop_grace", "--stop-grace", type=float, default=STOP_GRACE, show_default=True,
              help="Seconds between SIGTERM and SIGKILL when the job is stopped.")  # fmt: skip
@click.option("-m", "module", is_flag=True, help="Run USER_SCRIPT as a module (python -m).")
@click.option("--dry_run", "--dry-run", is_flag=True,
              help="Print the commands, start nothing (the script is not checked).")  # fmt: skip
@click.argument("user_script")
@click.argument("user_args", nargs=-1, type=click.UNPROCESSED)
def run(
    host: str | None,
    hostfile: str | None,
    include: str | None,
    exclude: str | None,
    num_nodes: int,
    nproc_per_node: int | None,
    master_addr: str | None,
    master_port: int,
    ssh_port: int | None,
    extra_launch_args: str | None,
    stop_grace: float,
    module: bool,
    dry_run: bool,
    user_script: str,
    user_args: tuple[str, ...],
) -> None:
    """Click entry point of ``colossal run`` (see :func:`plan_launch`).

    The options are checked first, then (unless ``--dry_run``) that the script or module
    exists (:func:`check_user_script`); only then is any process started.
    """
    command = click.get_current_context().command
    known = [o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    error = misplaced_option_error(user_script, known)
    if error is not None:
        raise click.UsageError(error)
    try:
        plan = plan_launch(
            user_script, user_args, host=host, hostfile=hostfile, include=include,
            exclude=exclude, num_nodes=num_nodes, nproc_per_node=nproc_per_node,
            master_addr=master_addr, master_port=master_port, ssh_port=ssh_port,
            extra_launch_args=extra_launch_args, module=module, stop_grace=stop_grace,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None
    if not dry_run:
        try:
            check_user_script(user_script, module)
        except (ValueError, FileNotFoundError) as exc:
            raise click.UsageError(str(exc)) from None
    if dry_run:
        if plan.local is not None:
            click.echo(shlex.join(plan.local))
        for name, argv in plan.nodes:
            click.echo(f"[{name}] {shlex.join(argv)}")
        return
    if plan.local is not None:
        code = run_local(plan.local, stop_grace)
    else:
        code = run_nodes(plan.nodes, grace=stop_grace)
    if code != 0:
        raise SystemExit(code)
