"""Helpers every benchmark script shares: machine facts, the markdown table, the JSON file."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Sequence
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """Facts about this machine worth recording next to a measurement."""
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
    }


def goal(name: str, value: float, target: str, met: bool) -> dict[str, Any]:
    """One goal line of the JSON output."""
    return {"name": name, "value": value, "target": target, "met": bool(met)}


def spread(kind: str, values: Sequence[float]) -> dict[str, float]:
    """``{kind}_s`` (median), ``{kind}_min_s`` and ``{kind}_max_s`` of ``values`` (if any)."""
    if not values:
        return {}
    return {f"{kind}_s": statistics.median(values), f"{kind}_min_s": min(values),
            f"{kind}_max_s": max(values)}


def paired_median(base: Sequence[float], other: Sequence[float]) -> float:
    """Median over rounds of ``base``'s time over ``other``'s in the same round (``other``'s
    speed relative to ``base``'s; rounds missing from either are left out), NaN if none."""
    pairs = [b / o for b, o in zip(base, other, strict=False) if o]
    return statistics.median(pairs) if pairs else float("nan")


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """Rows as a markdown table with the given columns."""

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(
    path: str | None, name: str, rows: list[dict[str, Any]], goals: list[dict[str, Any]]
) -> None:
    """Write the benchmark's JSON record when ``path`` is given."""
    if not path:
        return
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(
            {"benchmark": name, "machine": machine(), "rows": rows, "goals": goals}, fh, indent=2
        )
