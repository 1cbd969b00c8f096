"""Ring attention's causal diagonal blocks through colossal-kernels' tiled causal flash kernel.

At 1024 tokens over 2 ranks (zigzag chunks of 256), each rank's own two chunks are causal
diagonals that ring attention hands to ``causal_flash_forward`` / ``causal_flash_backward``
(blocks of 64). Checked against fp64 attention over the whole sequence (outputs and q/k/v
gradients, grouped-query heads) and against the ring with one plain kernel call per diagonal.

Catches: the tiled path not taken for a diagonal (call counts), or taken with the wrong
arguments: the grouped ``[B, Hk, R, nq]`` log-sum-exp or output reshaped into the wrong head
order, the tiled ``dq`` (``(B, S, H, D)`` memory) viewed back into the wrong shape, or a
diagonal's key/value gradients not added to the block's share (wrong outputs or gradients).
"""

from __future__ import annotations

from typing import Any

import torch

from colossal.core.testing import distributed_test


def _full(s: int, h: int, hk: int, d: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(1, s, n, d, generator=g).transpose(1, 2) for n in (h, hk, hk)]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.shape[2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


def _run(rank: int, size: int, full: list[torch.Tensor], w: torch.Tensor) -> list[torch.Tensor]:
    from colossal.shardformer.sequence.layout import token_indices
    from colossal.shardformer.sequence.ring import ring_attention

    s = full[0].shape[2]
    positions = [torch.as_tensor(token_indices(s, r, size, "zigzag")) for r in range(size)]
    mine = positions[rank]
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    out = ring_attention(*local, positions, None, True, chunks=2)
    (out * w[:, :, mine]).sum().backward()
    return [out.detach(), *(t.grad for t in local)]


@distributed_test(2)
def test_ring_tiled_diagonals(rank: int, world_size: int) -> None:
    from colossal.shardformer.sequence import ring_blocks

    s, h, hk, d = 1024, 4, 2, 16
    full = _full(s, h, hk, d)
    w = torch.randn(1, h, s, d, generator=torch.Generator().manual_seed(5))
    calls: list[str] = []
    fwd, bwd = ring_blocks._tiled_fwd, ring_blocks._tiled_bwd

    def counted(name: str, fn: Any) -> Any:
        def inner(*args: Any) -> Any:
            calls.append(name)
            assert args[-1] == 64, args[-1]  # the block size measured best for 256 tokens
            return fn(*args)

        return inner

    ring_blocks._tiled_fwd, ring_blocks._tiled_bwd = counted("fwd", fwd), counted("bwd", bwd)
    try:
        tiled = _run(rank, world_size, full, w)
    finally:
        ring_blocks._tiled_fwd, ring_blocks._tiled_bwd = fwd, bwd
    assert calls == ["fwd", "fwd", "bwd", "bwd"], calls  # the rank's two diagonal chunks

    # fp64 attention over the whole sequence, at this rank's tokens.
    from colossal.shardformer.sequence.layout import token_indices

    mine = torch.as_tensor(token_indices(s, rank, world_size, "zigzag"))
    ref_in = [t.detach().double().requires_grad_() for t in full]
    ref = _reference(*ref_in)
    (ref * w.double()).sum().backward()
    want = [ref.detach(), *(t.grad for t in ref_in)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), tiled, want, strict=True):
        torch.testing.assert_close(a.double(), b[:, :, mine], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")

    # The same ring with one plain kernel call per diagonal.
    original = ring_blocks.tiled_causal_block
    ring_blocks.tiled_causal_block = lambda *a, **k: None
    try:
        plain = _run(rank, world_size, full, w)
    finally:
        ring_blocks.tiled_causal_block = original
    for name, a, b in zip(("out", "dq", "dk", "dv"), tiled, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
