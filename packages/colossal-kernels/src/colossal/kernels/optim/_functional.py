"""The Adam/AdamW update as plain functions over lists of tensors.

Every implementation has the same signature, so the optimizers call whichever the registry
picked::

    fn(params, grads, exp_avgs, exp_avg_sqs, copies, steps, hyper, num_threads=None)

``params``, ``exp_avgs`` and ``exp_avg_sqs`` are contiguous fp32 tensors updated in place;
``grads`` are fp32, fp16 or bf16 tensors with the params' number of elements; ``copies`` holds,
per param, ``None`` or a tensor (fp32/fp16/bf16, same number of elements) that receives the
updated param; ``steps`` are the step numbers after this update (1 for the first);
``num_threads`` caps the CPU threads (CPU kernels only; others ignore it).
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COPY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class AdamHyper:
    """Hyper-parameters of one Adam update (one parameter group).

    Attributes:
        lr: Learning rate.
        beta1: Decay of the first moment.
        beta2: Decay of the second moment.
        eps: Added to the denominator.
        weight_decay: Weight decay (decoupled in AdamW mode, L2 otherwise).
        adamw_mode: Decoupled weight decay (AdamW) when true.
        bias_correction: Divide the moments by ``1 - beta**step``.
        div_scale: Grads are divided by this when it is > 0 (the loss scale).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool
    div_scale: float = -1.0

    def step_size(self, step: int) -> float:
        """``lr / (1 - beta1**step)`` (or ``lr`` without bias correction)."""
        return self.lr / (1.0 - self.beta1**step) if self.bias_correction else self.lr

    def bc2_sqrt(self, step: int) -> float:
        """``sqrt(1 - beta2**step)`` (or 1 without bias correction)."""
        return math.sqrt(1.0 - self.beta2**step) if self.bias_correction else 1.0

    @property
    def grad_scale_inv(self) -> float:
        """Factor every grad is multiplied by."""
        return 1.0 / self.div_scale if self.div_scale > 0 else 1.0


def torch_adam_step(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor | None], steps: Sequence[int], hyper: AdamHyper,
    num_threads: int | None = None,
) -> None:
    """The update in plain torch ops, on any device (the fallback of every kernel)."""
    inv = hyper.grad_scale_inv
    for p, g, m, v, c, step in zip(params, grads, exp_avgs, exp_avg_sqs, copies, steps,
                                   strict=True):
        g = g.view_as(p)
        if g.dtype != torch.float32 or inv != 1.0:
            g = g.to(torch.float32, copy=True)
            if inv != 1.0:
                g.mul_(inv)
        if hyper.weight_decay != 0.0:
            if hyper.adamw_mode:
                p.mul_(1.0 - hyper.lr * hyper.weight_decay)
            else:
                g = g.add(p, alpha=hyper.weight_decay)
        m.lerp_(g, 1.0 - hyper.beta1)
        v.mul_(hyper.beta2).addcmul_(g, g, value=1.0 - hyper.beta2)
        denom = (v.sqrt() / hyper.bc2_sqrt(step)).add_(hyper.eps)
        p.addcdiv_(m, denom, value=-hyper.step_size(step))
        if c is not None:
            c.view_as(p).copy_(p)


ISA_ENV = "COLOSSAL_CPU_ADAM_ISA"
ISAS = ("portable", "avx2", "avx512")  # the C library's codes 0, 1, 2


def supported_isas(lib: ctypes.CDLL) -> tuple[str, ...]:
    """The instruction sets the library can run on this CPU, worst first."""
    mask = lib.colossal_adam_supported_isas()
    return tuple(name for code, name in enumerate(ISAS) if mask & (1 << code))


def resolve_isa(lib: ctypes.CDLL, isa: str | None = None) -> str:
    """The instruction set a step asked for ``isa`` runs.

    Args:
        lib: The loaded library.
        isa: ``"auto"`` (the best this CPU runs), ``"avx512"``, ``"avx2"`` or ``"portable"``;
            ``None`` reads ``$COLOSSAL_CPU_ADAM_ISA`` (unset: ``"auto"``).

    Raises:
        ValueError: An unknown name, or one this CPU cannot run.
    """
    requested = isa if isa is not None else os.environ.get(ISA_ENV, "auto")
    name = requested.strip().lower() or "auto"
    source = f"isa={requested!r}" if isa is not None else f"{ISA_ENV}={requested!r}"
    if name != "auto" and name not in ISAS:
        raise ValueError(f"{source} is not an instruction set of the CPU Adam kernel; use "
                         f"'auto' or one of {ISAS}")
    code = lib.colossal_adam_resolve_isa(-1 if name == "auto" else ISAS.index(name))
    if code < 0:
        raise ValueError(f"{source}: this CPU cannot run it; it runs {supported_isas(lib)} "
                         "(or use 'auto')")
    return ISAS[code]


