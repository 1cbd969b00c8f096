"""Tiled causal flash attention on CPU against the kernel's own causal call and eager attention.

What each check catches:

* outputs and log-sum-exps equal to ``aten._scaled_dot_product_flash_attention_for_cpu(...,
  is_causal=True)`` and to an fp64 eager reference, for 512 / 768 / 1024 / 2048 tokens: a
  wrong level offset (an odd query block paired with the wrong key block, or a level
  skipped) or a wrong log-sum-exp merge changes outputs and ``lse``;
* ``dq``/``dk``/``dv`` equal to the kernel's causal backward: a piece's gradient copied over
  instead of added (the missing ``dk``/``dv`` accumulation), or the wrong ``lse`` slice
  handed to a piece;
* grouped-query key/value heads (``H = 4``, ``Hk = 2``): query head ``i`` must read key head
  ``i // 2`` (a wrong head mapping or a ``dk`` not summed over the group);
* memory layouts other than ``(B, S, H, D)`` (copied once) and ``B = 1`` contiguous (views);
* bf16 / fp16: within a stated tolerance of the fp64 reference, and no worse than twice the
  kernel's own error there;
* ``attention(..., "causal")`` takes the tiled path when it tiles (patched counter), with
  gradients equal to eager attention; lengths that do not tile, short sequences, dropout and
  dense masks go to SDPA unchanged (same values).
"""

from __future__ import annotations

import math

import pytest
import torch

from colossal.kernels.attention import (
    attention,
    causal_block_size,
    causal_flash_attention,
    causal_flash_backward,
    causal_flash_forward,
    tiled_causal_block,
    tiled_causal_supported,
)
from colossal.kernels.attention import sdpa as sdpa_mod

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
D = 16


def _make(b: int, h: int, s: int, layout: str, dtype: torch.dtype = torch.float32,
          seed: int = 0) -> torch.Tensor:
    """``[B, H, S, D]`` with the given memory layout (``bshd``, ``bhsd`` or ``sbhd``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, D, generator=g).to(dtype)
    if layout == "bshd":
        return x.transpose(1, 2)
    if layout == "bhsd":
        return x.transpose(1, 2).contiguous()
    return x.transpose(0, 1).contiguous().transpose(0, 1).transpose(1, 2)  # (S, B, H, D)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 causal attention: ``(out, lse)``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.shape[2]
    scores = q.double() @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


CASES = [  # (B, H, Hk, S, layout)
    (2, 4, 2, 512, "bhsd"),   # GQA; B > 1 contiguous: copied into (B, S, H, D)
    (2, 4, 2, 512, "sbhd"),   # another layout, copied
    (1, 4, 2, 768, "bhsd"),   # blocks of 96; B = 1 contiguous: views
    (1, 4, 2, 1024, "bshd"),  # the layout transformers' attention modules produce
    (1, 2, 1, 2048, "bshd"),  # the Ulysses per-rank shape (multi-query)
]


@pytest.mark.parametrize("b,h,hk,s,layout", CASES)
def test_equals_kernel_causal_call(b: int, h: int, hk: int, s: int, layout: str) -> None:
    q, k, v = _make(b, h, s, layout, seed=1), _make(b, hk, s, layout, seed=2), \
        _make(b, hk, s, layout, seed=3)
    dout = _make(b, h, s, layout, seed=4)
    scale = D ** -0.5
    assert tiled_causal_supported(q, k, v)
    out, lse = causal_flash_forward(q, k, v, scale)
    ref_out, ref_lse = FWD(q, k, v, 0.0, True, scale=scale)
    tol = {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    want_out, want_lse = _eager(q, k, v, scale)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    got = causal_flash_backward(dout, q, k, v, out, lse, scale)
    want = BWD(dout, q, k, v, ref_out, ref_lse, 0.0, True, scale=scale)
    for name, a, w, x in zip("qkv", got, want, (q, k, v), strict=True):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    """Outputs and gradients within 2x the kernel's own error against fp64 (and < 3e-2)."""
    b, h, hk, s = 1, 4, 2, 1024
    q, k, v = (_make(b, n, s, "bshd", dtype, seed) for n, seed in ((h, 1), (hk, 2), (hk, 3)))
    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = _make(b, h, s, "bshd", dtype, seed=4)
    ours = causal_flash_attention(*inputs)
    assert ours.dtype == dtype
    ours_g = torch.autograd.grad(ours, inputs, dout)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *inputs, is_causal=True, enable_gqa=True)
    theirs_g = torch.autograd.grad(theirs, inputs, dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _eager(*ref_in, D ** -0.5)[0]
    ref_g = torch.autograd.grad(ref, ref_in, dout.double())
    for name, a, t, r in zip(("out", "dq", "dk", "dv"), (ours, *ours_g), (theirs, *theirs_g),
                             (ref, *ref_g), strict=True):
        err = (a.double() - r).abs().max().item()
        kernel_err = (t.double() - r).abs().max().item()
        scale = r.abs().max().item()
        assert err <= 3e-2 * scale, (name, err, scale)
        assert err <= 2 * kernel_err + 1e-3 * scale, (name, err, kernel_err)


def test_autograd_equals_eager() -> None:
    b, h, hk, s = 2, 4, 2, 512
    q, k, v = (_make(b, n, s, "bshd", seed=seed).requires_grad_()
               for n, seed in ((h, 1), (hk, 2), (hk, 3)))
    out = causal_flash_attention(q, k, v, scale=0.3)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _eager(*ref_in, 0.3)[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, ref_in, dout.double())
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, rtol=1e-4, atol=1e-5)


