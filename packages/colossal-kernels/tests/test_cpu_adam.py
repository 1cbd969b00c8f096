from __future__ import annotations

import copy

import pytest
import torch

from colossal.kernels import REGISTRY, CPUAdam, HybridAdam

SHAPES = [(1000,), (33, 17), (7,), (40_000,)]
IMPLS = ["cpp", "torch"]


def _make(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _grads(step, dtype, scale):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_over_ten_steps(impl, grad_dtype, adamw_mode):
    scale = 64.0
    ours = [torch.nn.Parameter(t) for t in _make()]
    ref = [torch.nn.Parameter(t.clone()) for t in _make()]
    opt = CPUAdam(ours, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05,
                  adamw_mode=adamw_mode)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    torch_opt = cls(ref, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    with REGISTRY.force("cpu_adam", impl):
        for step in range(10):
            grads = _grads(step, grad_dtype, scale)
            if grad_dtype == torch.float32:
                for p, g in zip(ours, grads, strict=False):
                    p.grad = g.clone()
                opt.step(div_scale=scale)
            else:  # low-precision grads cannot sit in .grad of fp32 params; pass them
                opt.step(div_scale=scale, grads=dict(zip(ours, grads, strict=False)))
            for p, g in zip(ref, grads, strict=False):
                p.grad = g.float() / scale
            torch_opt.step()
    for p, r in zip(ours, ref, strict=False):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg"], torch_opt.state[r]["exp_avg"],
                                   rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], torch_opt.state[r]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)
        assert opt.state[p]["step"] == 10
    assert not torch.equal(ours[0].detach(), _make()[0])  # it did move


@pytest.mark.parametrize("impl", IMPLS)
def test_no_bias_correction_against_formula(impl):
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    p.grad = torch.tensor([0.5, 0.5, -1.0])
    opt = CPUAdam([p], lr=0.1, betas=(0.9, 0.99), eps=0.0, bias_correction=False)
    with REGISTRY.force("cpu_adam", impl):
        opt.step()
    m = 0.1 * p.grad
    v = 0.01 * p.grad**2
    expected = torch.tensor([1.0, -2.0, 3.0]) - 0.1 * m / v.sqrt()
    torch.testing.assert_close(p.detach(), expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("work_dtype", [torch.bfloat16, torch.float16])
def test_working_copy_written_in_same_pass(impl, work_dtype):
    masters = [torch.nn.Parameter(t) for t in _make(1)]
    working = [m.detach().to(work_dtype).requires_grad_() for m in masters]
    opt = CPUAdam(masters, lr=1e-3, weight_decay=0.01)
    opt.attach_working_params(dict(zip(masters, working, strict=False)))
    ref = [torch.nn.Parameter(t) for t in _make(1)]
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01)
    with REGISTRY.force("cpu_adam", impl):
        for step in range(3):
            for w, g in zip(working, _grads(step, work_dtype, 1024.0), strict=False):
                w.grad = g  # grads come from the working (low-precision) params
            opt.step(div_scale=1024.0)
            for r, w in zip(ref, working, strict=False):
                r.grad = w.grad.float() / 1024.0
            torch_opt.step()
            opt.zero_grad()
            assert all(w.grad is None for w in working)
    for m, w, r in zip(masters, working, ref, strict=False):
        assert torch.equal(w.detach(), m.detach().to(work_dtype))  # round-to-nearest-even
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_and_torch_compat():
    params = [torch.nn.Parameter(t) for t in _make()]
    opt = CPUAdam(params, lr=1e-2)
    for step in range(2):
        for p, g in zip(params, _grads(step, torch.float32, 1.0), strict=False):
            p.grad = g
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # state dicts share tensors with the optimizer
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.AdamW(clones, lr=1e-2)
    torch_opt.load_state_dict(sd)  # torch can read ours
    opt2 = HybridAdam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # and we can read torch's
    for step in range(2, 4):
        grads = _grads(step, torch.float32, 1.0)
        for p, c, q, g in zip(params, clones, opt2.param_groups[0]["params"], grads, strict=False):
            p.grad, c.grad, q.grad = g, g.clone(), g.clone()
        opt.step()
        torch_opt.step()
        opt2.step()
    for p, c, q in zip(params, clones, opt2.param_groups[0]["params"], strict=False):
        torch.testing.assert_close(p, c, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_params_without_grad_are_skipped():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    a.grad = torch.ones(4)
    opt = CPUAdam([a, b])
    opt.step()
    assert torch.equal(b.detach(), torch.ones(4)) and not opt.state[b]
    assert opt.state[a]["step"] == 1


def test_closure_and_non_cpu_param_path():
    p = torch.nn.Parameter(torch.ones(3))

    def closure():
        loss = (p * p).sum()
        loss.backward()
        return loss

    opt = CPUAdam([p], lr=0.1)
    assert opt.step(closure).item() == 3.0
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.9))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="lr=-1"):
        CPUAdam([torch.nn.Parameter(torch.ones(1))], lr=-1)
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.ones(1))], betas=(1.5, 0.9))
    with pytest.raises(ValueError, match="nvme_offload_fraction"):
        CPUAdam([torch.nn.Parameter(torch.ones(1))], nvme_offload_fraction=2.0)
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp32 \\(master\\) params"):
        CPUAdam([p]).step()
    q = torch.nn.Parameter(torch.ones(4))
    opt = CPUAdam([q])
    with pytest.raises(TypeError, match="div_scale"):
        opt.step(div_scale="8")
    with pytest.raises(ValueError, match="does not match its param"):
        opt.step(grads={q: torch.ones(5)})
    with pytest.raises(TypeError, match="grad dtype"):
        opt.step(grads={q: torch.ones(4, dtype=torch.float64)})
    with pytest.raises(ValueError, match="not a param of this optimizer"):
        opt.attach_working_params({torch.ones(4): torch.ones(4, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="working copy"):
        opt.attach_working_params({q: torch.ones(3, dtype=torch.bfloat16)})
    assert not opt.state[q]  # nothing was mutated by the failed steps
