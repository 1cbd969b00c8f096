"""Registers the built-in kernels and their implementations with :data:`REGISTRY`.

Checks are cheap and never build or import an optional package; loaders do the work at
first use.
"""

from __future__ import annotations

import torch

from colossal.kernels import _jit
from colossal.kernels._triton import interpreter_enabled, triton_installed
from colossal.kernels.registry import REGISTRY, Availability, KernelImpl


def _always(reason: str):  # noqa: ANN202 - small factory
    return lambda device_type: Availability(True, reason)


def _cpp_check(device_type: str) -> Availability:
    if device_type != "cpu":
        return Availability(False, "CPU tensors only")
    if _jit.is_cached() or _jit.compiler_path() is not None:
        isa = "AVX-512/AVX2/portable chosen at run time" if _jit.X86 else "-march=native"
        return Availability(True, f"C++ kernel ({isa}, OpenMP); {_jit.describe_build()}")
    return Availability(False, _jit.describe_build(), degraded=True)


def _load_cpp() -> object:
    from colossal.kernels.optim._functional import CppAdam

    return CppAdam(_jit.load_library())


def _triton_check(device_type: str) -> Availability:
    if device_type == "cuda":
        if not triton_installed():
            return Availability(False, "triton is not installed (pip install "
                                "'colossal-kernels[triton]')", degraded=True)
        return Availability(True, "Triton kernel")
    if device_type == "cpu" and interpreter_enabled() and triton_installed():
        return Availability(True, "Triton interpreter (TRITON_INTERPRET=1; slow, for tests)")
    return Availability(False, f"Triton does not run on {device_type} tensors "
                        "(on CPU only under TRITON_INTERPRET=1)")


def _load_triton_adam() -> object:
    from colossal.kernels._triton.adam import triton_adam_step

    return triton_adam_step


def _load_torch_adam() -> object:
    from colossal.kernels.optim._functional import torch_adam_step

    return torch_adam_step


def _load_norm(name: str):  # noqa: ANN202 - small factory
    def load() -> object:
        from colossal.kernels.norm import functional

        impl = getattr(functional, name)
        return impl() if name.startswith("load_") else impl
    return load


def _aten_rms_check(device_type: str) -> Availability:
    if hasattr(torch.ops.aten, "_fused_rms_norm"):
        return Availability(True, "fused ATen _fused_rms_norm forward, torch-ops backward")
    return Availability(False, f"torch {torch.__version__} has no aten._fused_rms_norm")


def _sdpa_check(device_type: str) -> Availability:
    from colossal.kernels.attention.sdpa import sdpa_backends

    names = [b.name.lower() for b in sdpa_backends(torch.device(device_type), torch.bfloat16,
                                                   False)]
    return Availability(True, f"scaled_dot_product_attention, backends {' > '.join(names)}")


def _load_attention(name: str):  # noqa: ANN202 - small factory
    def load() -> object:
        from colossal.kernels.attention import sdpa

        return getattr(sdpa, name)
    return load


def register_builtin() -> None:
    """Add the built-in kernels to :data:`REGISTRY` (called once on package import)."""
    if "cpu_adam" in REGISTRY.kernels():
        return
    REGISTRY.register("cpu_adam", KernelImpl("cpp", 100, _cpp_check, _load_cpp,
                                             "fused C++ Adam (JIT-built, cached)"), ("cpu",))
    REGISTRY.register("cpu_adam", KernelImpl("torch", 0, _always("pure torch ops"),
                                             _load_torch_adam, "torch ops"), ("cpu",))
    REGISTRY.register("fused_adam", KernelImpl("triton", 100, _triton_check, _load_triton_adam,
                                               "Triton multi-tensor Adam"))
    REGISTRY.register("fused_adam", KernelImpl("torch", 0, _always("pure torch ops"),
                                               _load_torch_adam, "torch ops"))
    REGISTRY.register("layer_norm", KernelImpl("triton", 100, _triton_check,
                                               _load_norm("load_triton_layer_norm")))
    REGISTRY.register("layer_norm", KernelImpl("aten", 50, _always("fused ATen native_layer_norm"),
                                               _load_norm("ATEN_LAYER_NORM")))
    REGISTRY.register("rms_norm", KernelImpl("triton", 100, _triton_check,
                                             _load_norm("load_triton_rms_norm")))
    REGISTRY.register("rms_norm", KernelImpl("aten", 50, _aten_rms_check,
                                             _load_norm("ATEN_RMS_NORM")))
    REGISTRY.register("rms_norm", KernelImpl("torch", 0, _always("torch ops"),
                                             _load_norm("TORCH_RMS_NORM")))
    REGISTRY.register("attention", KernelImpl("sdpa", 100, _sdpa_check,
                                              _load_attention("sdpa_attention")))
    REGISTRY.register("attention", KernelImpl("eager", 0, _always("matmul + softmax reference"),
                                              _load_attention("eager_attention")))
