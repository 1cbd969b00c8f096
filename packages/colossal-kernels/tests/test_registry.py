from __future__ import annotations

import logging

import pytest
import torch

from colossal.kernels import (
    REGISTRY,
    Availability,
    CPUAdam,
    KernelImpl,
    KernelRegistry,
    _jit,
    format_kernel_report,
    kernel_report,
)


def _impl(name, prio, ok=True, degraded=False, value=None, fail=False):
    def load():
        if fail:
            raise RuntimeError(f"{name} build exploded")
        return value if value is not None else name
    return KernelImpl(name, prio, lambda d: Availability(ok, f"{name} check", degraded), load)


def test_best_available_wins_and_is_cached():
    reg = KernelRegistry()
    reg.register("k", _impl("slow", 0))
    reg.register("k", _impl("fast", 10))
    assert reg.get("k", "cpu") == "fast"
    assert reg.status("k", "cpu").loaded


def test_missing_dependency_degrades_with_one_warning(caplog):
    reg = KernelRegistry()
    reg.register("k_warn", _impl("fast", 10, ok=False, degraded=True))
    reg.register("k_warn", _impl("slow", 0))
    with caplog.at_level(logging.WARNING, logger="colossal.kernels.registry"):
        assert reg.get("k_warn", "cpu") == "slow"
        reg.reset()
        assert reg.get("k_warn", "cpu") == "slow"
    warnings = [r for r in caplog.records if "k_warn" in r.getMessage()]
    assert len(warnings) == 1
    assert "fast check" in warnings[0].getMessage()


def test_not_applicable_does_not_warn(caplog):
    reg = KernelRegistry()
    reg.register("k_quiet", _impl("gpu", 10, ok=False, degraded=False))
    reg.register("k_quiet", _impl("cpu", 0))
    with caplog.at_level(logging.WARNING):
        assert reg.get("k_quiet", "cpu") == "cpu"
    assert not [r for r in caplog.records if "k_quiet" in r.getMessage()]


def test_failed_load_falls_back_and_is_remembered():
    reg = KernelRegistry()
    reg.register("k_fail", _impl("fast", 10, fail=True))
    reg.register("k_fail", _impl("slow", 0))
    assert reg.get("k_fail", "cpu") == "slow"
    status = reg.status("k_fail", "cpu")
    assert status.implementation == "slow"
    assert "build exploded" in status.reason


def test_force_and_errors():
    reg = KernelRegistry()
    reg.register("k", _impl("a", 10))
    reg.register("k", _impl("b", 0))
    with reg.force("k", "b"):
        assert reg.get("k", "cpu") == "b"
    assert reg.get("k", "cpu") == "a"
    with pytest.raises(ValueError, match="no implementation 'c'"):
        with reg.force("k", "c"):
            pass
    with pytest.raises(ValueError, match="unknown kernel"):
        reg.get("nope", "cpu")
    with pytest.raises(ValueError, match="already has"):
        reg.register("k", _impl("a", 3))


def test_report_lists_every_builtin_kernel():
    rows = kernel_report("cpu")
    kernels = {r.kernel for r in rows}
    assert {"cpu_adam", "fused_adam", "layer_norm", "rms_norm", "attention"} <= kernels
    table = format_kernel_report(rows)
    assert table.startswith("| kernel | device |") and "cpu_adam" in table
    assert kernel_report()  # default devices


def _cpu_adam_run():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1000))
    p.grad = torch.randn(1000)
    ref = torch.nn.Parameter(p.detach().clone())
    ref.grad = p.grad.clone()
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.step()
        torch_opt.step()
    torch.testing.assert_close(p, ref)


def test_cpu_adam_falls_back_without_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(_jit.CACHE_ENV, str(tmp_path / "cache"))
    REGISTRY.reset("cpu_adam")
    status = REGISTRY.status("cpu_adam", "cpu")
    assert status.implementation == "torch"
    assert "no-such-compiler" in status.reason
    with caplog.at_level(logging.WARNING, logger="colossal.kernels.registry"):
        _cpu_adam_run()
    msgs = [r.getMessage() for r in caplog.records if "cpu_adam" in r.getMessage()]
    assert len(msgs) == 1
    assert REGISTRY.status("cpu_adam", "cpu").implementation == "torch"
    assert not (tmp_path / "cache").exists()  # nothing was built


def test_cpu_adam_falls_back_when_build_fails(monkeypatch):
    def boom():
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(_jit, "load_library", boom)
    REGISTRY.reset("cpu_adam")
    _cpu_adam_run()
    status = REGISTRY.status("cpu_adam", "cpu")
    assert status.implementation == "torch" and "compiler crashed" in status.reason


def test_cpp_kernel_builds_into_cache():
    REGISTRY.reset("cpu_adam")
    impl = REGISTRY.get("cpu_adam", "cpu")
    assert type(impl).__name__ == "CppAdam"
    assert _jit.is_cached()
    assert REGISTRY.status("cpu_adam", "cpu").implementation == "cpp"
