"""colossal-cli: the ``colossal`` command (``run``, ``check -i``, ``benchmark``).

The command-line entry point is :func:`colossal.cli.main.main`. The launcher's building blocks
are public so scripts and tests can build the exact commands without starting anything.
"""

from colossal.cli.__about__ import __version__
from colossal.cli.hostfile import HostInfo, filter_hosts, parse_host_list, parse_hostfile
from colossal.cli.launch_command import LaunchSpec, build_node_commands, build_torchrun_command

__all__ = [
    "HostInfo",
    "LaunchSpec",
    "__version__",
    "build_node_commands",
    "build_torchrun_command",
    "filter_hosts",
    "parse_host_list",
    "parse_hostfile",
]
