"""Ring attention (``ring_attn``): key/value blocks travel around the sequence-parallel group.

Every rank keeps the queries of its own tokens; the key/value block of each rank reaches every
other rank. By default (``_ROTATE = "allgather"``, PyTorch context parallelism's choice) one
asynchronous all-gather fetches all blocks while the rank computes on its own block; with
``"ring"`` the blocks travel ``P - 1`` neighbour hops, the exchange of the next block
overlapping the attention over the current one (asynchronous send/receive through
:mod:`colossal.core.comm`). Fully visible block pairs are merged into one kernel call. Blocks
are merged with the online softmax: each block's unnormalized output and sum of
exponentials are rescaled to the running maximum score and added (kept apart rather than as
one log-sum-exp, which loses the block sizes next to a large additive mask value), so the
result is exact attention over the whole sequence.

Layout: any assignment of tokens to ranks (``positions[r]``, the global positions rank ``r``
holds, in its local order). With the zigzag layout (rank ``r`` holds chunks ``r`` and
``2P-1-r`` of ``2P``) every rank does the same causal work. A rank's tokens are taken as runs
of consecutive positions (two per rank in zigzag); for each (query run, key run) pair a causal
mask either hides it entirely (skipped: no compute), shows it entirely (no mask built) or cuts
it on the diagonal. On CPU blocks run on PyTorch's flash-attention kernel (forward and
backward, grouped-query attention native; unmasked blocks with its own causal flag, causal
diagonals of 256+ tokens tiled by colossal-kernels' ``causal_flash_forward``, masked ones
with the block's additive mask); elsewhere on an exact matmul path.

Masks: None (causal when the module is causal, else none), a ``[B, S]`` padding mask (plus
causal when the module is causal) or a 4-D ``[B, 1 or H, S, S]`` bool / additive float mask
(used as it is, like SDPA), each cut to the block of positions at hand. A query that may see
no key gets a zero output and zero gradients, as SDPA gives.

Backward fetches the key/value blocks again the same way. All-gather: every rank computes its
share of every block's gradient and one all-to-all returns the shares to the owners, who sum
them. Ring: behind the blocks travel the gradients of those blocks, which every rank adds its
share to (the gradient so far arrives while the rank computes its share); after ``P`` hops
each block's gradient is back on its owner. Attention dropout is not supported.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.kernels.attention import causal_flash_backward as _tiled_bwd
from colossal.kernels.attention import causal_flash_forward as _tiled_fwd
from colossal.kernels.attention import tiled_causal_block

__all__ = ["ring_attention", "ring_attention_forward"]

logger = logging.getLogger(__name__)

_Run = tuple[int, int, int]  # (local start, local end, global position of the start)


def _runs(positions: torch.Tensor, chunks: int) -> list[_Run]:
    """A rank's tokens as runs of consecutive global positions, in its local order.

    The tokens are first cut in ``chunks`` equal pieces (the layout's chunks: zigzag's two
    stay two blocks even where they meet, so causal skipping works per chunk), then at every
    break in the positions.
    """
    pos = positions.tolist()
    n = len(pos)
    cuts = {n * i // chunks for i in range(chunks + 1)}
    cuts.update(i for i in range(1, n) if pos[i] != pos[i - 1] + 1)
    bounds = sorted(cuts)
    return [(a, b, pos[a]) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


_FULL = 1 << 62
"""A merged block's query start: after every key, so the causal test finds it fully visible."""


