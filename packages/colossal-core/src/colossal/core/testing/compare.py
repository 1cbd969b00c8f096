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


def assert_close_loose(
    a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-3, atol: float = 1e-3
) -> None:
    """``torch.testing.assert_close`` with ColossalAI's loose defaults (``1e-3`` both)."""
    torch.testing.assert_close(
        a,
        b,
        rtol=rtol,
        atol=atol,
        msg=lambda m: (
            f"{m}\n(shapes {tuple(a.shape)} vs {tuple(b.shape)}, dtypes {a.dtype} vs {b.dtype})"
        ),
    )


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Fail unless every element of ``a`` equals ``b``'s."""
    if not bool(torch.all(a == b)):
        raise AssertionError(f"expected a and b to be equal but they are not: {a} vs {b}")


def assert_not_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Fail when every element of ``a`` equals ``b``'s."""
    if bool(torch.all(a == b)):
        raise AssertionError(f"expected a and b to differ but they are equal: {a}")
