"""Run local experts on tokens grouped by expert: one grouped matmul where torch has one."""

from __future__ import annotations

import torch

__all__ = ["grouped_matmul"]


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
    return torch.cat([part @ w[e] for e, part in enumerate(parts)], dim=0)
