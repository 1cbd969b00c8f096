# ruff: noqa: N803 - Triton kernels name pointer and constexpr arguments in capitals
"""Multi-tensor Adam/AdamW in Triton: one launch updates every tensor of a dtype combination.

A table of per-tensor addresses (param, grad, exp_avg, exp_avg_sq, copy) and a list of
``(tensor, block start)`` work items are built on the host; each program updates one block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from colossal.kernels.optim._functional import AdamHyper

BLOCK = 1024
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _adam_kernel(
    addr_ptr, numel_ptr, step_size_ptr, inv_bc2_ptr, item_tensor_ptr, item_start_ptr,
    beta1, beta2, eps, decay, l2, grad_scale_inv,
    GRAD_DTYPE: tl.constexpr, COPY_DTYPE: tl.constexpr, HAS_COPY: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    item = tl.program_id(0)
    t = tl.load(item_tensor_ptr + item)
    start = tl.load(item_start_ptr + item)
    n = tl.load(numel_ptr + t)
    step_size = tl.load(step_size_ptr + t)
    inv_bc2 = tl.load(inv_bc2_ptr + t)
    base = addr_ptr + t * 5
    p_ptr = tl.load(base).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(base + 1).to(tl.pointer_type(GRAD_DTYPE))
    m_ptr = tl.load(base + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(base + 3).to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale_inv
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = g + l2 * p
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0) + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) * inv_bc2 + eps
    p = p * decay - step_size * (m / denom)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    tl.store(p_ptr + offs, p, mask=mask)
    if HAS_COPY:
        c_ptr = tl.load(base + 4).to(tl.pointer_type(COPY_DTYPE))
        if COPY_DTYPE == tl.bfloat16:
            # Round to nearest even explicitly (the interpreter truncates on .to(bfloat16)).
            u = p.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            tl.store(c_ptr + offs, u.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        else:
            tl.store(c_ptr + offs, p.to(COPY_DTYPE), mask=mask)


def triton_adam_step(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
    copies: Sequence[torch.Tensor | None], steps: Sequence[int], hyper: AdamHyper,
    num_threads: int | None = None,
) -> None:
    """The Adam update (see :mod:`colossal.kernels.optim._functional`) as Triton launches."""
    groups: dict[tuple[torch.dtype, torch.dtype | None], list[int]] = {}
    for i, (g, c) in enumerate(zip(grads, copies, strict=True)):
        groups.setdefault((g.dtype, c.dtype if c is not None else None), []).append(i)
    decoupled = hyper.adamw_mode and hyper.weight_decay != 0.0
    decay = 1.0 - hyper.lr * hyper.weight_decay if decoupled else 1.0
    l2 = hyper.weight_decay if not hyper.adamw_mode else 0.0
    for (gdt, cdt), idx in groups.items():
        device = params[idx[0]].device
        addrs, numels, sizes, bc2s, items_t, items_s = [], [], [], [], [], []
        for j, i in enumerate(idx):
            c = copies[i]
            addrs += [params[i].data_ptr(), grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                      exp_avg_sqs[i].data_ptr(), c.data_ptr() if c is not None else 0]
            n = params[i].numel()
            numels.append(n)
            sizes.append(hyper.step_size(steps[i]))
            bc2s.append(1.0 / hyper.bc2_sqrt(steps[i]))
            starts = range(0, n, BLOCK)
            items_t += [j] * len(starts)
            items_s += list(starts)
        if not items_t:
            continue

        def tensor(values: list, dtype: torch.dtype, _device: torch.device = device
                   ) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(_device, non_blocking=True)

        _adam_kernel[(len(items_t),)](
            tensor(addrs, torch.int64), tensor(numels, torch.int64),
            tensor(sizes, torch.float32), tensor(bc2s, torch.float32),
            tensor(items_t, torch.int64), tensor(items_s, torch.int64),
            hyper.beta1, hyper.beta2, hyper.eps, decay, l2, hyper.grad_scale_inv,
            GRAD_DTYPE=_TL_DTYPES[gdt], COPY_DTYPE=_TL_DTYPES[cdt or torch.float32],
            HAS_COPY=cdt is not None, BLOCK_SIZE=BLOCK,
        )
