from __future__ import annotations

import math

import pytest
import torch

from colossal.kernels import (
    REGISTRY,
    AttentionMask,
    AttnMaskType,
    attention,
    make_attention_mask,
)

B, H, S, D = 2, 4, 12, 16


def reference(q, k, v, allowed, q_valid=None, bias=None):
    """Independent eager attention: allowed is [B, 1, Sq, Sk] bool or None; bias an additive
    float mask added to the fp32 scores."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if bias is not None:
        s = s + bias.float()
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = (p @ v.float()).to(q.dtype)
    if q_valid is not None:
        out = out * q_valid[:, None, :, None]
    return out


def _qkv(dtype, sq=S, sk=S, hk=H):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, sq, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, hk, sk, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, hk, sk, D, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _hf_mask(sk=S):
    m = torch.ones(B, sk, dtype=torch.long)
    m[0, :3] = 0   # left padding
    m[1, -4:] = 0  # right padding
    return m


def _check(out, ref, q, k, v, dtype, rows=None):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    dy = torch.randn_like(out)
    if rows is not None:
        dy = dy * rows[:, None, :, None]
    torch.testing.assert_close(out, ref, **tol)
    got = torch.autograd.grad(out, (q, k, v), dy)
    want = torch.autograd.grad(ref, (q, k, v), dy)
    for a, b in zip(got, want, strict=False):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["none", "causal", "padded", "padded_causal", "custom"])
def test_attention_matches_eager(impl, dtype, kind):
    q, k, v = _qkv(dtype)
    causal = torch.ones(S, S, dtype=torch.bool).tril().view(1, 1, S, S)
    valid = _hf_mask().bool()
    q_valid = None
    if kind in ("none", "causal"):
        mask = make_attention_mask(None, is_causal=kind == "causal")
        allowed = causal if kind == "causal" else None
    elif kind == "custom":
        allowed = torch.rand(B, 1, S, S, generator=torch.Generator().manual_seed(1)) > 0.3
        allowed |= torch.eye(S, dtype=torch.bool)
        mask = AttentionMask(AttnMaskType.CUSTOM, custom=allowed)
    else:
        mask = make_attention_mask(_hf_mask(), is_causal=kind == "padded_causal")
        assert mask.kind.value == kind
        allowed = valid.view(B, 1, 1, S) & (causal if kind == "padded_causal" else True)
        q_valid = valid
    with REGISTRY.force("attention", impl):
        out = attention(q, k, v, mask)
    ref = reference(q, k, v, allowed, q_valid)
    _check(out, ref, q, k, v, dtype, rows=q_valid)
    if q_valid is not None:
        assert torch.all(out[~q_valid.view(B, 1, S, 1).expand_as(out)] == 0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_float_custom_mask(impl, dtype):
    """A Hugging Face-style 4-D additive mask in the model dtype: finite biases (e.g. ALiBi or
    relative positions) plus dtype-min where attending is not allowed."""
    q, k, v = _qkv(dtype)
    g = torch.Generator().manual_seed(2)
    allowed = torch.rand(B, 1, S, S, generator=g) > 0.3
    allowed |= torch.eye(S, dtype=torch.bool)
    bias = torch.randn(B, 1, S, S, generator=g) * 2.0
    additive = bias.masked_fill(~allowed, torch.finfo(dtype).min).to(dtype)
    mask = AttentionMask(AttnMaskType.CUSTOM, custom=additive)
    with REGISTRY.force("attention", impl):
        out = attention(q, k, v, mask)
    ref = reference(q, k, v, allowed, bias=bias.to(dtype))
    _check(out, ref, q, k, v, dtype)
    # the bias matters: attention with the bool mask alone is clearly different
    plain = reference(q, k, v, allowed)
    assert (out.float() - plain.float()).abs().max() > 0.1


def test_decode_with_kv_cache_and_gqa():
    sq, sk = 3, S
    q, k, v = _qkv(torch.float32, sq=sq, sk=sk, hk=2)
    mask = make_attention_mask(_hf_mask(sk), is_causal=True, q_len=sq)
    out = attention(q, k, v, mask)
    i = torch.arange(sq).view(sq, 1) + (sk - sq)
    allowed = (torch.arange(sk).view(1, sk) <= i).view(1, 1, sq, sk)
    allowed = allowed & _hf_mask(sk).bool().view(B, 1, 1, sk)
    q_valid = _hf_mask(sk).bool()[:, -sq:]
    _check(out, reference(q, k, v, allowed, q_valid), q, k, v, torch.float32, rows=q_valid)


def test_unpadded_hf_mask_takes_fast_path():
    mask = make_attention_mask(torch.ones(B, S), is_causal=True)
    assert mask.kind == AttnMaskType.CAUSAL
    q, k, v = _qkv(torch.float32)
    out = attention(q, k, v, "causal")
    _check(out, reference(q, k, v, torch.ones(S, S, dtype=torch.bool).tril()), q, k, v,
           torch.float32)


def test_bad_input():
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match="needs tensors"):
        attention(q, k, v, "padded")
    with pytest.raises(ValueError, match="kv_padding_mask"):
        AttentionMask(AttnMaskType.PADDED)
    with pytest.raises(ValueError, match="incompatible"):
        attention(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="batch, heads, seq"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="attention_mask of shape"):
        make_attention_mask(torch.ones(S))
    with pytest.raises(ValueError, match="does not match batch"):
        attention(q, k, v, make_attention_mask(_hf_mask(S - 1)))
