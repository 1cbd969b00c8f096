"""Run local experts on tokens grouped by expert: one grouped matmul where torch has one."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["grouped_ffn", "grouped_matmul"]


def _use_grouped_mm(x: torch.Tensor, w: torch.Tensor) -> bool:
    # torch._grouped_mm has no CPU backward (torch 2.13); on CUDA it wants bf16 and 16-byte strides
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == w.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and w.shape[-1] % 8 == 0
    )


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x`` rows grouped by expert (``counts[e]`` rows for expert ``e``) times ``w[e]``.

    Args:
        x: ``[N, in]`` tokens sorted by expert.
        w: ``[E, in, out]`` one weight per expert.
        counts: Rows per expert (sum ``N``); an expert with 0 rows gets a zero gradient.

    Returns:
        ``[N, out]``.
    """
    if _use_grouped_mm(x, w):
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    parts = torch.split(x, counts)
    return torch.cat([part @ we for part, we in zip(parts, w.unbind(0), strict=True)], dim=0)


def _ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    gated: bool,
) -> torch.Tensor:
    hidden = x @ w1
    if gated:
        gate, up = hidden.chunk(2, dim=-1)
        return (activation(gate) * up) @ w2
    return activation(hidden) @ w2


def grouped_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    counts: list[int],
    activation: Callable[[torch.Tensor], torch.Tensor],
    gated: bool,
) -> torch.Tensor:
    """Each expert's feed-forward ``act(x W1_e) W2_e`` on its rows (``gated``: SwiGLU-style).

    With a grouped matmul: one per projection over all experts. Without (CPU, fp32): the rows
    are split once and each expert runs its whole block, then one concatenation; two grouped
    fallbacks would split and concatenate twice and copy the hidden activations once more.
    The weights are unbound once (not indexed per expert) so the backward writes each weight's
    gradient once instead of summing ``E`` zero-padded copies of it.

    Args:
        x: ``[N, H]`` tokens sorted by expert.
        w1: ``[E, H, F or 2F]`` (``gated``: ``[gate | up]``).
        w2: ``[E, F, H]``.
        counts: Rows per expert (sum ``N``).
        activation: The nonlinearity.
        gated: ``act(x Wg) * (x Wu)`` with ``W1 = [Wg | Wu]``.

    Returns:
        ``[N, H]``.
    """
    if _use_grouped_mm(x, w1):
        hidden = grouped_matmul(x, w1, counts)
        if gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = activation(gate) * up
        else:
            hidden = activation(hidden)
        return grouped_matmul(hidden, w2, counts)
    parts = torch.split(x, counts)
    # unbind: one backward node stacks the experts' gradients; indexing w1[e] per expert would
    # give each expert a zero-filled gradient of the whole [E, ...] weight and sum E of them.
    pairs = zip(w1.unbind(0), w2.unbind(0), strict=True)
    outs = [_ffn(part, a, b, activation, gated) for part, (a, b) in zip(parts, pairs, strict=True)]
    return torch.cat(outs, dim=0)
