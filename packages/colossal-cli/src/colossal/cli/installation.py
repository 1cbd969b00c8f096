"""What ``colossal check -i`` inspects: versions, version-range agreement, accelerator.

Every function returns plain data; :mod:`colossal.cli.check_command` renders it.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

__all__ = [
    "AcceleratorInfo",
    "DistInfo",
    "RangeCheck",
    "accelerator_info",
    "check_ranges",
    "colossal_distributions",
    "runtime_versions",
]


@dataclass(frozen=True)
class DistInfo:
    """One installed colossal distribution.

    Attributes:
        name: Canonical distribution name, e.g. ``"colossal-core"``.
        version: Installed version.
        requires: Its requirements (``Requires-Dist``) without extras-only ones.
    """

    name: str
    version: str
    requires: tuple[str, ...]


@dataclass(frozen=True)
class RangeCheck:
    """Whether one declared requirement is met by what is installed.

    Attributes:
        dist: The distribution declaring the requirement.
        requirement: The requirement, e.g. ``"colossal-core>=0.1,<0.2"``.
        installed: The installed version of the required distribution, or None.
        ok: Whether the installed version satisfies the requirement.
    """

    dist: str
    requirement: str
    installed: str | None
    ok: bool


@dataclass(frozen=True)
class AcceleratorInfo:
    """The accelerator Colossal will use in this process.

    Attributes:
        name: Accelerator name (``"cpu"``, ``"cuda"``).
        device: The current device, e.g. ``"cuda:0"``.
        device_count: Devices visible.
        backend: Communication backend it picks.
        backend_available: Whether torch.distributed has that backend.
        error: Why the accelerator could not be queried, or None.
    """

    name: str
    device: str
    device_count: int
    backend: str
    backend_available: bool
    error: str | None = None


def _is_colossal(name: str) -> bool:
    name = canonicalize_name(name)
    return name == "colossal" or name.startswith("colossal-")


def colossal_distributions() -> list[DistInfo]:
    """Every installed distribution named ``colossal`` or ``colossal-*``, sorted by name."""
    found: dict[str, DistInfo] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or not _is_colossal(name):
            continue
        reqs = []
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                reqs.append(text)
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                reqs.append(str(req))
        found.setdefault(canonicalize_name(name), DistInfo(canonicalize_name(name),
                                                           dist.version, tuple(reqs)))  # fmt: skip
    return [found[k] for k in sorted(found)]


def _installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_ranges(dists: list[DistInfo]) -> list[RangeCheck]:
    """Check each distribution's requirements on colossal siblings and torch.

    A missing required sibling or a version outside the declared range is a failed check.
    """
    out = []
    for dist in dists:
        for text in dist.requires:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                out.append(RangeCheck(dist.name, text, None, False))
                continue
            if not (_is_colossal(req.name) or canonicalize_name(req.name) == "torch"):
                continue
            installed = _installed_version(req.name)
            ok = False
            if installed is not None:
                try:
                    ok = req.specifier.contains(Version(installed), prereleases=True)
                except InvalidVersion:
                    ok = False
            out.append(RangeCheck(dist.name, str(req), installed, ok))
    return out


def runtime_versions() -> dict[str, str]:
    """Python, torch and (if torch was built with it) CUDA versions."""
    import torch

    info = {
        "python": f"{platform.python_version()} ({platform.python_implementation()})",
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda or "none (CPU build)",
    }
    if torch.cuda.is_available():
        info["cuda devices"] = ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        )
    else:
        info["cuda devices"] = "none"
    return info


def _backend_available(backend: str) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    checks = {"gloo": dist.is_gloo_available, "nccl": dist.is_nccl_available,
              "mpi": dist.is_mpi_available}  # fmt: skip
    check = checks.get(backend)
    return bool(check()) if check is not None else backend in dist.Backend.backend_list


def accelerator_info() -> AcceleratorInfo:
    """Query :func:`colossal.core.get_accelerator` (errors are captured, not raised)."""
    from colossal.core import get_accelerator

    try:
        accel = get_accelerator()
        backend = accel.communication_backend
        return AcceleratorInfo(
            accel.name, str(accel.get_current_device()), accel.device_count(), backend,
            _backend_available(backend),
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported to the user, who needs to see it
        return AcceleratorInfo("?", "?", 0, "?", False, f"{type(exc).__name__}: {exc}")
