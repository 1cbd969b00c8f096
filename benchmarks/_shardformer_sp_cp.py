"""PyTorch's ``context_parallel`` ring attention on CPU: the one missing dispatch entry.

``torch.distributed.tensor.experimental.context_parallel`` swaps
``F.scaled_dot_product_attention`` for a version that wraps q/k/v in sequence-sharded
DTensors (``Shard(2)``); DTensor then routes the SDPA *kernel op* to CP's ring attention
(``_templated_ring_attention`` and its backward) through a table of custom op handlers.
That table (``_attention.custom_ops``) and CP's sharding rules only name the CUDA kernels
(``_scaled_dot_product_flash_attention``, ``..._efficient_attention``, ``..._cudnn_attention``
and their backwards). On CPU, SDPA decomposes to
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``..._for_cpu_backward``), so as
shipped (torch 2.13) CP fails on CPU with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered".

:func:`enable_cpu_context_parallel` adds exactly that entry, changing nothing else:

* a sharding strategy for the two CPU ops, the same ``Shard(2)``-everywhere strategy CP
  registers for the CUDA flash kernel (q, k, v, out, logsumexp and the gradients sharded
  along the sequence);
* a handler in CP's own ``custom_ops`` table (so CP's context manager enables and disables
  it together with its own) that does what CP's ``_sdpa_handler`` does for the CUDA flash
  kernel -- unwrap, propagate, run CP's ``_templated_ring_attention`` /
  ``_templated_ring_attention_backward`` with the CPU flash kernel as the block op, wrap.

The ring algorithm, its load balancing (head-tail, i.e. zigzag, for causal masks), the
online-softmax merge, the K/V rotation (``set_rotate_method``) and the gradient rotation are
PyTorch's code, unchanged. The CPU flash kernel returns ``(out, logsumexp)`` with
``logsumexp`` shaped ``(B, H, S)``, like the CUDA flash kernel, which is what CP's merger
expects.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
SEQ_DIM = 2
_CPU_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_installed = False


def _forward_strategy(op_schema: Any) -> Any:
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    mesh = op_schema.get_mesh_from_args()
    # outputs (out, logsumexp), then inputs (q, k, v)
    strategy = [[Shard(SEQ_DIM)] * 5]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategy, input_index=2)


def _backward_strategy(op_schema: Any) -> Any:
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    # outputs (grad_q, grad_k, grad_v), then inputs (grad_out, q, k, v, out, logsumexp)
    strategy = [[Shard(SEQ_DIM)] * 9]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategy, input_index=3)


def _ring_forward(
    mesh: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if attn_mask is not None:
        raise NotImplementedError("context_parallel ring attention takes no attn_mask")
    return cp._templated_ring_attention(
        mesh.get_group(),
        SEQ_DIM,
        aten._scaled_dot_product_flash_attention_for_cpu,
        query=query,
        key=key,
        value=value,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _ring_backward(
    mesh: Any,
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if attn_mask is not None:
        raise NotImplementedError("context_parallel ring attention takes no attn_mask")
    return cp._templated_ring_attention_backward(
        mesh.get_group(),
        SEQ_DIM,
        _CPU_BWD,
        grad_out=grad_out,
        grad_out_name="grad_out",
        query=query,
        key=key,
        value=value,
        out=out,
        logsumexp=logsumexp,
        is_causal=is_causal,
        dropout_p=dropout_p,
        scale=scale,
    )


def _cpu_sdpa_handler(op_call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """CP's ``_sdpa_handler`` for the CPU flash kernel (same steps, CPU block op)."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError(f"context parallel CPU SDPA: unexpected sharding {sharding}")
    ring = _ring_forward if op_call is _CPU_FWD else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def enable_cpu_context_parallel() -> None:
    """Let ``context_parallel`` dispatch CPU SDPA to its ring attention (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    register_op_strategy(_CPU_FWD, schema_info=RuntimeSchemaInfo(3))(_forward_strategy)
    register_op_strategy(_CPU_BWD, schema_info=RuntimeSchemaInfo(6))(_backward_strategy)
    cp.custom_ops[_CPU_FWD] = _cpu_sdpa_handler
    cp.custom_ops[_CPU_BWD] = _cpu_sdpa_handler
    _installed = True
