"""fp8 communication: results within the codec's error bound of float32's, a quarter of the bytes.

The bound (colossal.core.comm.fp8_codec): ``eps/2 * |x| + tiny*eps/2 * scale`` per element.
The inputs span magnitudes 3e-2 .. 3e3 (ranks differ by 10x), so an encoding without a scale
saturates (e4m3 max 448) or flushes to zero, and a scale off by a factor of two doubles or
saturates the error: both exceed the bound, which is 6% relative for e4m3.
"""

from __future__ import annotations

import pytest
import torch

from colossal.core.comm import (
    CommTracker,
    Fp8Codec,
    all_gather,
    all_reduce,
    all_to_all,
    fp8_all_gather,
    fp8_all_reduce,
    fp8_all_to_all,
    fp8_recv,
    fp8_reduce_scatter,
    fp8_send,
    recv,
    reduce_scatter,
    send,
)
from colossal.core.testing import distributed_test

CODECS = (Fp8Codec(), Fp8Codec(block_size=32), Fp8Codec("e5m2"))


def _data(rank: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return torch.randn(n, generator=gen) * 3.0 * 10.0 ** (rank - 1)


def test_codec_round_trip_within_a_tight_bound() -> None:
    """Catches a wrong scale (amax/max off by any factor), a missing scale, a scale applied to
    the wrong block, lost NaN/inf, and a bound so loose it could not catch those."""
    x = torch.cat([_data(r, 200) for r in range(3)])
    for codec in CODECS:
        enc = codec.encode(x)
        assert enc.dtype == torch.uint8 and enc.numel() == x.numel() + 4 * codec.num_scales(600)
        err = (codec.decode(enc, 600) - x).abs()
        bound = codec.error_bound(x)
        assert (err <= bound).all(), codec
        assert (err / bound).max() > 0.5, f"bound not tight for {codec}"
        # A scale twice too large: the error leaves the bound somewhere.
        wrong = enc.clone()
        scales = wrong[600:].view(torch.float32)
        wrong[600:] = (scales * 2).view(torch.uint8)
        assert ((codec.decode(wrong, 600) - x).abs() > bound).any()
    # Without a scale (scale 1) values above 448 saturate and small ones flush.
    plain = x.to(torch.float8_e4m3fn).float()
    assert ((plain - x).abs() > Fp8Codec().error_bound(x)).any()
    bad = torch.tensor([1.0, float("inf"), 2.0])
    assert torch.isnan(Fp8Codec().decode(Fp8Codec().encode(bad), 3)).all()
    assert torch.equal(Fp8Codec().decode(Fp8Codec().encode(torch.zeros(4)), 4), torch.zeros(4))


def test_codec_refuses_bad_settings() -> None:
    """Catches silently accepted unknown formats or block sizes."""
    with pytest.raises(ValueError, match="e4m3"):
        Fp8Codec("e3m4")
    with pytest.raises(ValueError, match="block_size=0"):
        Fp8Codec(block_size=0)
    with pytest.raises(ValueError, match="cannot hold"):
        Fp8Codec().decode(torch.zeros(5, dtype=torch.uint8), 4)


def _sum_bound(codec: Fp8Codec, parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([codec.error_bound(p) for p in parts]).sum(0)


def _resum_bound(codec: Fp8Codec, total: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Bound of re-encoding a sum known within ``first``: the bound at ``|total| + first``."""
    worst = total.abs() + first
    info = torch.finfo(codec.dtype)
    scale = worst.max() / codec.fp8_max
    return first + info.eps / 2 * worst + info.tiny * info.eps / 2 * scale


@distributed_test(2, 4)
def test_fp8_collectives_error_bound_and_bytes(rank: int, world_size: int) -> None:
    """Catches a reduction done in float8 or missing a rank, pieces sent to the wrong rank,
    a lost or misplaced scale (errors above the bound), and bytes that are not the float8
    payload plus 4 per scale (a quarter of float32's, which the fp32 runs record)."""
    torch.set_num_threads(1)
    w, n = world_size, 64
    inputs = [_data(r, n * w) for r in range(w)]
    mine = inputs[rank]
    for codec in CODECS:
        s = codec.num_scales(n)  # scales per piece of n
        with CommTracker() as t8:
            out = torch.empty(n)
            fp8_reduce_scatter(out, mine, codec=codec)
            gathered = torch.empty(n * w * w)
            fp8_all_gather(gathered, mine, codec=codec)
            reduced = mine.clone()
            fp8_all_reduce(reduced, codec=codec)
            exchanged = torch.empty(n * w)
            fp8_all_to_all(exchanged, mine, codec=codec)
        pieces = [x[rank * n : (rank + 1) * n] for x in inputs]
        ref = torch.stack(pieces).sum(0)
        assert ((out - ref).abs() <= _sum_bound(codec, pieces)).all()
        assert ((gathered - torch.cat(inputs)).abs() <= codec.error_bound(torch.cat(inputs))).all()
        total = torch.stack(inputs).sum(0)
        first = torch.cat(
            [_sum_bound(codec, [x[i * n : (i + 1) * n] for x in inputs]) for i in range(w)]
        )
        assert ((reduced - total).abs() <= _resum_bound(codec, total, first)).all()
        assert (reduced - total).abs().max() > 0  # it did go through float8
        assert ((exchanged - torch.cat(pieces)).abs() <= codec.error_bound(torch.cat(pieces))).all()
        name = str(codec.dtype).removeprefix("torch.")
        assert {r.dtype for r in t8.records} == {name}
        assert t8.calls() == 4
        assert t8.bytes("reduce_scatter") == w * (n + 4 * s)
        assert t8.bytes("all_gather") == w * (n * w + 4 * codec.num_scales(n * w))
        assert t8.bytes("all_reduce") == w * (n + 4 * s)
        assert t8.bytes("all_to_all") == w * (n + 4 * s)
    with CommTracker() as t32:
        reduce_scatter(torch.empty(n), mine.clone())
        all_gather(torch.empty(n * w * w), mine)
        all_reduce(mine.clone())
        all_to_all(torch.empty(n * w), mine)
    for kind in ("reduce_scatter", "all_reduce", "all_to_all"):
        assert t32.bytes(kind) == 4 * w * n  # the fp8 records: a quarter + 4 w bytes of scales
    assert t32.bytes("all_gather") == 4 * w * w * n


@distributed_test(2)
def test_fp8_send_recv_and_refusals(rank: int, world_size: int) -> None:
    """Catches a p2p payload decoded with the wrong scale or size, bytes other than n + 4,
    and non-sum reductions or integer tensors accepted silently."""
    torch.set_num_threads(1)
    x = _data(0, 100) * 50
    with CommTracker() as tracker:
        if rank == 0:
            fp8_send(x, 1)
            send(x, 1)
        else:
            got = torch.empty(100)
            fp8_recv(got, 0)
            assert ((got - x).abs() <= Fp8Codec().error_bound(x)).all()
            assert not torch.equal(got, x)
            recv(got, 0)
    kind = "send" if rank == 0 else "recv"
    assert [r.nbytes for r in tracker.records if r.kind == kind] == [104, 400]
    with pytest.raises(ValueError, match="sums or averages"):
        fp8_all_reduce(x, op=torch.distributed.ReduceOp.MAX)
    with pytest.raises(TypeError, match="int64"):
        fp8_all_reduce(torch.arange(4))
    averaged = torch.full((6,), float(rank + 1))
    fp8_all_reduce(averaged, op=torch.distributed.ReduceOp.AVG)
    assert torch.allclose(averaged, torch.full((6,), 1.5), rtol=2**-4)
