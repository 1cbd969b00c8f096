from __future__ import annotations

import pytest
import torch
from conftest import triton_ok
from torch import nn

from colossal.kernels import (
    REGISTRY,
    FusedLayerNorm,
    FusedRMSNorm,
    fused_layer_norm,
    fused_rms_norm,
    replace_norms,
)

LN_IMPLS = ["aten"] + (["triton"] if triton_ok() else [])
RMS_IMPLS = ["aten", "torch"] + (["triton"] if triton_ok() else [])
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def rms_reference(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class LlamaRMSNorm(nn.Module):  # the Hugging Face module, verbatim in behaviour
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(dtype)


def _inputs(dtype, shape=(3, 5, 48)):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).requires_grad_()
    b = torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


def _close(got, want, dtype):
    """bf16 results may differ from the fp32 reference by a bf16 rounding of the largest value
    (weight/bias grads are sums over rows)."""
    got, want = got.float(), want.float()
    tol = dict(TOL[dtype])
    if dtype == torch.bfloat16:
        tol["atol"] = max(tol["atol"], 1e-2 * float(want.abs().max()))
    torch.testing.assert_close(got, want, **tol)


def _f32(t):
    return None if t is None else t.float()


def _grads(out, dy, *tensors):
    return torch.autograd.grad(out, tensors, dy)


@pytest.mark.parametrize("impl", LN_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_torch(impl, dtype, affine):
    x, w, b, dy = _inputs(dtype)
    w, b = (w, b) if affine else (None, None)
    with REGISTRY.force("layer_norm", impl):
        out = fused_layer_norm(x, 48, w, b, eps=1e-5)
    # reference: torch.nn.functional.layer_norm in fp32 on the same (rounded) inputs
    ref = torch.nn.functional.layer_norm(x.float(), (48,), *(_f32(t) for t in (w, b)), eps=1e-5)
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    ins = (x, w, b) if affine else (x,)
    for got, want in zip(_grads(out, dy, *ins), _grads(ref, dy.float(), *ins), strict=False):
        _close(got, want, dtype)


@pytest.mark.parametrize("impl", RMS_IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(impl, dtype):
    x, w, _, dy = _inputs(dtype)
    with REGISTRY.force("rms_norm", impl):
        out = fused_rms_norm(x, 48, w, eps=1e-6)
    ref = rms_reference(x.float(), w.float(), 1e-6)  # fp32 on the same (rounded) inputs
    torch.testing.assert_close(out.float(), ref, **TOL[dtype])
    for got, want in zip(_grads(out, dy, x, w), _grads(ref, dy.float(), x, w), strict=False):
        _close(got, want, dtype)


def test_modules_replace_native_and_hf_norms_sharing_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), LlamaRMSNorm(16, eps=1e-5),
                          nn.Sequential(nn.RMSNorm(16, eps=1e-6)))
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight") and not isinstance(m, nn.Linear):
                m.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16)
    expected = model(x)
    ln_weight = model[1].weight
    assert replace_norms(model) == 3
    assert isinstance(model[1], FusedLayerNorm) and isinstance(model[2], FusedRMSNorm)
    assert isinstance(model[3][0], FusedRMSNorm)
    assert model[1].weight is ln_weight and model[2].eps == 1e-5
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    assert replace_norms(model) == 0


def test_module_construction_and_errors():
    m = FusedLayerNorm(8, bias=False)
    assert m.bias is None and m(torch.randn(2, 8)).shape == (2, 8)
    r = FusedRMSNorm(8, elementwise_affine=False)
    torch.testing.assert_close(r(torch.ones(2, 8)), torch.ones(2, 8), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="normalized_shape"):
        fused_layer_norm(torch.randn(2, 8), 7)
    with pytest.raises(TypeError, match="LayerNorm"):
        FusedLayerNorm.from_native_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="compatible RMSNorm"):
        FusedRMSNorm.from_native_module(nn.Linear(2, 2))


# ---- real Hugging Face models ------------------------------------------------------------
def _hf_model(kind, dtype):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=32,
                                       rms_norm_eps=1e-5, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # norms start at ones/zeros: make weights (and biases) non-trivial
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
    return model.to(dtype).eval()


def _norm_params(model):
    return {n: p for n, p in model.named_parameters() if "norm" in n or ".ln_" in n}


def _hf_forward_backward(model, embeds, dy):
    embeds = embeds.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    logits = model(inputs_embeds=embeds).logits
    logits.backward(dy)
    grads = {n: p.grad.clone() for n, p in _norm_params(model).items()}
    return logits.detach(), embeds.grad, grads


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replace_norms_in_hf_model_forward_and_backward(kind, dtype):
    import copy

    ref = _hf_model(kind, dtype)
    ours = copy.deepcopy(ref)
    assert replace_norms(ours) == 5  # 2 per layer + the final norm
    fused = FusedRMSNorm if kind == "llama" else FusedLayerNorm
    assert sum(isinstance(m, fused) for m in ours.modules()) == 5
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(2, 7, 32, generator=g).to(dtype)
    dy = torch.randn(2, 7, 64, generator=g).to(dtype)
    want = _hf_forward_backward(ref, embeds, dy)
    got = _hf_forward_backward(ours, embeds, dy)
    assert got[0].dtype == want[0].dtype == dtype
    assert got[2].keys() == want[2].keys() and len(got[2]) >= 5
    if dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=name)
    else:  # bf16: rounding differs (HF rounds the normalized value before the weight)
        _close(got[0], want[0], dtype)
        _close(got[1], want[1], dtype)
        for name in want[2]:
            _close(got[2][name], want[2][name], dtype)


@pytest.mark.parametrize("impl", RMS_IMPLS)
def test_rms_norm_output_dtype_matches_hf_llama(impl):
    """HF's LlamaRMSNorm returns ``weight * hidden.to(input_dtype)``: an fp32 weight on a bf16
    input gives fp32; the replacement must do the same (values and grads too)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    fused = FusedRMSNorm.from_native_module(hf)
    assert fused.weight is hf.weight and fused.hf_output_dtype
    for x_dtype in (torch.float32, torch.bfloat16):
        x, _, _, _ = _inputs(x_dtype)
        want = hf(x)
        with REGISTRY.force("rms_norm", impl):
            got = fused(x)
        assert got.dtype == want.dtype == torch.float32
        # a bf16 input's normalized value is rounded to bf16 by both: one bf16 ulp may differ
        rtol = 1e-5 if x_dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-5)
        dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
        for a, b in zip(_grads(got, dy, x, hf.weight), _grads(want, dy, x, hf.weight),
                        strict=True):
            assert a.dtype == b.dtype
            if x_dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            else:  # the bf16 grad of x is rounded to bf16
                _close(a, b, x_dtype)
    # torch.nn.RMSNorm keeps the input dtype; so does its replacement
    native = nn.RMSNorm(48, eps=1e-6)
    x = _inputs(torch.bfloat16)[0]
    assert FusedRMSNorm.from_native_module(native)(x).dtype == native(x).dtype == torch.bfloat16
