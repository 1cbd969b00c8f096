"""Presenting benchmark rows: a rich table, a JSON document and an optional PNG chart."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from rich.table import Table

__all__ = [
    "COLUMNS",
    "build_table",
    "format_bytes",
    "json_document",
    "table_cells",
    "write_chart",
    "write_json",
]

#: Table header, in order.
COLUMNS = ("configuration", "step time", "tokens/s", "model state / rank", "comm / step",
           "status")  # fmt: skip


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _status(row: dict[str, Any]) -> str:
    if row["status"] == "ok":
        return "ok"
    return f"{row['status']}: {row.get('error') or 'unknown error'}"


def table_cells(row: dict[str, Any]) -> list[str]:
    """The table's cells for one row (plain text)."""
    ok = row["status"] == "ok"
    comm = row.get("comm_bytes_per_step")
    comm_text = format_bytes(comm) if comm is not None else ("not tracked" if ok else "-")
    return [
        row["name"],
        f"{row['step_time_s'] * 1000:.1f} ms" if ok else "-",
        f"{row['tokens_per_s']:,.0f}" if ok else "-",
        format_bytes(row.get("peak_model_state_bytes")),
        comm_text,
        _status(row),
    ]


def build_table(rows: list[dict[str, Any]], title: str = "colossal benchmark") -> Table:
    """A rich table with one line per configuration."""
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("configuration", "status") else "right",
                         overflow="fold")  # fmt: skip
    for row in rows:
        style = None if row["status"] == "ok" else "red"
        table.add_row(*table_cells(row), style=style)
    return table


def json_document(rows: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The ``--output`` JSON (the repository's benchmark layout, no goals)."""
    import torch

    machine = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    return {"benchmark": "colossal benchmark", "machine": machine, "settings": settings,
            "rows": rows, "goals": []}  # fmt: skip


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write ``doc`` to ``path`` (parent directories are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def write_chart(path: str | Path, rows: list[dict[str, Any]]) -> Path | str:
    """Bar charts of tokens/s and model state per rank for the successful rows.

    Returns:
        The PNG path, or a message saying why no chart was written.
    """
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return "no chart: no configuration succeeded"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install 'colossal-cli[plot]')"
    names = [r["name"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.2 * len(ok) * 2), 4))
    ax1.bar(names, [r["tokens_per_s"] for r in ok], color="tab:blue")
    ax1.set_title("tokens/s (higher is better)")
    ax2.bar(names, [r["peak_model_state_bytes"] / 2**20 for r in ok], color="tab:orange")
    ax2.set_title("peak model state per rank, MiB")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