def _blocks(spec: _Mask, q_runs: list[_Run], k_runs: list[_Run]) -> list[tuple[_Run, _Run]]:
    """The (query run, key run) blocks of one step, fully visible ones merged into rectangles.

    Without a mask tensor, every key run a query run sees entirely needs no mask, so
    locally adjacent such key runs become one block, and locally adjacent query runs with the
    same fully visible key ranges share it (zigzag: ``P + 2`` kernel calls per rank and
    direction instead of ``2P + 1``). A merged block's runs carry the global starts
    ``(_FULL, 0)``, which every mask test reads as fully visible. Blocks the causal mask hides
    are left out; partly visible ones stay per run pair.
    """
    out: list[tuple[_Run, _Run]] = []
    groups: list[tuple[int, int, list[tuple[int, int]]]] = []  # (q start, q end, key ranges)
    for qr in q_runs:
        ranges: list[tuple[int, int]] = []
        for kr in k_runs:
            if spec.skipped(qr, kr):
                continue
            full = spec.mask is None and (not spec.causal or kr[2] + kr[1] - kr[0] - 1 <= qr[2])
            if not full:
                out.append((qr, kr))
            elif ranges and ranges[-1][1] == kr[0]:
                ranges[-1] = (ranges[-1][0], kr[1])
            else:
                ranges.append((kr[0], kr[1]))
        if groups and groups[-1][1] == qr[0] and groups[-1][2] == ranges:
            groups[-1] = (groups[-1][0], qr[1], ranges)
        elif ranges:
            groups.append((qr[0], qr[1], ranges))
    for qa, qb, ranges in groups:
        out.extend(((qa, qb, _FULL), (ka, kb, 0)) for ka, kb in ranges)
    return out


class _Mask:
    """The attention mask and the causal flag, cut to (query run, key run) blocks."""

    def __init__(self, mask: torch.Tensor | None, causal: bool, heads: tuple[int, int]) -> None:
        self.mask = mask
        self.causal = causal and (mask is None or mask.dim() == 2)
        self.heads = heads  # (Hk, R)
        if mask is not None and mask.dim() not in (2, 4):
            raise ValueError(
                f"ring attention takes a [B, S] or 4-D attention mask, got shape "
                f"{tuple(mask.shape)}"
            )

    def skipped(self, q: _Run, k: _Run) -> bool:
        """Whether the causal mask hides the whole block."""
        return self.causal and k[2] > q[2] + (q[1] - q[0]) - 1

    def block(self, q: _Run, k: _Run) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keep, bias)`` broadcastable to ``[B, Hk, R, nq, nk]`` (None: nothing to apply)."""
        nq, nk = q[1] - q[0], k[1] - k[0]
        keep: torch.Tensor | None = None
        bias: torch.Tensor | None = None
        m = self.mask
        if m is not None and m.dim() == 2:
            keep = m[:, k[2] : k[2] + nk].bool()[:, None, None, None, :]
        elif m is not None:
            rows = slice(q[2], q[2] + nq) if m.shape[2] > 1 else slice(None)
            cols = slice(k[2], k[2] + nk) if m.shape[3] > 1 else slice(None)
            blk = m[:, :, rows, cols]
            hk, r = self.heads
            blk = blk[:, :, None] if blk.shape[1] == 1 else blk.reshape(-1, hk, r, nq, nk)
            if blk.dtype == torch.bool:
                keep = blk
            else:
                bias = blk.float()
        if self.causal and k[2] + nk - 1 > q[2]:  # the block crosses the diagonal
            qp = torch.arange(q[2], q[2] + nq, device=m.device if m is not None else None)
            kp = torch.arange(k[2], k[2] + nk, device=qp.device)
            tri = kp[None, :] <= qp[:, None]
            keep = tri if keep is None else keep & tri
        return keep, bias


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: _Mask, qr: _Run, kr: _Run
) -> torch.Tensor:
    """Masked scores ``[B, Hk, R, nq, nk]`` of a query run against a key run (fp32)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    keep, bias = mask.block(qr, kr)
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _finite(x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isneginf(x), torch.full_like(x, fill), x)


_ROTATE = "allgather"
"""How key/value blocks reach every rank: ``"allgather"`` (one all-gather forward and
backward, one all-to-all of the key/value gradients; like PyTorch's context parallelism) or
``"ring"`` (``P - 1`` neighbour hops, the gradients travelling behind the blocks)."""

_FUSED = True
"""Use PyTorch's CPU flash-attention kernel for blocks on CPU (False: the matmul path)."""

_Plan = tuple[bool, "torch.Tensor | None", "torch.Tensor | None"]


