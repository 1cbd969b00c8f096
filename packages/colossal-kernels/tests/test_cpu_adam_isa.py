"""Every instruction-set path of the C++ CPU Adam kernel against torch, and its thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from colossal.kernels import REGISTRY, CPUAdam, _jit
from colossal.kernels.optim._base import AdamFn
from colossal.kernels.optim._functional import (
    ISA_ENV,
    AdamHyper,
    CppAdam,
    supported_isas,
    torch_adam_step,
)

ISAS = ["avx512", "avx2", "portable"]
# Tails of several lengths and a tensor of several 32768-element work items (threads).
SHAPES = [(1000,), (33, 17), (7,), (70_001,)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def lib():
    if not _jit.is_cached() and _jit.compiler_path() is None:
        pytest.skip("no C++ compiler")
    return _jit.load_library()


def _need(lib, isa: str) -> None:
    if isa not in supported_isas(lib):
        pytest.skip(f"this CPU cannot run {isa}")


def _grads(step: int, dtype: torch.dtype, scale: float) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_path_matches_torch(lib, monkeypatch, isa, grad_dtype, adamw_mode):
    """Grads of each dtype, div_scale, a working copy of the grad's dtype, four steps."""
    _need(lib, isa)
    monkeypatch.setenv(ISA_ENV, isa)
    scale = 64.0
    g = torch.Generator().manual_seed(0)
    inits = [torch.randn(s, generator=g) for s in SHAPES]
    masters = [torch.nn.Parameter(t.clone()) for t in inits]
    working = [t.to(grad_dtype, copy=True) for t in inits]
    ref = [torch.nn.Parameter(t.clone()) for t in inits]
    opt = CPUAdam(
        masters, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, adamw_mode=adamw_mode
    )
    opt.attach_working_params(dict(zip(masters, working, strict=True)))
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    torch_opt = cls(ref, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    with REGISTRY.force("cpu_adam", "cpp"):
        assert REGISTRY.get("cpu_adam", "cpu").simd == isa
        for step in range(4):
            grads = _grads(step, grad_dtype, scale)
            opt.step(div_scale=scale, grads=dict(zip(masters, grads, strict=True)))
            for r, gr in zip(ref, grads, strict=True):
                r.grad = gr.float() / scale
            torch_opt.step()
    for m, w, r in zip(masters, working, ref, strict=True):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            opt.state[m]["exp_avg"], torch_opt.state[r]["exp_avg"], rtol=1e-5, atol=1e-7
        )
        torch.testing.assert_close(
            opt.state[m]["exp_avg_sq"], torch_opt.state[r]["exp_avg_sq"], rtol=1e-5, atol=1e-9
        )
        assert torch.equal(w, m.detach().to(grad_dtype))  # the copy is the rounded master
    assert not torch.equal(masters[3].detach(), inits[3])