class CppAdam:
    """Calls the C++ library built by :mod:`colossal.kernels._jit` (one call per group).

    Args:
        lib: The loaded library.
        num_threads: OpenMP threads per call; ``None`` follows ``torch.get_num_threads()`` at
            each call.
        isa: Instruction set (see :func:`resolve_isa`); ``None`` reads
            ``$COLOSSAL_CPU_ADAM_ISA`` once, here.

    Attributes:
        simd: The instruction set the steps run: ``"avx512"``, ``"avx2"`` or ``"portable"``
            (the compiler's vectorisation of a plain loop for the build's baseline).
    """

    def __init__(self, lib: ctypes.CDLL, num_threads: int | None = None,
                 isa: str | None = None) -> None:
        self.lib = lib
        self.num_threads = num_threads
        self.simd = resolve_isa(lib, isa)
        self._isa_code = ISAS.index(self.simd)

    @property
    def last_num_threads(self) -> int:
        """OpenMP threads the library's last step ran on (any instance; 1: serially)."""
        return int(self.lib.colossal_adam_last_threads())

    def __call__(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
        exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
        copies: Sequence[torch.Tensor | None], steps: Sequence[int], hyper: AdamHyper,
        num_threads: int | None = None,
    ) -> None:
        """Run one fused update over all tensors (see the module docstring).

        Runs on ``num_threads``, else the instance's ``num_threads``, else
        ``torch.get_num_threads()`` read now (so ``torch.set_num_threads`` applies to the
        next step; ``OMP_NUM_THREADS`` only through torch's own default).
        """
        n = len(params)
        if n == 0:
            return
        ptrs = ctypes.c_void_p * n
        numels = (ctypes.c_int64 * n)(*(p.numel() for p in params))
        copy_ptrs = ptrs(*(c.data_ptr() if c is not None else None for c in copies))
        copy_codes = (ctypes.c_int32 * n)(
            *(_DTYPE_CODE[c.dtype] if c is not None else -1 for c in copies)
        )
        grad_codes = (ctypes.c_int32 * n)(*(_DTYPE_CODE[g.dtype] for g in grads))
        step_sizes = (ctypes.c_float * n)(*(hyper.step_size(s) for s in steps))
        inv_bc2 = (ctypes.c_float * n)(*(1.0 / hyper.bc2_sqrt(s) for s in steps))
        threads = num_threads or self.num_threads or torch.get_num_threads()
        ran = self.lib.colossal_adam_step(
            n, numels, ptrs(*(p.data_ptr() for p in params)),
            ptrs(*(g.data_ptr() for g in grads)), ptrs(*(m.data_ptr() for m in exp_avgs)),
            ptrs(*(v.data_ptr() for v in exp_avg_sqs)), copy_ptrs, grad_codes, copy_codes,
            step_sizes, inv_bc2, hyper.beta1, hyper.beta2, hyper.eps, hyper.lr,
            hyper.weight_decay, int(hyper.adamw_mode), hyper.grad_scale_inv, threads,
            self._isa_code,
        )
        if ran != self._isa_code:  # resolved in __init__ on the same CPU: cannot happen
            raise RuntimeError(f"CPU Adam kernel ran instruction set {ran}, not {self.simd}")


def check_adam_tensors(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor | None],
) -> None:
    """Raise ``TypeError``/``ValueError`` for tensors a kernel cannot take."""
    for p, g, c in zip(params, grads, copies, strict=True):
        if p.dtype != torch.float32:
            raise TypeError(
                f"Adam kernels update fp32 (master) params, got a {p.dtype} param of shape "
                f"{tuple(p.shape)}; keep fp32 master params and attach the low-precision "
                "param as a working copy (attach_working_params)"
            )
        if g.dtype not in GRAD_DTYPES:
            raise TypeError(f"grad dtype {g.dtype} is not supported; use one of {GRAD_DTYPES}")
        if g.numel() != p.numel() or g.device != p.device:
            raise ValueError(
                f"grad of shape {tuple(g.shape)} on {g.device} does not match its param of "
                f"shape {tuple(p.shape)} on {p.device}"
            )
        if g.is_sparse or not g.is_contiguous():
            raise ValueError("Adam kernels need dense contiguous grads; call .contiguous()")
        if c is not None and (c.dtype not in COPY_DTYPES or c.numel() != p.numel()
                              or c.device != p.device or not c.is_contiguous()):
            raise ValueError(
                f"working copy ({c.dtype}, shape {tuple(c.shape)}, {c.device}) must be a "
                f"contiguous fp32/fp16/bf16 tensor with {p.numel()} elements on {p.device}"
            )
