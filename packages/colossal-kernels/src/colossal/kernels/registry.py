"""Kernel registry: ranked implementations per kernel, picked by availability.

Every kernel (``"cpu_adam"``, ``"fused_adam"``, ``"layer_norm"``, ...) has implementations
ranked by priority, each with an availability check (device, compiler, optional package) and
a loader. :meth:`KernelRegistry.get` returns the best implementation that is available and
loads; when a better one is missing or fails to build, the next one is used and a single
warning says why. Nothing is built or imported until first use.

:func:`kernel_report` says which implementation each kernel uses on a device and why; this is
what ``colossal check`` prints (via :func:`format_kernel_report`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from colossal.core import get_logger, warn_once

logger = get_logger(__name__)


@dataclass(frozen=True)
class Availability:
    """Outcome of an implementation's availability check.

    Attributes:
        ok: Whether the implementation can be used.
        reason: Why (shown in the report and in fallback warnings).
        degraded: Whether not being able to use it is worth a warning (a missing compiler or
            package is; an implementation for another device type is not).
    """

    ok: bool
    reason: str
    degraded: bool = False


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of a kernel.

    Attributes:
        name: Short name, unique within the kernel (``"cpp"``, ``"triton"``, ``"torch"``).
        priority: Higher wins among available implementations.
        check: ``check(device_type) -> Availability``; must be cheap and must not build.
        load: ``load() -> object``; builds or imports the implementation (may raise, in which
            case the next implementation is used).
        description: One line for the report.
    """

    name: str
    priority: int
    check: Callable[[str], Availability]
    load: Callable[[], Any]
    description: str = ""


@dataclass(frozen=True)
class KernelStatus:
    """One row of :func:`kernel_report`.

    Attributes:
        kernel: Kernel name.
        device: Device type the row is about.
        implementation: The implementation in use (or that will be used at first call).
        reason: Why it was chosen, and why better ones were not.
        loaded: Whether it has been loaded (built/imported) in this process.
        candidates: Every implementation, best first, as ``"name: reason"``.
    """

    kernel: str
    device: str
    implementation: str
    reason: str
    loaded: bool
    candidates: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class _Selected:
    impl: KernelImpl
    obj: Any
    reason: str