def _special_values(n: int) -> torch.Tensor:
    """fp32 values probing fp16/bf16 rounding: ties, overflow, denormals, inf, NaN, random bits."""
    ties = [
        1.0 + 2.0**-8,
        1.0 + 3 * 2.0**-8,
        -(1.0 + 2.0**-8),
        1.0 + 2.0**-11,
        1.0 + 3 * 2.0**-11,
        65504.0,
        65519.0,
        65520.0,
        -70000.0,
        2.0**-24,
        2.0**-25,
        3 * 2.0**-26,
        1e-40,
        -1e-45,
        0.0,
        -0.0,
        float("inf"),
        float("-inf"),
        float("nan"),
        -float("nan"),
        3.4e38,
    ]
    # NaNs whose payload rounding would carry into the exponent or sign (inf, -0.0).
    nans = [0x7F800001, 0x7FFFFFFF, 0x7F80FFFF, -1, -0x007FFFFF]
    g = torch.Generator().manual_seed(7)
    rand = torch.randint(-(2**31), 2**31 - 1, (n - len(ties) - len(nans),), generator=g)
    bits = torch.cat([torch.tensor(nans), rand]).to(torch.int32).view(torch.float32)
    return torch.cat([torch.tensor(ties), bits])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_copy_rounds_like_torch(lib, isa, copy_dtype):
    """With lr = 0 the param stays; the copy must be torch's round-to-nearest-even of it."""
    _need(lib, isa)
    p = _special_values(4099)  # vector part and a 3-element tail
    param = p.clone()
    copy = torch.empty(p.numel(), dtype=copy_dtype)
    hyper = AdamHyper(
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    )
    CppAdam(lib, isa=isa)(
        [param],
        [torch.zeros_like(p)],
        [torch.zeros_like(p)],
        [torch.zeros_like(p)],
        [copy],
        [1],
        hyper,
    )
    expected = p.to(copy_dtype)
    assert torch.equal(torch.isnan(copy), torch.isnan(expected))
    keep = ~torch.isnan(expected)
    assert torch.equal(copy[keep].view(torch.int16), expected[keep].view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
def test_large_step_streams_copies_correctly(lib, isa):
    """Steps over >= 2**22 elements write aligned copies with non-temporal stores."""
    _need(lib, isa)
    n = (1 << 21) + 37  # three tensors: 6.3M elements
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=g) for _ in range(3)]
    ref = [p.clone() for p in params]
    unaligned = torch.empty(n + 1, dtype=torch.bfloat16)[1:]  # 2-byte offset: plain stores
    copies = [torch.empty(n, dtype=torch.float16), unaligned, torch.empty(n)]
    state = [torch.zeros(n) for _ in range(6)]
    ref_state = [torch.zeros(n) for _ in range(6)]
    hyper = AdamHyper(
        lr=1e-2,
        beta1=0.9,
        beta2=0.99,
        eps=1e-6,
        weight_decay=0.1,
        adamw_mode=True,
        bias_correction=True,
        div_scale=8.0,
    )
    kernel = CppAdam(lib, isa=isa)
    for step in (1, 2):
        grads = [torch.randn(n, generator=g).to(d) for d in DTYPES]
        kernel(params, grads, state[:3], state[3:], copies, [step] * 3, hyper)
        torch_adam_step(ref, grads, ref_state[:3], ref_state[3:], [None] * 3, [step] * 3, hyper)
    for p, r, c in zip(params, ref, copies, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        assert torch.equal(c, p.to(c.dtype))


def _run_threads(kernel: CppAdam, num_threads: int | None = None) -> int:
    n = 100_000  # four work items
    t = [torch.zeros(n) for _ in range(4)]
    hyper = AdamHyper(
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw_mode=True,
        bias_correction=True,
    )
    kernel([t[0]], [torch.ones(n)], [t[1]], [t[2]], [None], [1], hyper, num_threads)
    return kernel.last_num_threads


def test_threads_follow_torch_get_num_threads(lib):
    kernel = CppAdam(lib)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _run_threads(kernel) == 1
        torch.set_num_threads(2)
        assert _run_threads(kernel) == 2
        assert _run_threads(kernel, num_threads=1) == 1  # an explicit count wins
        assert _run_threads(CppAdam(lib, num_threads=1)) == 1
    finally:
        torch.set_num_threads(before)


def test_threads_not_taken_from_omp_num_threads(lib):
    """OMP_NUM_THREADS=1 sets torch's default only; torch.set_num_threads(2) then rules."""
    code = (
        "import torch\n"
        "from colossal.kernels import _jit\n"
        "from colossal.kernels.optim._functional import AdamHyper, CppAdam\n"
        "torch.set_num_threads(2)\n"
        "k = CppAdam(_jit.load_library())\n"
        "t = [torch.zeros(100_000) for _ in range(3)]\n"
        "h = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, True, True)\n"
        "k([t[0]], [torch.ones(100_000)], [t[1]], [t[2]], [None], [1], h)\n"
        "print(k.last_num_threads)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split()[-1] == "2"


# Tensors of 6, 1, 3, 2 and 1 work items (32768 elements each) and small ones: 13 items.
ITEM_SIZES = [5 * 32768 + 3, 70, 3 * 32768, 32768 + 1, 9, 1000]


def _uneven_steps(kernel: AdamFn, num_threads: int) -> list[torch.Tensor]:
    """Two steps over ``ITEM_SIZES``; returns the params and both moments."""
    g = torch.Generator().manual_seed(11)
    params = [torch.randn(n, generator=g) for n in ITEM_SIZES]
    exp_avgs = [torch.zeros(n) for n in ITEM_SIZES]
    exp_avg_sqs = [torch.zeros(n) for n in ITEM_SIZES]
    hyper = AdamHyper(
        lr=1e-2,
        beta1=0.9,
        beta2=0.99,
        eps=1e-6,
        weight_decay=0.1,
        adamw_mode=True,
        bias_correction=True,
        div_scale=4.0,
    )
    for step in (1, 2):
        grads = [torch.randn(n, generator=g) for n in ITEM_SIZES]
        kernel(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [None] * len(params),
            [step] * len(params),
            hyper,
            num_threads=num_threads,
        )
    return params + exp_avgs + exp_avg_sqs


@pytest.mark.parametrize("isa", ISAS)
def test_every_item_runs_once_whatever_the_threads(lib, isa):
    """More threads than cores or than a tensor's items: ranges are taken over (stolen)."""
    _need(lib, isa)
    kernel = CppAdam(lib, isa=isa)
    serial = _uneven_steps(kernel, 1)
    for a, b in zip(serial, _uneven_steps(torch_adam_step, 1), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for threads in (2, 3, 8, 16):
        out = _uneven_steps(kernel, threads)
        assert kernel.last_num_threads == threads
        for a, b in zip(out, serial, strict=True):  # an item run twice or skipped differs
            assert torch.equal(a, b)


def test_items_run_on_a_smaller_team(lib):
    """OMP_THREAD_LIMIT=1: a team of one asked for four threads runs every range itself."""
    code = (
        "import torch\n"
        "from colossal.kernels import _jit\n"
        "from colossal.kernels.optim._functional import AdamHyper, CppAdam, torch_adam_step\n"
        "n = 5 * 32768 + 3\n"
        "g = torch.Generator().manual_seed(5)\n"
        "p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)\n"
        "ref = p.clone()\n"
        "s = [torch.zeros(n) for _ in range(4)]\n"
        "h = AdamHyper(1e-2, 0.9, 0.99, 1e-6, 0.0, True, True)\n"
        "k = CppAdam(_jit.load_library())\n"
        "k([p], [grad], [s[0]], [s[1]], [None], [1], h, num_threads=4)\n"
        "torch_adam_step([ref], [grad], [s[2]], [s[3]], [None], [1], h)\n"
        "torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6)\n"
        "print(k.last_num_threads)\n"
    )
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.split()[-1] == "1"


def test_isa_choice_errors(lib, monkeypatch):
    with pytest.raises(ValueError, match="isa='sse9'.*'auto'"):
        CppAdam(lib, isa="sse9")
    monkeypatch.setenv(ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match=f"{ISA_ENV}='avx1024'"):
        CppAdam(lib)
    monkeypatch.setenv(ISA_ENV, " AVX2 ")
    if "avx2" in supported_isas(lib):
        assert CppAdam(lib).simd == "avx2"
    monkeypatch.delenv(ISA_ENV)
    assert CppAdam(lib).simd == supported_isas(lib)[-1]  # auto: the best one


def test_bad_isa_env_degrades_to_torch_with_the_reason(lib, monkeypatch):
    monkeypatch.setenv(ISA_ENV, "avx1024")
    REGISTRY.reset("cpu_adam")
    assert not isinstance(REGISTRY.get("cpu_adam", "cpu"), CppAdam)
    status = REGISTRY.status("cpu_adam", "cpu")
    assert status.implementation == "torch" and f"{ISA_ENV}='avx1024'" in status.reason


def test_unrunnable_isa_names_the_alternatives():
    class OnlyPortable:  # a library on a CPU without AVX2
        def colossal_adam_supported_isas(self) -> int:
            return 1

        def colossal_adam_resolve_isa(self, code: int) -> int:
            return 0 if code in (-1, 0) else -1

    with pytest.raises(ValueError, match=r"cannot run it; it runs \('portable',\)"):
        CppAdam(OnlyPortable(), isa="avx512")
    assert CppAdam(OnlyPortable()).simd == "portable"
