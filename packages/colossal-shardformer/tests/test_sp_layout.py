"""Sequence layouts and the differentiable split / gather / reduce-scatter along the sequence.

Unit checks (no spawn): the contiguous and zigzag token indices cover every token exactly
once, in the documented order, and refuse lengths they cannot split. One 2-rank spawn: split
then gather is the identity (values and gradient) in both layouts, the split keeps exactly
``x[:, token_indices(...)]``, the gather's gradient is this rank's slice, and the Megatron
primitives ``gather_sequence_to_tp`` / ``reduce_scatter_sequence`` (3-D and flattened 2-D)
match a hand-computed reference, forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from colossal.core.testing import distributed_test


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_indices_cover_every_token_once(kind: str, size: int) -> None:
    """Catches a layout dropping or duplicating tokens (a rank computing on the wrong ones)."""
    from colossal.shardformer.sequence import token_indices

    seq_len = 2 * size * 3
    parts = [token_indices(seq_len, r, size, kind) for r in range(size)]
    assert all(p.numel() == seq_len // size for p in parts)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq_len))


def test_index_order() -> None:
    """Contiguous slices; zigzag chunks ``r`` and ``2P - 1 - r`` in that order (load balance)."""
    from colossal.shardformer.sequence import token_indices

    assert token_indices(8, 1, 2, "contiguous").tolist() == [4, 5, 6, 7]
    assert token_indices(8, 0, 2, "zigzag").tolist() == [0, 1, 6, 7]
    assert token_indices(8, 1, 2, "zigzag").tolist() == [2, 3, 4, 5]
    assert token_indices(16, 1, 4, "zigzag").tolist() == [2, 3, 12, 13]
    # Causal work (sum of positions + 1) is equal on every rank with zigzag.
    work = [int((token_indices(16, r, 4, "zigzag") + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1, work


def test_refuses_bad_input() -> None:
    """Unsplittable lengths name the length, the size and the multiple to pad to."""
    from colossal.shardformer.sequence import check_sequence_length, token_indices

    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 4; pad"):
        check_sequence_length(6, 2, "zigzag")
    with pytest.raises(ValueError, match=r"sequence length 7 is not divisible by 2"):
        token_indices(7, 0, 2, "contiguous")
    with pytest.raises(ValueError, match="layout must be one of"):
        token_indices(8, 0, 2, "striped")
    with pytest.raises(ValueError, match="outside the sequence-parallel group"):
        token_indices(8, 2, 2, "contiguous")


def test_single_process_is_identity() -> None:
    """Without torch.distributed (one rank) split and gather return the input unchanged."""
    from colossal.shardformer.sequence import gather_sequence, split_sequence

    x = torch.randn(2, 6, 3)
    assert split_sequence(x, None, "zigzag") is x
    assert gather_sequence(x, None, "zigzag") is x


@distributed_test(2)
def test_split_gather_roundtrip(rank: int, world_size: int) -> None:
    """Split/gather round trip and the Megatron primitives on 2 ranks, forward and backward."""
    from colossal.shardformer.layer._primitives import (
        gather_sequence_to_tp,
        reduce_scatter_sequence,
    )
    from colossal.shardformer.sequence import gather_sequence, split_sequence, token_indices

    gen = torch.Generator().manual_seed(0)
    for kind in ("contiguous", "zigzag"):
        x = torch.randn(2, 8, 3, generator=gen).requires_grad_()
        w = torch.randn(2, 8, 3, generator=gen)
        local = split_sequence(x, None, kind)
        # Catches a wrong slice: the rank must hold exactly its layout's tokens.
        assert torch.equal(local, x.detach()[:, token_indices(8, rank, world_size, kind)])
        full = gather_sequence(local, None, kind)
        assert torch.equal(full, x.detach())  # catches a gather in the wrong order
        (full * w).sum().backward()
        # gather keeps this rank's slice of the (replicated) gradient, split all-gathers it.
        assert torch.equal(x.grad, w), kind

    # Megatron primitives: every rank holds different data here.
    b, s, h = 2, 8, 3
    per = s // world_size
    full = torch.randn(world_size, b, s, h, generator=gen)  # rank r's partial sums
    mine = full[rank].clone().requires_grad_()
    out = reduce_scatter_sequence(mine, None)
    expect = full.sum(0)[:, rank * per : (rank + 1) * per]
    torch.testing.assert_close(out, expect)  # catches a scatter of the wrong slice
    g = torch.randn(world_size, b, per, h, generator=gen)
    out.backward(g[rank])
    # backward all-gathers the slices' gradients in rank order
    torch.testing.assert_close(mine.grad, torch.cat(list(g), dim=1))

    shard = full[rank][:, :per].clone().requires_grad_()
    gathered = gather_sequence_to_tp(shard, None)
    torch.testing.assert_close(gathered, torch.cat([full[r][:, :per] for r in range(2)], 1))
    gg = torch.randn(world_size, b, s, h, generator=gen)
    gathered.backward(gg[rank])
    # backward reduce-scatters: the sum over ranks of this rank's slice
    torch.testing.assert_close(shard.grad, gg.sum(0)[:, rank * per : (rank + 1) * per])

    # flattened (batch * seq, hidden) activations, as OPT's MLP sees them
    flat = shard.detach().reshape(b * per, h)
    torch.testing.assert_close(
        gather_sequence_to_tp(flat, None, batch_size=b), gathered.detach().reshape(b * s, h)
    )
    torch.testing.assert_close(
        reduce_scatter_sequence(mine.detach().reshape(b * s, h), None, batch_size=b),
        expect.reshape(b * per, h),
    )