class KernelRegistry:
    """Implementations of kernels, chosen by priority and availability.

    Example:
        >>> reg = KernelRegistry()
        >>> reg.register("double", KernelImpl("torch", 0, lambda d: Availability(True, "ok"),
        ...                                   lambda: (lambda x: 2 * x)))
        >>> reg.get("double", "cpu")(3)
        6
    """

    def __init__(self) -> None:
        self._impls: dict[str, list[KernelImpl]] = {}
        self._default_devices: dict[str, tuple[str, ...]] = {}
        self._selected: dict[tuple[str, str], _Selected] = {}
        self._failed: dict[tuple[str, str], str] = {}
        self._forced: dict[str, str] = {}
        self._lock = threading.RLock()

    def register(self, kernel: str, impl: KernelImpl, devices: tuple[str, ...] = ()) -> None:
        """Add ``impl`` to ``kernel``.

        Args:
            kernel: Kernel name.
            impl: The implementation.
            devices: Device types the report lists this kernel for (default: the current
                accelerator's device type).

        Raises:
            ValueError: ``kernel`` already has an implementation called ``impl.name``.
        """
        with self._lock:
            impls = self._impls.setdefault(kernel, [])
            if any(i.name == impl.name for i in impls):
                raise ValueError(f"kernel {kernel!r} already has an implementation {impl.name!r}")
            impls.append(impl)
            impls.sort(key=lambda i: -i.priority)
            if devices:
                self._default_devices[kernel] = devices
            self._selected = {k: v for k, v in self._selected.items() if k[0] != kernel}

    def kernels(self) -> list[str]:
        """Names of all registered kernels."""
        return sorted(self._impls)

    def implementations(self, kernel: str) -> list[KernelImpl]:
        """Implementations of ``kernel``, best first."""
        return list(self._impls_of(kernel))

    def _impls_of(self, kernel: str) -> list[KernelImpl]:
        if kernel not in self._impls:
            raise ValueError(f"unknown kernel {kernel!r}; registered kernels: {self.kernels()}")
        return self._impls[kernel]

    def get(self, kernel: str, device: str | torch.device = "cpu") -> Any:
        """The loaded best available implementation of ``kernel`` for ``device``.

        Implementations that are unavailable, or whose loader raises, are skipped; if a
        skipped one was better than the chosen one for a reason worth knowing (missing
        compiler or package, failed build), one warning is logged.

        Raises:
            ValueError: Unknown kernel, or a forced implementation that is unavailable.
            RuntimeError: No implementation is available (cannot happen for the built-in
                kernels, which all end in a pure-torch implementation).
        """
        device_type = device.type if isinstance(device, torch.device) else str(device)
        key = (kernel, device_type)
        selected = self._selected.get(key)
        if selected is not None and self._forced.get(kernel) in (None, selected.impl.name):
            return selected.obj
        with self._lock:
            return self._select(kernel, device_type).obj

    def _select(self, kernel: str, device_type: str) -> _Selected:
        key = (kernel, device_type)
        forced = self._forced.get(kernel)
        skipped: list[str] = []
        warn = False
        for impl in self._impls_of(kernel):
            if forced is not None and impl.name != forced:
                continue
            avail = self._availability(kernel, impl, device_type)
            if not avail.ok:
                skipped.append(f"{impl.name}: {avail.reason}")
                warn = warn or avail.degraded
                continue
            try:
                obj = impl.load()
            except Exception as exc:  # noqa: BLE001 - any build/import failure degrades
                msg = f"failed to load: {type(exc).__name__}: {str(exc).strip()[:500]}"
                self._failed[(kernel, impl.name)] = msg
                skipped.append(f"{impl.name}: {msg}")
                warn = True
                continue
            reason = avail.reason if not skipped else f"{avail.reason} ({'; '.join(skipped)})"
            if warn and forced is None:
                warn_once(
                    logger, "colossal.kernels: %s on %s uses the %r implementation because a "
                    "better one is unavailable: %s", kernel, device_type, impl.name,
                    "; ".join(skipped),
                )
            selected = _Selected(impl, obj, reason)
            if forced is None:
                self._selected[key] = selected
            return selected
        if forced is not None:
            raise ValueError(
                f"implementation {forced!r} of kernel {kernel!r} is not usable on "
                f"{device_type}: {'; '.join(skipped) or 'no such implementation'}; choose one "
                f"of {[i.name for i in self._impls_of(kernel)]}"
            )
        raise RuntimeError(f"no implementation of {kernel!r} works on {device_type}: {skipped}")

    def _availability(self, kernel: str, impl: KernelImpl, device_type: str) -> Availability:
        failed = self._failed.get((kernel, impl.name))
        if failed is not None:
            return Availability(False, failed, degraded=True)
        try:
            return impl.check(device_type)
        except Exception as exc:  # noqa: BLE001 - a broken check means unavailable
            return Availability(False, f"availability check raised {exc!r}", degraded=True)

    def status(self, kernel: str, device: str | torch.device) -> KernelStatus:
        """Which implementation ``kernel`` uses (or will use) on ``device``, without loading.

        The choice assumes the best available implementation loads; an implementation that
        already failed to load in this process is reported as such.
        """
        device_type = device.type if isinstance(device, torch.device) else str(device)
        with self._lock:
            candidates = []
            chosen: tuple[str, str] | None = None
            skipped: list[str] = []
            for impl in self._impls_of(kernel):
                avail = self._availability(kernel, impl, device_type)
                state = "available" if avail.ok else "unavailable"
                candidates.append(f"{impl.name} [{state}]: {avail.reason}")
                if chosen is None and avail.ok:
                    why = avail.reason if not skipped else f"{avail.reason} ({'; '.join(skipped)})"
                    chosen = (impl.name, why)
                elif chosen is None:
                    skipped.append(f"{impl.name}: {avail.reason}")
            selected = self._selected.get((kernel, device_type))
            if selected is not None:
                chosen = (selected.impl.name, selected.reason)
            name, reason = chosen or ("none", "; ".join(skipped))
            return KernelStatus(kernel, device_type, name, reason, selected is not None,
                                tuple(candidates))

    def default_devices(self, kernel: str) -> tuple[str, ...]:
        """Device types the report lists ``kernel`` for."""
        return self._default_devices.get(kernel, ())

    @contextlib.contextmanager
    def force(self, kernel: str, implementation: str) -> Iterator[None]:
        """Use ``implementation`` for ``kernel`` inside the block (tests, benchmarks).

        Raises:
            ValueError: Unknown kernel or implementation name.
        """
        names = [i.name for i in self._impls_of(kernel)]
        if implementation not in names:
            raise ValueError(
                f"kernel {kernel!r} has no implementation {implementation!r}; choose from {names}"
            )
        with self._lock:
            previous = self._forced.get(kernel)
            self._forced[kernel] = implementation
        try:
            yield
        finally:
            with self._lock:
                if previous is None:
                    self._forced.pop(kernel, None)
                else:
                    self._forced[kernel] = previous

    def reset(self, kernel: str | None = None) -> None:
        """Forget choices and load failures (of ``kernel``, or of all kernels)."""
        with self._lock:
            self._selected = {k: v for k, v in self._selected.items()
                              if kernel is not None and k[0] != kernel}
            self._failed = {k: v for k, v in self._failed.items()
                            if kernel is not None and k[0] != kernel}


REGISTRY = KernelRegistry()
"""The registry every colossal.kernels operator dispatches through."""


def kernel_report(device: str | torch.device | None = None) -> list[KernelStatus]:
    """Which implementation each kernel uses and why; nothing is built or imported.

    Args:
        device: Report for this device type only. By default each kernel is reported for the
            device types it serves (``cpu_adam`` on the CPU; the others on the CPU and, when
            present, on the current accelerator).

    Returns:
        One :class:`KernelStatus` per kernel and device type.
    """
    from colossal.core.accelerator import get_accelerator

    accel = get_accelerator().get_current_device().type
    rows: list[KernelStatus] = []
    for kernel in REGISTRY.kernels():
        if device is not None:
            devices: tuple[str, ...] = (
                device.type if isinstance(device, torch.device) else str(device),
            )
        else:
            devices = REGISTRY.default_devices(kernel) or tuple(dict.fromkeys(("cpu", accel)))
        rows.extend(REGISTRY.status(kernel, d) for d in devices)
    return rows


def format_kernel_report(rows: list[KernelStatus] | None = None) -> str:
    """:func:`kernel_report` as a markdown table (what ``colossal check`` prints)."""
    rows = kernel_report() if rows is None else rows
    lines = ["| kernel | device | implementation | loaded | why |", "|---|---|---|---|---|"]
    for r in rows:
        why = r.reason.replace("|", "/")
        lines.append(f"| {r.kernel} | {r.device} | {r.implementation} | "
                     f"{'yes' if r.loaded else 'no'} | {why} |")
    return "\n".join(lines)
