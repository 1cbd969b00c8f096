"""Ulysses (``all_to_all``) sequence parallelism.

Direct case: every rank holds its tokens of one q/k/v; the Ulysses attention's output and the
q/k/v gradients must equal SDPA over the whole sequence, for causal, padded, non-causal,
4-D custom masks, grouped-query attention (key/value heads exchanged as they are) and the
zigzag layout (the gathered sequence is reordered before the mask applies).

What each check catches: an all-to-all that mixes heads or tokens (wrong outputs); a
backward that is not the reverse exchange (wrong gradients); key/value heads repeated
before the exchange (the byte count); a mask applied to tokens in gathered instead of
global order (zigzag case).

Comm tracker: counted as the input of each ``all_to_all`` (the logical volume a rank
exchanges, its own 1/P slice included). Forward moves q, k, v and the output: for
``B`` sequences of ``s`` tokens and ``h = H * D``, ``4 * B * s * h / P`` elements per layer
per rank when key/value heads equal query heads (``(2 + 2 * Hk / H) * B * s * h / P`` with
grouped-query attention); the backward moves the same again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

from colossal.core.testing import distributed_test, relative_error

RTOL = 1e-5


class _Attn(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.is_causal = causal


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, causal: bool
) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if mask.dim() == 2:
        keep = mask.bool()[:, None, None, :]
        if causal:
            s = q.shape[2]
            keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _case(
    rank: int,
    size: int,
    name: str,
    mask: Any,
    causal: bool,
    hk: int = 4,
    layout: str = "contiguous",
) -> None:
    from colossal.core import CommTracker
    from colossal.shardformer.sequence.layout import token_indices
    from colossal.shardformer.sequence.ulysses import ulysses_attention_forward

    b, hq, s, d = 2, 4, 16, 8
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(b, h, s, d, generator=gen) for h in (hq, hk, hk))
    w = torch.randn(b, hq, s, d, generator=gen)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference(*full, mask, causal)
    (ref * w).sum().backward()

    mine = token_indices(s, rank, size, layout)
    positions = None
    if layout != "contiguous":
        positions = torch.cat([token_indices(s, r, size, layout) for r in range(size)])
    local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    with CommTracker() as fwd:
        out, _ = ulysses_attention_forward(_Attn(causal), *local, mask, positions=positions)
    out = out.transpose(1, 2)  # [B, H, s/P, D]
    with CommTracker() as bwd:
        (out * w[:, :, mine]).sum().backward()
    errors = {"out": relative_error(out, ref[:, :, mine])}
    for label, got, want in zip("qkv", local, full, strict=True):
        errors[f"d{label}"] = relative_error(got.grad, want.grad[:, :, mine])
    bad = {key: e for key, e in errors.items() if not e <= RTOL}
    assert not bad, f"{name} (rank {rank}/{size}): {bad}"
    h = hq * d
    elements = (2 + 2 * hk / hq) * b * s * h / size  # q, out: full h; k, v: hk heads
    for tracker in (fwd, bwd):
        assert tracker.calls("all_to_all") == 4
        assert tracker.bytes("all_to_all") == elements * 4, name  # fp32


def _masks(s: int = 16) -> dict[str, Any]:
    pad = torch.ones(2, s, dtype=torch.long)
    pad[1, :5] = 0
    custom = torch.ones(s, s, dtype=torch.bool).tril()
    custom[:, 3] = False
    custom[3, 3] = True
    return {"pad": pad, "bool4": custom.expand(2, 1, s, s).clone()}


@distributed_test(2)
def test_ulysses_attention_matches_full_attention(rank: int, world_size: int) -> None:
    """Outputs and q/k/v gradients equal SDPA over the whole sequence; exact exchange volume."""
    m = _masks()
    _case(rank, world_size, "causal", None, True)
    _case(rank, world_size, "causal+padding", m["pad"], True)
    _case(rank, world_size, "not causal+padding", m["pad"], False)
    _case(rank, world_size, "4-D bool", m["bool4"], True)
    _case(rank, world_size, "GQA", m["pad"], True, hk=2)
    _case(rank, world_size, "zigzag", m["pad"], True, layout="zigzag")
    from colossal.shardformer.sequence.ulysses import seq_to_heads

    with pytest.raises(ValueError, match="3 heads over 2"):
        seq_to_heads(torch.randn(1, 3, 4, 2), None)
