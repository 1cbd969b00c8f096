"""``attention``: scaled dot-product attention with mask descriptions and backend dispatch.

The kernel registry's ``"attention"`` kernel has two implementations: ``sdpa`` (PyTorch's
``scaled_dot_product_attention`` restricted to the best backends for the device and dtype, in
priority order) and ``eager`` (matmul + softmax, the reference). On CPU, ``sdpa`` sends
causal calls that tile (:func:`~colossal.kernels.attention.cpu_causal.tiled_causal_supported`)
to the tiled flash kernel, which skips the masked work PyTorch's kernel computes
(``TILED_CAUSAL = False`` turns that off, e.g. for A/B measurements).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from colossal.kernels.attention.cpu_causal import causal_flash_attention, tiled_causal_supported
from colossal.kernels.attention.mask import AttentionMask, AttnMaskType, dense_bool_mask
from colossal.kernels.registry import REGISTRY

AttnFn = Callable[..., torch.Tensor]
_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

TILED_CAUSAL = True
"""Route causal CPU calls that tile to :func:`causal_flash_attention` (False: plain SDPA)."""


def sdpa_backends(device: torch.device, dtype: torch.dtype, has_mask: bool) -> list:
    """The SDPA backends to allow for a call, best first."""
    from torch.nn.attention import SDPBackend

    if device.type == "cuda":
        order = []
        if dtype in (torch.float16, torch.bfloat16) and not has_mask:
            order.append(SDPBackend.FLASH_ATTENTION)
        if dtype in (torch.float16, torch.bfloat16):
            order.append(SDPBackend.CUDNN_ATTENTION)
        return [*order, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    if device.type == "cpu":
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    return [SDPBackend.MATH]


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                   dropout_p: float, scale: float | None) -> torch.Tensor:
    """``attention`` through ``scaled_dot_product_attention`` with chosen backends."""
    from torch.nn.attention import sdpa_kernel

    sq, sk = q.shape[-2], k.shape[-2]
    is_causal = mask.kind == AttnMaskType.CAUSAL and sq == sk
    if is_causal and TILED_CAUSAL and tiled_causal_supported(q, k, v, dropout_p):
        return causal_flash_attention(q, k, v, scale)
    dense = None if is_causal else dense_bool_mask(mask, sq, sk, q.device)
    kwargs = {}
    if q.shape[1] != k.shape[1]:
        if _GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = _expand_kv(q, k, v)
    with sdpa_kernel(sdpa_backends(q.device, q.dtype, dense is not None), set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, **kwargs)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                    dropout_p: float, scale: float | None) -> torch.Tensor:
    """``attention`` as matmul + softmax in fp32 (the reference implementation)."""
    k, v = _expand_kv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    dense = dense_bool_mask(mask, q.shape[-2], k.shape[-2], q.device)
    if dense is not None:
        if dense.dtype == torch.bool:
            scores = scores.masked_fill(~dense, float("-inf"))
        else:
            scores = scores + dense.float()
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v.float()).to(q.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: AttentionMask | AttnMaskType | str | None = None, *, dropout_p: float = 0.0,
              scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention dispatched to the best kernel for the device and dtype.

    Args:
        q: ``[B, Hq, Sq, D]`` queries.
        k: ``[B, Hk, Sk, D]`` keys (``Hq`` a multiple of ``Hk`` for grouped-query attention).
        v: ``[B, Hk, Sk, Dv]`` values.
        mask: An :class:`AttentionMask` (see :func:`make_attention_mask`), or a mask type
            (``"none"``/``"causal"``) for masks needing no tensors; ``None`` means no mask.
        dropout_p: Attention dropout probability (pass 0 in evaluation).
        scale: Score scale (default ``1/sqrt(D)``).

    Returns:
        ``[B, Hq, Sq, Dv]``; rows of padded queries are zero.

    Raises:
        ValueError: Shapes that do not fit together, or a mask type that needs tensors.
    """
    if isinstance(mask, (AttnMaskType, str)) or mask is None:
        kind = AttnMaskType(mask) if mask is not None else AttnMaskType.NONE
        if kind not in (AttnMaskType.NONE, AttnMaskType.CAUSAL):
            raise ValueError(f"mask type {kind.value!r} needs tensors; build it with "
                             "make_attention_mask(attention_mask) or AttentionMask(...)")
        mask = AttentionMask(kind)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [batch, heads, seq, head_dim]; got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if (k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]
            or q.shape[1] % k.shape[1] != 0):
        raise ValueError(
            f"incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: batch "
            "and key/value lengths must match and q heads must be a multiple of kv heads"
        )
    if mask.kind in (AttnMaskType.PADDED, AttnMaskType.PADDED_CAUSAL):
        assert mask.kv_padding_mask is not None
        if tuple(mask.kv_padding_mask.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(f"kv_padding_mask of shape {tuple(mask.kv_padding_mask.shape)} "
                             f"does not match batch {k.shape[0]} and key length {k.shape[2]}")
    qpm = mask.q_padding_mask
    if qpm is not None and tuple(qpm.shape) != (q.shape[0], q.shape[2]):
        raise ValueError(f"q_padding_mask of shape {tuple(qpm.shape)} does not match batch "
                         f"{q.shape[0]} and query length {q.shape[2]}")
    impl: AttnFn = REGISTRY.get("attention", q.device)
    out = impl(q, k, v, mask, dropout_p, scale)
    if qpm is not None:
        out = out * qpm.to(out.device).view(q.shape[0], 1, q.shape[2], 1)
    return out
