"""Whether ``torch._scaled_mm`` runs on a device: a tiny probe call, its answer cached."""

from __future__ import annotations

import functools

import torch

__all__ = ["fp8_matmul_missing"]


def fp8_matmul_missing(device: torch.device | str | None = None) -> str | None:
    """What ``device`` lacks for float8 matmuls (``torch._scaled_mm``), or None where they run.

    Runs one 16x16 e4m3 x e4m3 and one e5m2 x e4m3 product (the forward's and the backward's
    operand types) on ``device`` (default: the CPU) and caches the answer per device.

    Raises:
        ValueError: ``device`` is not a device name torch understands.
    """
    try:
        dev = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"fp8_matmul_missing(device={device!r}): not a torch device; pass e.g. 'cpu' "
            "or 'cuda:0'"
        ) from exc
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return _probe(str(dev))


@functools.cache
def _probe(device: str) -> str | None:
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return f"{device} is not available (torch.cuda.is_available() is False)"
    try:
        one = torch.ones((), device=dev)
        a = torch.ones(16, 16, device=dev)
        b = torch.ones(16, 16, device=dev).t()  # column-major second operand
        for first in (torch.float8_e4m3fn, torch.float8_e5m2):
            out = torch._scaled_mm(
                a.to(first),
                b.to(torch.float8_e4m3fn),
                scale_a=one,
                scale_b=one,
                out_dtype=torch.float32,
            )
            if not bool((out == 16).all()):
                return f"torch._scaled_mm on {device} gave a wrong 16x16 product"
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if dev.type == "cuda":
            major, minor = torch.cuda.get_device_capability(dev)
            name = torch.cuda.get_device_name(dev)
            return (
                f"torch._scaled_mm fails on {device} ({name!r}, compute capability "
                f"{major}.{minor}; float8 needs 8.9+): {detail}"
            )
        return f"torch._scaled_mm fails on {device}: {detail}"
    return None