def _fused_plan(spec: _Mask, qr: _Run, kr: _Run, q: torch.Tensor) -> _Plan | None:
    """How the fused kernel takes a block: ``(is_causal, additive mask, seen)``; None: matmul.

    No mask: fully visible, or causal on an aligned diagonal (zigzag's own chunks) with the
    kernel's ``is_causal``. Otherwise the block's mask becomes an additive ``[B, 1|H, nq|1,
    nk]`` float mask, and ``seen`` (``[B, Hk, R, nq]``-broadcastable bool) marks the queries
    that see a key of the block: the kernel gives the others a log-sum-exp of 0, not -inf.
    """
    if not _FUSED or q.device.type != "cpu":
        return None
    nq, nk = qr[1] - qr[0], kr[1] - kr[0]
    if spec.mask is None:
        if not spec.causal or kr[2] + nk - 1 <= qr[2]:
            return False, None, None
        if kr[2] == qr[2] and nk == nq:
            return True, None, None
    keep, bias = spec.block(qr, kr)  # 5-D [B|1, Hk|1, R|1, nq|1, nk] (or 2-D causal)
    add = torch.zeros((), dtype=q.dtype) if bias is None else bias.to(q.dtype)
    seen = None
    if keep is not None:
        add = add.masked_fill(~keep, float("-inf"))
        seen = keep.any(-1)
    while add.dim() < 5:
        add = add.unsqueeze(0)
    b, hk, r = add.shape[:3]
    add = add.reshape(b, hk * r, *add.shape[3:]) if hk * r > 1 else add.squeeze(2)
    return False, add, seen


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, spec: _Mask,
    qr: _Run, kr: _Run,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block: ``(o, m, l)`` with ``o = sum_j exp(s_j - m) v_j``, ``l = sum_j exp(s_j - m)``.

    ``q``: ``[B, Hk, R, nq, D]`` (fp32); ``k``, ``v``: ``[B, Hk, nk, D]``. ``m`` is the row
    maximum (or the fused kernel's log-sum-exp, with ``l = 1``); ``-inf`` where a query
    sees no key of the block (then ``o = l = 0``).
    """
    b, hk, r, nq, d = q.shape
    plan = _fused_plan(spec, qr, kr, q)
    if plan is not None:
        causal, add, seen = plan
        qf = q.reshape(b, hk * r, nq, d)
        if causal and (blk := tiled_causal_block(qf, k, v, min_len=256, max_block=64)):
            o, lse = _tiled_fwd(qf, k, v, scale, blk)
        else:
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qf, k, v, 0.0, causal, attn_mask=add, scale=scale
            )
        m = lse.view(b, hk, r, nq)
        if seen is not None:
            m = m.masked_fill(~seen.expand_as(m), float("-inf"))
        return o.view(b, hk, r, nq, -1), m, torch.ones_like(m)
    sc = _scores(q, k, scale, spec, qr, kr)
    m = sc.amax(-1)
    p = torch.exp(sc - _finite(m, 0.0).unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), m, p.sum(-1)


def _block_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], delta: torch.Tensor, scale: float,
    spec: _Mask, qr: _Run, kr: _Run,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One block's share of ``(dq [B,Hk,R,nq,D], dk [B,Hk,nk,D], dv [B,Hk,nk,Dv])``.

    ``out``, ``delta = rowsum(dout * out)`` and ``stats = (lse, peak, inv)`` are the final
    (whole-sequence) ones: a score's probability is ``exp(s - lse)`` (the fused kernel) or
    ``exp(s - peak) * inv`` (exact next to a huge additive mask value, where ``lse`` rounds
    to the peak); ``inv = 1 / sum`` is 0 for a query that sees nothing.
    """
    b, hk, r, nq, d = q.shape
    lse, peak, inv = stats
    plan = _fused_plan(spec, qr, kr, q)
    if plan is not None:
        causal, add, _ = plan
        flat = (b, hk * r, nq)
        args = (dout.reshape(*flat, -1), q.reshape(*flat, d), k, v, out.reshape(*flat, -1),
                lse.reshape(flat))  # fmt: skip
        if causal and (blk := tiled_causal_block(args[1], k, v, min_len=256, max_block=64)):
            dq, dk, dv = _tiled_bwd(*args, scale, blk)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *args, 0.0, causal, attn_mask=add, scale=scale
            )
        return dq.view(q.shape), dk, dv
    p = torch.exp(_scores(q, k, scale, spec, qr, kr) - peak.unsqueeze(-1)) * inv.unsqueeze(-1)
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(2)
    dp = torch.matmul(dout, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(ds, k.unsqueeze(2))
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2)
    return dq, dk, dv


