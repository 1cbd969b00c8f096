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

All-gather: the forward keeps the gathered blocks for the backward (``_KEEP_GATHERED``; one
all-gather per layer instead of two, for the whole sequence's keys and values held per
layer until its backward; the step time this saves, and the longest sequence that still fits
against PyTorch's context parallelism, which gathers again, are in colossal-shardformer's
CHANGELOG);
every rank computes its share of every block's gradient and one all-to-all returns the
shares to the owners, who sum them. Ring: backward fetches the blocks again the same way,
and behind the blocks travel the gradients of those blocks, which every rank adds its share
to (the gradient so far arrives while the rank computes its share); after ``P`` hops each
block's gradient is back on its owner. Attention dropout is not supported.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from colossal.shardformer.sequence.ring_blocks import (
    _block_backward,
    _block_forward,
    _blocks,
    _finite,
    _Mask,
    _merge,
    _runs,
)

__all__ = ["ring_attention", "ring_attention_forward"]

logger = logging.getLogger(__name__)

_ROTATE = "allgather"
"""How key/value blocks reach every rank: ``"allgather"`` (one all-gather forward, again in
backward unless ``_KEEP_GATHERED``, one all-to-all of the key/value gradients; like PyTorch's
context parallelism) or
``"ring"`` (``P - 1`` neighbour hops, the gradients travelling behind the blocks)."""

_KEEP_GATHERED = True
"""All-gather rotation: keep the forward's gathered key/value blocks for the backward (False:
gather them again, holding only this rank's block between forward and backward)."""


class _Ring:
    """The ring over a process group: this rank, its neighbours and the block exchange."""

    def __init__(self, group: ProcessGroup | None) -> None:
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


def _kv_blocks(
    ring: _Ring, cur: torch.Tensor, kept: list[torch.Tensor] | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Every rank's packed key/value block, this rank's first: ``(source rank, block)``.

    ``_ROTATE == "allgather"``: one all-gather, started before this rank's own block is
    yielded (computed on) and waited for after it. ``"ring"``: ``P - 1`` hops, the next one
    in flight while the current block is computed on.
    """
    if kept:  # the blocks the forward gathered: no exchange
        yield ring.rank, cur
        for step in range(1, ring.size):
            src = (ring.rank - step) % ring.size
            yield src, kept[0][src]
        return
    if _ROTATE == "allgather" and ring.size > 1:
        buf, works = ring.gather(cur)
        yield ring.rank, cur
        _wait(works)
        if kept is not None:
            kept.append(buf)
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
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float,
        group: ProcessGroup | None,
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
        kept: list[torch.Tensor] | None = [] if _KEEP_GATHERED else None
        for src, cur in _kv_blocks(ring, _pack(k, v), kept):
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
        ctx.kept = kept
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
        for src, cur in _kv_blocks(ring, _pack(k, v), ctx.kept):
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

            # the forward's gathered blocks (and views of them) are done with: free them first
            ctx.kept = cur = share = None  # type: ignore[assignment]  # freed early
            got = torch.empty_like(shares)
            all_to_all(got, shares, group=ring.group)
            del shares
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
    group: ProcessGroup | None = None,
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
    group: ProcessGroup | None = None,
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
