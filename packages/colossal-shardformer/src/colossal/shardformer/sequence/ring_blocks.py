"""Ring attention's blocks: which (query run, key run) pairs to compute, and how.

A rank's tokens are runs of consecutive global positions (:func:`_runs`); :func:`_blocks`
pairs query runs with a key block's runs, skipping pairs the causal mask hides and merging
fully visible ones into rectangles; :class:`_Mask` cuts the attention mask to a pair.
:func:`_block_forward` / :func:`_block_backward` compute one pair on PyTorch's CPU flash
kernel (causal diagonals of 256+ tokens tiled by colossal-kernels) or on the exact matmul
path, and :func:`_merge` folds a block into the running online softmax.
"""

from __future__ import annotations

import torch

from colossal.kernels.attention import causal_flash_backward as _tiled_bwd
from colossal.kernels.attention import causal_flash_forward as _tiled_fwd
from colossal.kernels.attention import tiled_causal_block

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
