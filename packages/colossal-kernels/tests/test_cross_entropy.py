from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - the usual alias

from colossal.kernels import cross_entropy

# the module (the package attribute of the same name is the function)
ce_module = importlib.import_module("colossal.kernels.loss.cross_entropy")

V = 37
BF16_GRAD_TOL = dict(rtol=1e-2, atol=1e-3)  # both sides round the same fp32 gradient to bf16


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch):
    # 3 rows per chunk: several chunks and a partial last one in every test
    monkeypatch.setattr(ce_module, "_CHUNK_ELEMENTS", 3 * V)


def _data(shape, dtype=torch.float32, ignored=(1, 4), seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, V, generator=gen) * 3).to(dtype)
    target = torch.randint(0, V, shape, generator=gen)
    flat = target.view(-1)
    for i in ignored:
        flat[i] = -100
    return logits, target


def _run(fn, logits, target, upstream=None, **kw):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kw)
    loss.backward(upstream if upstream is not None else None)
    return loss.detach(), x.grad


def _torch_ce(logits, target, divisor=None, reduction="mean", **kw):
    # transformers' ForCausalLMLoss: logits.float(), flatten, sum / num_items_in_batch
    flat = logits.float().reshape(-1, logits.shape[-1])
    if divisor is not None:
        return F.cross_entropy(flat, target.reshape(-1), reduction="sum", **kw) / divisor
    out = F.cross_entropy(flat, target.reshape(-1), reduction=reduction, **kw)
    return out.view(target.shape) if reduction == "none" else out


@pytest.mark.parametrize(
    "shape,kwargs",
    [
        ((11,), {}),
        ((11,), {"reduction": "sum"}),
        ((11,), {"reduction": "none"}),
        ((2, 7), {}),  # 3-D logits
        ((2, 7), {"reduction": "none"}),
        ((2, 7), {"divisor": torch.tensor(23)}),  # num_items_in_batch as a tensor
        ((2, 7), {"divisor": 5}),
        ((11,), {"ignore_index": 3}),
    ],
)
def test_matches_torch_fp32(shape, kwargs):
    # catches: a wrong lse/picked logit, ignored rows counted, a wrong divisor or gradient
    logits, target = _data(shape)
    if "ignore_index" in kwargs:
        target[target == -100] = kwargs["ignore_index"]
    upstream = None
    if kwargs.get("reduction") == "none":
        upstream = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours, g_ours = _run(cross_entropy, logits, target, upstream, **kwargs)
    ref, g_ref = _run(_torch_ce, logits, target, upstream, **kwargs)
    assert ours.dtype == ref.dtype == torch.float32
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-7)
    assert g_ours.shape == logits.shape


def test_matches_torch_bf16_logits():
    # catches: computing in bf16 (the loss would be off by ~1e-2) or a gradient in fp32
    logits, target = _data((2, 9), torch.bfloat16)
    for kwargs in ({}, {"divisor": torch.tensor(40)}):
        ours, g_ours = _run(cross_entropy, logits, target, **kwargs)
        ref, g_ref = _run(_torch_ce, logits, target, **kwargs)
        assert ours.dtype == torch.float32 and g_ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g_ours, g_ref, **BF16_GRAD_TOL)


def test_non_contiguous_logits_and_all_ignored():
    # catches: reshaping a transposed tensor as if contiguous; NaN gradients for 0 / 0
    base, _ = _data((7, 3))
    logits = base.transpose(0, 1)  # (3, 7, V), not contiguous
    target = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(2))
    ours, g_ours = _run(cross_entropy, logits, target)
    ref, g_ref = _run(_torch_ce, logits, target)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-6, atol=1e-7)

    logits, target = _data((4,), ignored=range(4))
    ours, g_ours = _run(cross_entropy, logits, target)
    ref, g_ref = _run(_torch_ce, logits, target)
    assert torch.isnan(ours) and torch.isnan(ref)  # 0 / 0, as torch
    torch.testing.assert_close(g_ours, g_ref)  # zeros


def _saved_full_size(fn, logits, target):
    """Tensors ``fn`` saves for backward with ``[N, V]`` elements that are not ``logits``."""
    x = logits.detach().clone().requires_grad_(True)
    found = []

    def pack(t):
        if t.numel() == x.numel() and t.data_ptr() != x.data_ptr():
            found.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(x, target)
    loss.backward()
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_no_log_probs(dtype):
    # catches: saving log_softmax (what F.cross_entropy does) or a float32 copy of bf16 logits
    logits, target = _data((3, 8), dtype)
    assert _saved_full_size(_torch_ce, logits, target), "the detector must see torch's log-probs"
    assert _saved_full_size(cross_entropy, logits, target) == []


@pytest.mark.parametrize(
    "kwargs,error,fix",
    [
        ({"label_smoothing": 0.1}, ValueError, "label_smoothing"),
        ({"weight": torch.ones(V)}, ValueError, "weight=None"),
        ({"reduction": "batchmean"}, ValueError, "'mean', 'sum', 'none'"),
        ({"reduction": "sum", "divisor": 4}, ValueError, "drop it"),
        ({"divisor": 0}, ValueError, "positive"),
    ],
)
def test_refused_arguments_name_the_fix(kwargs, error, fix):
    logits, target = _data((5,))
    with pytest.raises(error, match=fix):
        cross_entropy(logits, target, **kwargs)


def test_bad_targets_and_shapes():
    logits, target = _data((5,))
    bad = target.clone()
    bad[2] = V
    with pytest.raises(ValueError, match=rf"target {V} is outside .* ignore_index=-100"):
        cross_entropy(logits, bad)
    bad[2] = -3
    with pytest.raises(ValueError, match="target -3 is outside"):
        cross_entropy(logits, bad)
    with pytest.raises(TypeError, match="class probabilities"):
        cross_entropy(logits, torch.rand(5, V))
    with pytest.raises(ValueError, match="LAST dim"):
        cross_entropy(logits.t(), target)  # torch's (N, C) vs (C, N) confusion
    with pytest.raises(TypeError, match="floating-point"):
        cross_entropy(target, target)
