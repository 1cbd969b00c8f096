"""Memory reports: the accelerator's memory (on CPU, the process's resident set size)."""

from __future__ import annotations

from colossal.core import get_accelerator

__all__ = ["memory_usage", "report_memory_usage"]

_GB = 1024**3


def memory_usage() -> dict[str, float]:
    """This process's memory in GB: ``allocated``, ``max_allocated`` and ``total``.

    On CUDA the values are the device's tensor memory; on CPU the process's resident set
    size, its peak and the machine's memory.
    """
    acc = get_accelerator()
    return {
        "allocated": acc.memory_allocated() / _GB,
        "max_allocated": acc.max_memory_allocated() / _GB,
        "total": acc.total_memory() / _GB,
    }


def report_memory_usage(message: str) -> str:
    """``message`` followed by :func:`memory_usage`, formatted (the peak is then reset).

    Args:
        message: What the numbers describe (e.g. ``"[Epoch 0 / Train]"``).
    """
    usage = memory_usage()
    name = get_accelerator().name
    kind = "RSS" if name == "cpu" else "allocated"
    text = (
        f"{message}: {name} {kind} {usage['allocated']:.3f} GB, "
        f"peak {usage['max_allocated']:.3f} GB of {usage['total']:.1f} GB"
    )
    get_accelerator().reset_peak_memory_stats()
    return text
