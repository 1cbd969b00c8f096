"""Host lists for multi-node launches: ``--host h1,h2`` and ``--hostfile FILE``.

A hostfile has one host per line, optionally followed by its slot count (the number of
processes to start on it), written ``host slots=N`` or ``host:N``. ``#`` starts a comment;
blank lines are ignored::

    # two 8-GPU nodes
    node1 slots=8
    node2:8
    fe80::1 slots=8

A host name contains no ``:`` (an IPv6 address is taken whole, so give its slots as
``slots=N``); anything else, such as ``host2:4:5``, is an error naming its line.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostInfo", "filter_hosts", "parse_host_list", "parse_hostfile"]

_HOST_RE = re.compile(r"^[A-Za-z0-9_.\-\[\]:@]+$")
_SLOTS_RE = re.compile(r"^slots=(\d+)$")
_FORMS = "expected 'host', 'host slots=N' or 'host:N'"


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class HostInfo:
    """One node of a job.

    Attributes:
        hostname: Name or address ssh connects to.
        slots: Processes to start there; None means "use ``--nproc_per_node``".
    """

    hostname: str
    slots: int | None = None

    def __post_init__(self) -> None:
        if not self.hostname or not _HOST_RE.match(self.hostname):
            raise ValueError(f"invalid host name {self.hostname!r}")
        if ":" in self.hostname and not _is_ipv6(self.hostname):
            raise ValueError(
                f"invalid host name {self.hostname!r}: only an IPv6 address may contain ':'; "
                f"{_FORMS}"
            )
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"host {self.hostname!r}: slots must be >= 1, got {self.slots}")


def _host_and_slots(token: str) -> HostInfo:
    """``host``, ``host:N`` or a whole IPv6 address."""
    if ":" not in token or _is_ipv6(token):
        return HostInfo(token)
    name, _, slots = token.partition(":")
    if name and ":" not in slots and slots.isdigit():
        return HostInfo(name, int(slots))
    raise ValueError(
        f"{_FORMS}, got {token!r} (after 'host:' comes one whole number, the slot count; "
        "an IPv6 address takes its slots as 'slots=N')"
    )


def _parse_line(text: str) -> HostInfo:
    parts = text.split()
    if len(parts) == 1:
        return _host_and_slots(parts[0])
    if len(parts) == 2:
        found = _SLOTS_RE.match(parts[1])
        if found is None:
            raise ValueError(f"expected 'slots=N' after the host name, got {parts[1]!r}")
        return HostInfo(parts[0], int(found.group(1)))
    raise ValueError(f"{_FORMS}, got {text!r}")


def parse_hostfile(path: str | Path) -> list[HostInfo]:
    """Read a hostfile.

    Args:
        path: The file (see the module docstring for the format).

    Returns:
        The hosts in file order.

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: Malformed or duplicated lines (every bad line is listed with its number),
            or the file lists no host.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"hostfile {str(path)!r} does not exist")
    hosts: list[HostInfo] = []
    errors: list[str] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            host = _parse_line(text)
        except ValueError as exc:
            shown = "" if repr(text) in str(exc) else f" (line: {text!r})"
            errors.append(f"  line {number}: {exc}{shown}")
            continue
        if host.hostname in seen:
            errors.append(
                f"  line {number}: host {host.hostname!r} already listed on line "
                f"{seen[host.hostname]}"
            )
            continue
        seen[host.hostname] = number
        hosts.append(host)
    if errors:
        raise ValueError(f"malformed hostfile {str(path)!r}:\n" + "\n".join(errors))
    if not hosts:
        raise ValueError(f"hostfile {str(path)!r} lists no host; write one host name per line")
    return hosts


def parse_host_list(text: str) -> list[HostInfo]:
    """Parse ``--host h1,h2`` (entries may be ``host:N`` to give a slot count).

    Raises:
        ValueError: An empty, malformed or repeated entry.
    """
    names = [t.strip() for t in text.split(",")]
    if not all(names):
        raise ValueError(f"--host {text!r} has an empty entry; write --host host1,host2")
    hosts = []
    for name in names:
        try:
            hosts.append(_parse_line(name))
        except ValueError as exc:
            raise ValueError(f"--host {text!r}: {exc}") from None
    dupes = sorted({h.hostname for h in hosts if [x.hostname for x in hosts].count(h.hostname) > 1})
    if dupes:
        raise ValueError(f"--host {text!r} lists {', '.join(dupes)} more than once")
    return hosts


def _names(text: str | None, option: str) -> list[str]:
    if text is None:
        return []
    names = [t.strip() for t in text.split(",")]
    if not all(names):
        raise ValueError(f"{option} {text!r} has an empty entry; write {option} host1,host2")
    return names


def filter_hosts(
    hosts: list[HostInfo], include: str | None = None, exclude: str | None = None
) -> list[HostInfo]:
    """Keep the hosts named by ``include`` (comma-separated), then drop those in ``exclude``.

    Raises:
        ValueError: Both are given, a named host is not in the list, or nothing is left.
    """
    if include is not None and exclude is not None:
        raise ValueError("--include and --exclude cannot be used together; pick one")
    known = [h.hostname for h in hosts]
    for option, text in (("--include", include), ("--exclude", exclude)):
        unknown = [n for n in _names(text, option) if n not in known]
        if unknown:
            raise ValueError(
                f"{option} names {', '.join(unknown)}, which the host list does not contain "
                f"(known hosts: {', '.join(known)})"
            )
    if include is not None:
        wanted = set(_names(include, "--include"))
        hosts = [h for h in hosts if h.hostname in wanted]
    if exclude is not None:
        dropped = set(_names(exclude, "--exclude"))
        hosts = [h for h in hosts if h.hostname not in dropped]
    if not hosts:
        raise ValueError("--exclude removed every host; nothing is left to run on")
    return hosts