def test_block_sizes_and_support() -> None:
    assert [causal_block_size(s) for s in (256, 512, 768, 2048, 600, 128, 518, 515)] == [
        128, 128, 96, 128, 75, None, None, None]
    assert causal_block_size(256, max_block=64) == 64
    q, k = _make(1, 4, 1024, "bshd"), _make(1, 2, 1024, "bshd")
    assert tiled_causal_block(q, k, k) == 128
    assert tiled_causal_block(q, k, k, max_block=64) == 64
    short = _make(1, 4, 256, "bshd")
    assert not tiled_causal_supported(short, short, short)  # below MIN_LEN: SDPA
    assert tiled_causal_block(short, short, short, min_len=256) == 128
    assert not tiled_causal_supported(q, k, k, dropout_p=0.1)
    assert not tiled_causal_supported(q, k[:, :, :512], k[:, :, :512])  # sq != sk
    assert not tiled_causal_supported(q, k.double(), k.double())
    assert not tiled_causal_supported(q, _make(1, 3, 1024, "bshd"), _make(1, 3, 1024, "bshd"))
    odd = _make(1, 2, 518, "bshd")
    assert not tiled_causal_supported(odd, odd, odd)
    with pytest.raises(ValueError, match="does not tile"):
        causal_flash_forward(odd, odd, odd, 0.25)
    with pytest.raises(ValueError, match="tiled_causal_supported"):
        causal_flash_attention(odd, odd, odd)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = sdpa_mod.causal_flash_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sdpa_mod, "causal_flash_attention", counted)
    return calls


def test_attention_routes_causal_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """``attention(..., "causal")`` goes through the tiled path with eager's gradients."""
    calls = _counting(monkeypatch)
    b, h, hk, s = 1, 4, 2, 512
    q, k, v = (_make(b, n, s, "bshd", seed=seed).requires_grad_()
               for n, seed in ((h, 1), (hk, 2), (hk, 3)))
    out = attention(q, k, v, "causal")
    assert calls == [1]
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _eager(*ref_in, 1 / math.sqrt(D))[0]
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, ref_in, dout.double())
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(sdpa_mod, "TILED_CAUSAL", False)  # the A/B switch
    plain = attention(q, k, v, "causal")
    assert calls == [1]
    torch.testing.assert_close(plain, out, rtol=1e-5, atol=2e-6)


def test_attention_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lengths that do not tile, short ones, dropout, non-causal: SDPA with the same values."""
    calls = _counting(monkeypatch)
    for s in (518, 256):
        q = _make(1, 4, s, "bshd", seed=1)
        k, v = _make(1, 2, s, "bshd", seed=2), _make(1, 2, s, "bshd", seed=3)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)
        torch.testing.assert_close(attention(q, k, v, "causal"), want, rtol=0, atol=0)
    q = _make(1, 2, 512, "bshd")
    attention(q, q, q, "none")
    torch.manual_seed(0)
    attention(q, q, q, "causal", dropout_p=0.5)
    assert calls == []
