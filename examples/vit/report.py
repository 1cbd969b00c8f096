"""The outputs of a training run: the metrics JSON and the loss / accuracy curves (PNG)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__all__ = ["plot_curves", "write_metrics"]

TARGET_ACCURACY = 0.95
"""The held-out accuracy the example is expected to reach (drawn on the curves)."""


def write_metrics(metrics: dict[str, Any], path: str) -> None:
    """Write ``metrics`` as JSON to ``path`` (whole or not at all: written aside, then renamed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(metrics, fh, indent=1)
    os.replace(tmp, path)
    print(f"metrics: {path}")


def plot_curves(history: dict[str, list[float]], path: str) -> None:
    """Training / held-out loss and held-out accuracy per epoch, side by side, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    epochs = history["epoch"]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    loss_ax.plot(epochs, history["train_loss"], label="train (label-smoothed)", marker=".")
    loss_ax.plot(epochs, history["val_loss"], label="held-out", marker=".")
    loss_ax.set_yscale("log")
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("cross-entropy")
    loss_ax.legend()
    acc_ax.plot(epochs, history["val_accuracy"], label="held-out", marker=".", color="C1")
    acc_ax.axhline(TARGET_ACCURACY, color="grey", linestyle="--", label=f"{TARGET_ACCURACY:.2f}")
    acc_ax.set_ylim(0.0, 1.0)
    acc_ax.set_xlabel("epoch")
    acc_ax.set_ylabel("accuracy")
    acc_ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"curves: {path}")
