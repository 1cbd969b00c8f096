"""``linear_fp8`` against fp32 ``F.linear``, and the ``torch._scaled_mm`` probe.

The bound, per output element: e4m3 keeps 3 mantissa bits, so a quantized operand is within a
relative ``2**-4`` of its value (round to nearest); a product of two is within
``(1 + 2**-4)**2 - 1 < 2 * 2**-4 + 2**-8``, and a sum of products within that times
``sum |x_k w_k|``. The backward's output gradient is e5m2 (2 mantissa bits, ``2**-3``):
``2**-3 + 2**-4 + 2**-7`` per term. Values below the formats' smallest normal (``2**-6`` resp.
``2**-14`` times the scale) round in absolute steps; ``ABS`` covers them. A missing scale
(operands scaled to amax 448 but not scaled back: off by ``1/scale``, here > 10x) or a
wrong layout (the weight read as ``(in, out)``: unrelated products) exceeds the bound at many
elements; the test checks both faults do.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from colossal.kernels.fp8 import fp8_matmul_missing, linear_fp8

FWD_REL = 2 * 2**-4 + 2**-8
BWD_REL = 2**-3 + 2**-4 + 2**-7


def _bound(a: torch.Tensor, b: torch.Tensor, rel: float) -> torch.Tensor:
    """``rel * (|a| @ |b|)`` plus the subnormal absolute steps of both operands."""
    k = a.shape[-1]
    tiny = 2 * k * a.abs().max() * b.abs().max() * 2**-16
    return rel * (a.abs() @ b.abs()) + tiny


def _data(m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x = torch.randn(m, k, generator=g) * 3.0  # amax far from 448: the scales matter
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g)
    return x, w, b


def test_probe_on_cpu() -> None:
    """Catches a probe that refuses a device where torch._scaled_mm runs, or accepts nonsense."""
    assert fp8_matmul_missing("cpu") is None
    with pytest.raises(ValueError, match="not a torch device"):
        fp8_matmul_missing("no-such-device")


def test_probe_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a probe that passes without torch._scaled_mm, hides a failing call's reason, or
    answers for one device with another's cached result."""
    from colossal.kernels.fp8 import probe

    probe._probe.cache_clear()
    monkeypatch.delattr(torch, "_scaled_mm")
    assert "has no torch._scaled_mm" in str(fp8_matmul_missing("cpu"))
    probe._probe.cache_clear()

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("float8 kernels need sm89\nmore detail")

    monkeypatch.setattr(torch, "_scaled_mm", broken, raising=False)
    assert fp8_matmul_missing("cpu") == "torch._scaled_mm fails on cpu: float8 kernels need sm89"
    probe._probe.cache_clear()
    monkeypatch.undo()
    assert fp8_matmul_missing("cpu") is None
    if not torch.cuda.is_available():
        assert "not available" in str(fp8_matmul_missing("cuda:0"))


@pytest.mark.parametrize("shape", [(32, 64, 48), (7, 40, 24)])  # aligned; padded to 16
def test_forward_within_bound(shape: tuple[int, int, int]) -> None:
    """Catches a missing or inverted scale, a transposed weight, padding that leaks into the
    result, and an output not in x's dtype (each checked to break the bound or dtype)."""
    m, k, n = shape
    x, w, b = _data(m, k, n)
    ref = F.linear(x.double(), w.double()).float()
    bound = _bound(x, w.t(), FWD_REL)
    y = linear_fp8(x, w, b) - b
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert bool(((y - ref).abs() <= bound).all()), float(((y - ref).abs() / bound).max())
    # The faults the bound must catch: a dropped input scale, a weight read as (in, out).
    scale_x = x.abs().max() / 448
    assert not bool(((y / scale_x - ref).abs() <= bound).all())
    wrong = linear_fp8(x, w.reshape(k, n).t().contiguous())
    assert not bool(((wrong - ref).abs() <= bound).all())
    y16 = linear_fp8(x.bfloat16(), w.bfloat16())
    assert y16.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(32, 64, 48), (2, 5, 40, 24)])
def test_gradients_within_bound(shape: tuple[int, ...]) -> None:
    """Catches grad_input/grad_weight without the gradient's scale, a gradient transposed or
    multiplied with the wrong operand, lost leading dims, and a wrong bias gradient."""
    *lead, k, n = shape
    x, w, b = _data(int(torch.tensor(lead).prod()), k, n)
    x = x.reshape(*lead, k).requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(*lead, n, generator=gen) * 1e-3
    gx, gw, gb = torch.autograd.grad(linear_fp8(x, w, b), (x, w, b), grad)
    g2, x2 = grad.reshape(-1, n).double(), x.detach().reshape(-1, k).double()
    ref_x = (g2 @ w.detach().double()).float().reshape(*lead, k)
    ref_w = (g2.t() @ x2).float()
    bound_x = _bound(grad.reshape(-1, n), w.detach(), BWD_REL).reshape(*lead, k)
    bound_w = _bound(grad.reshape(-1, n).t(), x.detach().reshape(-1, k), BWD_REL)
    assert gx.shape == x.shape and gw.shape == w.shape
    assert bool(((gx - ref_x).abs() <= bound_x).all())
    assert bool(((gw - ref_w).abs() <= bound_w).all())
    torch.testing.assert_close(gb, grad.reshape(-1, n).sum(0))
    scale_g = grad.abs().max() / 57344
    assert not bool(((gx / scale_g - ref_x).abs() <= bound_x).all())
    assert not bool(((gw.t().reshape(n, k) - ref_w).abs() <= bound_w).all())


def test_bad_input() -> None:
    """Catches shapes that do not chain accepted (a silent wrong matmul) and integer input."""
    with pytest.raises(ValueError, match="do not chain"):
        linear_fp8(torch.ones(4, 8), torch.ones(8, 4))
    with pytest.raises(TypeError, match="floating"):
        linear_fp8(torch.ones(4, 8, dtype=torch.long), torch.ones(8, 8))