def _merge(
    acc: torch.Tensor, total: torch.Tensor, peak: torch.Tensor,
    o: torch.Tensor, m: torch.Tensor, l_: torch.Tensor,
) -> None:  # fmt: skip
    """Fold one block's ``(o, m, l)`` into the running ``(acc, total, peak)`` views, in place."""
    new = torch.maximum(peak, m)
    safe = torch.nan_to_num(new, neginf=0.0)  # a query that has seen no key yet
    keep = torch.sub(peak, safe).exp_()
    add = m.sub(safe).exp_()
    acc.mul_(keep.unsqueeze(-1)).addcmul_(o, add.unsqueeze(-1))
    total.mul_(keep).addcmul_(l_, add)
    peak.copy_(new)


class _Ring:
    """The ring over a process group: this rank, its neighbours and the block exchange."""

    def __init__(self, group: Any) -> None:
        from colossal.core.comm import group_ranks

        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranks = group_ranks(group)
        self.next = ranks[(self.rank + 1) % self.size]
        self.prev = ranks[(self.rank - 1) % self.size]

    def start(self, send: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Send ``send`` to the next rank and receive the previous rank's into a new buffer."""
        from colossal.core.comm import P2POp, batch_isend_irecv

        recv = torch.empty_like(send)
        works = batch_isend_irecv(
            [
                P2POp("send", send, self.next, self.group),
                P2POp("recv", recv, self.prev, self.group),
            ]
        )
        return recv, works

    def gather(self, send: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Start gathering every rank's ``send`` into a new ``[P, numel]`` buffer (rank order)."""
        from colossal.core.comm import all_gather

        buf = send.new_empty(self.size, send.numel())
        work = all_gather(buf.view(-1), send, self.group, async_op=True, algorithm="native")
        return buf, [work]


def _kv_blocks(ring: _Ring, cur: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """Every rank's packed key/value block, this rank's first: ``(source rank, block)``.

    ``_ROTATE == "allgather"``: one all-gather, started before this rank's own block is
    yielded (computed on) and waited for after it. ``"ring"``: ``P - 1`` hops, the next one
    in flight while the current block is computed on.
    """
    if _ROTATE == "allgather" and ring.size > 1:
        buf, works = ring.gather(cur)
        yield ring.rank, cur
        _wait(works)
        for step in range(1, ring.size):
            src = (ring.rank - step) % ring.size
            yield src, buf[src]
        return
    for step in range(ring.size):
        works = []
        if step < ring.size - 1:
            nxt, works = ring.start(cur)  # the next block travels while this one computes
        yield (ring.rank - step) % ring.size, cur
        if works:
            _wait(works)
            cur = nxt


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(buf[at : at + t.numel()].view(t.shape))
        at += t.numel()
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float,
        group: Any,
        positions: list[torch.Tensor],
        chunks: int,
    ) -> torch.Tensor:
        ring = _Ring(group)
        b, hq, sq, _ = q.shape
        hk = k.shape[1]
        r = hq // hk
        spec = _Mask(mask, causal, (hk, r))
        q_runs = _runs(positions[ring.rank], chunks)
        kv_runs = [_runs(p, chunks) for p in positions]
        qg = q.float().reshape(b, hk, r, sq, q.shape[-1])
        acc = qg.new_zeros(b, hk, r, sq, v.shape[-1])  # unnormalized output
        peak = qg.new_full((b, hk, r, sq), float("-inf"))  # running max score
        total = qg.new_zeros(b, hk, r, sq)  # running sum of exp(score - peak)
        for src, cur in _kv_blocks(ring, _pack(k, v)):
            kb, vb = (t.float() for t in _unpack(cur, (k, v)))
            for qr, kr in _blocks(spec, q_runs, kv_runs[src]):
                qs, ks = slice(qr[0], qr[1]), slice(kr[0], kr[1])
                o, m, l_ = _block_forward(
                    qg[..., qs, :], kb[..., ks, :], vb[..., ks, :], scale, spec, qr, kr
                )
                _merge(acc[..., qs, :], total[..., qs], peak[..., qs], o, m, l_)
        seen = total > 0
        out = acc / torch.where(seen, total, torch.ones_like(total)).unsqueeze(-1)
        peak = _finite(peak, 0.0)
        inv = torch.where(seen, 1.0 / total, torch.zeros_like(total))
        # The whole row's log-sum-exp; +inf for a query that sees nothing (probabilities 0).
        lse = torch.where(seen, peak + torch.log(total), float("inf"))
        ctx.save_for_backward(q, k, v, out, lse, peak, inv, *(() if mask is None else (mask,)))
        ctx.spec, ctx.scale, ctx.group = spec, scale, group
        ctx.q_runs, ctx.kv_runs = q_runs, kv_runs
        return out.reshape(b, hq, sq, v.shape[-1]).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        q, k, v, out = ctx.saved_tensors[:4]
        ring = _Ring(ctx.group)
        b, hk, r, sq, dv = out.shape
        qg = q.float().reshape(b, hk, r, sq, q.shape[-1])
        dout = grad.float().reshape(out.shape)
        delta = (dout * out).sum(-1)  # [B, Hk, R, sq]
        dq = torch.zeros_like(qg)
        numel = k.numel() + v.numel()
        gather = _ROTATE == "allgather" and ring.size > 1
        shares = torch.zeros(ring.size if gather else 0, numel, device=q.device)
        # Ring: dkv is the gradient so far of the block this step works on, received from the
        # previous rank while this rank computed its own share (zero for its own block).
        dkv = torch.zeros(numel, dtype=torch.float32, device=q.device)
        pending: list[Any] = []
        for src, cur in _kv_blocks(ring, _pack(k, v)):
            share = shares[src] if gather else torch.zeros_like(dkv)
            _block_shares(ctx, src, cur, (qg, dq, dout, delta), share)
            if gather:
                continue
            _wait(pending)  # the block's gradient from the ranks before (overlapped above)
            share += dkv
            if ring.size > 1:  # it follows the block to the next rank; the next one arrives
                dkv, pending = ring.start(share)
            else:
                dkv = share
        if gather:  # every rank's share of this rank's block, in one all-to-all
            from colossal.core.comm import all_to_all

            got = torch.empty_like(shares)
            all_to_all(got, shares, group=ring.group)
            dkv = got.sum(0)
        _wait(pending)  # ring: after P hops, this rank's own block, every share summed
        dk, dvv = _unpack(dkv, (k, v))
        return (
            dq.reshape(q.shape).to(q.dtype),
            dk.to(k.dtype),
            dvv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _block_shares(
    ctx: Any, src: int, cur: torch.Tensor, grads: tuple[torch.Tensor, ...], share: torch.Tensor
) -> None:
    """Add this rank's queries' share of rank ``src``'s key/value block gradient to ``share``.

    ``cur``: that packed block; ``grads``: ``(qg, dq, dout, delta)``, ``dq`` accumulated into.
    """
    q, k, v, out, lse, peak, inv = ctx.saved_tensors[:7]
    qg, dq, dout, delta = grads
    kb, vb = (t.float() for t in _unpack(cur, (k, v)))
    dkb, dvb = _unpack(share, (k, v))
    for qr, kr in _blocks(ctx.spec, ctx.q_runs, ctx.kv_runs[src]):
        qs, ks = slice(qr[0], qr[1]), slice(kr[0], kr[1])
        g_q, g_k, g_v = _block_backward(
            qg[..., qs, :], kb[..., ks, :], vb[..., ks, :], out[..., qs, :],
            dout[..., qs, :], (lse[..., qs], peak[..., qs], inv[..., qs]),
            delta[..., qs], ctx.scale, ctx.spec, qr, kr,
        )  # fmt: skip
        dq[..., qs, :] += g_q
        dkb[..., ks, :] += g_k
        dvb[..., ks, :] += g_v


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: Sequence[torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    group: Any = None,
    chunks: int = 2,
) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence, by ring exchange.

    Args:
        query: ``[B, Hq, sq, D]``, this rank's tokens.
        key: ``[B, Hk, sq, D]`` (``Hq`` a multiple of ``Hk``; exchanged unrepeated).
        value: ``[B, Hk, sq, Dv]``.
        positions: ``positions[r]``: the global positions rank ``r`` of ``group`` holds, in
            its local order (every rank holds ``sq`` tokens).
        attention_mask: None, a ``[B, S]`` padding mask, or a 4-D ``[B, 1 or Hq, S, S]`` bool
            (True: attend) or additive float mask over global positions.
        causal: Apply a causal mask (with None or a ``[B, S]`` mask; a 4-D mask is complete).
        scale: Score scale (default ``1/sqrt(D)``).
        group: The sequence-parallel group (None: the whole job).
        chunks: Equal chunks each rank's tokens are cut in before pairing blocks (the
            layout's: 2 for zigzag, 1 for contiguous); finer chunks skip more masked work.

    Returns:
        ``[B, Hq, sq, Dv]`` in ``query``'s dtype (computed in fp32).

    Raises:
        ValueError: Inconsistent positions, head counts or mask.
    """
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    if len(positions) != size or any(len(p) != query.shape[2] for p in positions):
        raise ValueError(
            f"ring attention needs {size} position lists of {query.shape[2]} tokens each (one "
            f"per sequence-parallel rank), got lengths {[len(p) for p in positions]}"
        )
    if chunks < 1 or query.shape[2] % chunks:
        raise ValueError(
            f"ring attention cannot cut {query.shape[2]} local tokens in {chunks} equal chunks"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"ring attention needs query heads ({query.shape[1]}) to be a multiple of key/value "
            f"heads ({key.shape[1]})"
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    pos = [p.to("cpu", torch.long) for p in positions]
    return _RingAttention.apply(
        query,
        key.contiguous(),
        value.contiguous(),
        attention_mask,
        causal,
        scale,
        group,
        pos,
        chunks,
    )


def ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    group: Any = None,
    layout: str = "zigzag",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature, over ring attention.

    The global positions of every rank's tokens come from
    :func:`colossal.shardformer.sequence.layout.token_indices` for ``layout``.

    Args:
        module: The calling attention module (its ``is_causal`` is read).
        query: ``[B, Hq, s/P, D]``, this rank's tokens (after rotary).
        key: ``[B, Hk, s/P, D]``.
        value: ``[B, Hk, s/P, Dv]``.
        attention_mask: The full-length mask the model built (see :func:`ring_attention`).
        dropout: Attention dropout probability (must be 0).
        scaling: Score scale (default ``1/sqrt(D)``).
        is_causal: Overrides ``module.is_causal`` when given.
        group: The sequence-parallel process group (None: the whole job).
        layout: The token layout the sequence was split with.
        **kwargs: Other model arguments; soft-capping and attention sinks are refused.

    Returns:
        ``(output [B, s/P, Hq, Dv], None)``.

    Raises:
        NotImplementedError: Attention dropout, soft-capping or attention sinks.
    """
    from colossal.shardformer.sequence.layout import token_indices

    if dropout:
        raise NotImplementedError(
            f"{type(module).__name__} asks for attention dropout {dropout}, which ring attention "
            "does not implement; set the model's attention dropout to 0 or use 'all_to_all'"
        )
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name!r}, which ring attention does not "
                "implement; use another sequence_parallelism_mode for this model"
            )
    group = dist.group.WORLD if group is None else group
    size = dist.get_world_size(group)
    seq_len = query.shape[2] * size
    positions = [torch.as_tensor(token_indices(seq_len, r, size, layout)) for r in range(size)]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = ring_attention(
        query,
        key,
        value,
        positions,
        attention_mask,
        bool(causal),
        scaling,
        group,
        chunks=2 if layout == "zigzag" else 1,
    )
    return out.transpose(1, 2).contiguous(), None
