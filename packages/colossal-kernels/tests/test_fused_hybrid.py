from __future__ import annotations

import pytest
import torch
from conftest import needs_triton

from colossal.kernels import REGISTRY, CPUAdam, FusedAdam, HybridAdam

SHAPES = [(3000,), (31, 33), (5,)]


def _params(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _grads(step, dtype, scale, device="cpu"):
    g = torch.Generator().manual_seed(50 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype).to(device) for s in SHAPES]


def _run_against_torch(opt_cls, impl_kernel, impl, grad_dtype, device="cpu", steps=10,
                       with_copy=False, adamw_mode=True, copy_dtype=torch.bfloat16):
    scale = 32.0
    ours, ref = _params(device), _params(device)
    opt = opt_cls(ours, lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    copies = None
    if with_copy:
        copies = [torch.empty_like(p, dtype=copy_dtype) for p in ours]
        opt.attach_working_params(dict(zip(ours, copies, strict=False)))
    # adamw_mode=False is Adam with L2 regularisation: torch.optim.Adam's weight_decay
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    torch_opt = torch_cls(ref, lr=1e-2, weight_decay=0.1)
    with REGISTRY.force(impl_kernel, impl):
        for step in range(steps):
            grads = _grads(step, grad_dtype, scale, device)
            opt.step(div_scale=scale, grads=dict(zip(ours, grads, strict=False)))
            for r, g in zip(ref, grads, strict=False):
                r.grad = g.float() / scale
            torch_opt.step()
    for p, r in zip(ours, ref, strict=False):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    if copies is not None:
        for p, c in zip(ours, copies, strict=False):
            assert c.dtype == copy_dtype
            assert torch.equal(c, p.detach().to(copy_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_adam_torch_impl(grad_dtype):
    _run_against_torch(FusedAdam, "fused_adam", "torch", grad_dtype)


@needs_triton
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_adam_triton_kernel(grad_dtype, adamw_mode, copy_dtype):
    """The Triton kernel (interpreted on CPU) against torch.optim.AdamW / Adam (L2), 10 steps
    with weight decay and a loss-scale divisor, writing an fp16 or bf16 working copy."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _run_against_torch(FusedAdam, "fused_adam", "triton", grad_dtype, device=device, steps=10,
                       with_copy=True, adamw_mode=adamw_mode, copy_dtype=copy_dtype)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fused_adam_torch_impl_l2_and_fp16_copy(adamw_mode):
    _run_against_torch(FusedAdam, "fused_adam", "torch", torch.float16, with_copy=True,
                       adamw_mode=adamw_mode, copy_dtype=torch.float16)


def test_fused_adam_rejects_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdam([torch.nn.Parameter(torch.ones(2))], amsgrad=True)


def test_hybrid_on_cpu_equals_cpu_adam():
    a, b = _params(), _params()
    oa, ob = CPUAdam(a, lr=1e-3, weight_decay=0.01), HybridAdam(b, lr=1e-3, weight_decay=0.01)
    for step in range(4):
        grads = _grads(step, torch.bfloat16, 8.0)
        oa.step(div_scale=8.0, grads=dict(zip(a, grads, strict=False)))
        ob.step(div_scale=8.0, grads=dict(zip(b, grads, strict=False)))
    for x, y in zip(a, b, strict=False):
        assert torch.equal(x, y)
    assert oa.state_dict()["state"].keys() == ob.state_dict()["state"].keys()


@pytest.mark.gpu
def test_hybrid_routes_cpu_and_gpu_params():
    cpu, gpu = _params("cpu"), _params("cuda", seed=1)
    ref = [torch.nn.Parameter(p.detach().cpu().clone()) for p in cpu + gpu]
    opt = HybridAdam([*cpu, *gpu], lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(5):
        grads = _grads(step, torch.float32, 4.0) + _grads(step + 7, torch.float32, 4.0, "cuda")
        opt.step(div_scale=4.0, grads=dict(zip(cpu + gpu, grads, strict=False)))
        for r, g in zip(ref, grads, strict=False):
            r.grad = g.float().cpu() / 4.0
        torch_opt.step()
    for p, r in zip(cpu + gpu, ref, strict=False):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_fused_adam_on_gpu_uses_triton():
    assert REGISTRY.status("fused_adam", "cuda").implementation == "triton"
    _run_against_torch(FusedAdam, "fused_adam", "triton", torch.bfloat16, device="cuda",
                       with_copy=True)
