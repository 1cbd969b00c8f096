"""Comparisons used by tests: relative error with a readable failure message."""

from __future__ import annotations

import torch


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / max(||expected||, tiny)`` in float64."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    denom = max(float(torch.linalg.vector_norm(e)), 1e-30)
    return float(torch.linalg.vector_norm(a - e)) / denom


def assert_rel_close(
    actual: torch.Tensor, expected: torch.Tensor, rtol: float, name: str = "tensor"
) -> None:
    """Fail when the relative error of ``actual`` exceeds ``rtol``."""
    err = relative_error(actual, expected)
    if not err <= rtol:
        raise AssertionError(f"{name}: relative error {err:.3e} exceeds {rtol:.1e}")
