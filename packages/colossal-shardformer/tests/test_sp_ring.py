"""Ring attention (``ring_attn``): each rank's slice against full single-process attention.

The direct case gives every rank its layout's slice of one q/k/v (zigzag unless noted) and
compares the ring's output and the q/k/v gradients with SDPA over the whole sequence, for:
causal; causal with a left-padded batch (queries that see nothing); non-causal (BERT/ViT)
with padding; 4-D bool and additive float masks; grouped-query attention (key/value heads
exchanged unrepeated); the contiguous layout. World 2 and world 4 (4: a block's gradient
passes through ranks that are neither its owner nor the first to touch it).

What each check catches: a block merged with the wrong log-sum-exp (wrong outputs); a key
block paired with the wrong positions (wrong causal/padding cut: wrong outputs); a block
skipped that is not fully masked, or a fully masked one computed (the per-rank block count,
which is also the zigzag's load balance); dK/dV not carried back to the block's owner, or
carried one hop short (wrong k/v gradients, world 4 especially); NaN from fully masked rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colossal.core.testing import distributed_test


def _case(
    rank: int, size: int, name: str, mask: Any, causal: bool, hk: int = 4,
    layout: str = "zigzag", fused: bool = True,
) -> tuple[int, int]:  # fmt: skip
    """One comparison; returns how many blocks this rank computed, and how many by matmul."""
    from _sp_attention_cases import check_slice, reference_case

    from colossal.shardformer.sequence import ring, ring_blocks
    from colossal.shardformer.sequence.layout import token_indices

    full, w, ref = reference_case(7, mask, causal, hk)
    s = w.shape[2]
    positions = [token_indices(s, r, size, layout) for r in range(size)]
    mine = positions[rank]
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    calls: list[str] = []
    original, scores = ring._block_forward, ring_blocks._scores

    def counting(*args: Any) -> Any:
        calls.append("block")
        return original(*args)

    def counting_scores(*args: Any) -> torch.Tensor:
        calls.append("matmul")
        return scores(*args)

    ring._block_forward, ring_blocks._scores = counting, counting_scores
    ring_blocks._FUSED = fused
    try:
        chunks = 2 if layout == "zigzag" else 1
        out = ring.ring_attention(*local, positions, mask, causal, chunks=chunks)
        counts = calls.count("block"), calls.count("matmul")
        (out * w[:, :, mine]).sum().backward()
    finally:
        ring._block_forward, ring_blocks._scores = original, scores
        ring_blocks._FUSED = True
    assert torch.isfinite(out).all(), name
    check_slice(out, local, full, ref, mine, f"{name} (rank {rank}/{size})")
    return counts


def _masks(s: int = 16) -> dict[str, Any]:
    pad = torch.ones(2, s, dtype=torch.long)
    pad[1, :5] = 0  # left padding: queries 0..4 of row 1 see no key under the causal mask
    custom = torch.ones(s, s, dtype=torch.bool).tril()
    custom[:, 3] = False
    custom[3, 3] = True
    float4 = torch.zeros(2, 1, s, s).masked_fill(~custom, -1e9)
    custom[6, :] = False  # a row that sees nothing at all (bool only: in fp32 a row of
    # -1e9 + score is uniform, and its gradient is lost to rounding in any implementation)
    bool4 = custom.expand(2, 1, s, s).clone()
    return {"pad": pad, "bool4": bool4, "float4": float4}


def _direct(rank: int, world_size: int) -> None:
    """Outputs and q/k/v gradients equal SDPA over the whole sequence; causal blocks skipped."""
    m = _masks()
    blocks = _case(rank, world_size, "causal", None, True)
    # Zigzag: 2 query runs x 2 key runs x P blocks, of which every rank skips the same number
    # (its chunks r and 2P-1-r see 2P+1 of the 4P chunk pairs): balanced, no masked work.
    # The fully visible pairs of another rank's block form one rectangle (adjacent query or
    # key runs merged): 3 calls for the own block + 1 per other block = P + 2 (a merge that
    # is lost shows up as more calls). On CPU every block goes to the flash kernel.
    assert blocks == (world_size + 2, 0), blocks
    matmul = _case(rank, world_size, "causal (matmul path)", None, True, fused=False)
    assert matmul == (world_size + 2, world_size + 2), matmul
    _case(rank, world_size, "causal+padding", m["pad"], True)
    _case(rank, world_size, "padding, not causal", m["pad"], False)
    _case(rank, world_size, "not causal", None, False)
    _case(rank, world_size, "4-D bool", m["bool4"], True)
    _case(rank, world_size, "4-D float", m["float4"], True)
    _case(rank, world_size, "GQA causal+padding", m["pad"], True, hk=2)
    _case(rank, world_size, "GQA MQA", None, True, hk=1)
    contiguous = _case(rank, world_size, "contiguous", m["pad"], True, layout="contiguous")
    assert contiguous == (rank + 1, 0)  # only earlier blocks are computed
    # The exact matmul path (other devices) on the masked cases too.
    for name, mask in (("causal+padding", m["pad"]), ("4-D bool", m["bool4"])):
        _case(rank, world_size, f"{name} (matmul path)", mask, True, hk=2, fused=False)


def _rotation(name: str) -> Any:
    """Run the ring attention with key/value rotation ``name`` inside the ``with`` block."""
    import contextlib

    from colossal.shardformer.sequence import ring

    @contextlib.contextmanager
    def use() -> Any:
        old, ring._ROTATE = ring._ROTATE, name
        try:
            yield
        finally:
            ring._ROTATE = old

    return use()


def _comm_allgather(rank: int, world_size: int) -> None:
    """All-gather rotation: one all-gather of the key/value blocks forward; backward reuses
    them (or, with ``_KEEP_GATHERED`` off, gathers them again) and returns the gradients in
    one all-to-all; no point-to-point traffic.

    Catches an extra or missing collective (e.g. a per-block exchange left over, or the
    backward gathering again although the forward kept the blocks), the gradients reduced
    with more traffic than one all-to-all, and the own block's compute not overlapping the
    gather (the gather waited for before computing).
    """
    import colossal.core.comm as comm
    from colossal.core import CommTracker
    from colossal.shardformer.sequence import ring
    from colossal.shardformer.sequence.layout import token_indices

    b, h, s, d = 1, 2, 8, 4
    q, k, v = (torch.randn(b, h, s // world_size, d, requires_grad=True) for _ in range(3))
    positions = [token_indices(s, r, world_size, "zigzag") for r in range(world_size)]
    kv_bytes = 2 * k.numel() * 4
    grads = {}
    for keep in (True, False):
        old, ring._KEEP_GATHERED = ring._KEEP_GATHERED, keep
        try:
            with CommTracker() as fwd:
                out = ring.ring_attention(q, k, v, positions)
            with CommTracker() as bwd:
                out.sum().backward()
        finally:
            ring._KEEP_GATHERED = old
        assert fwd.calls("send") == bwd.calls("send") == 0
        assert fwd.calls("all_gather") == 1
        assert bwd.calls("all_gather") == (0 if keep else 1), (keep, bwd.calls("all_gather"))
        assert fwd.calls("all_to_all") == 0 and bwd.calls("all_to_all") == 1
        assert bwd.bytes("all_to_all") == world_size * kv_bytes  # every rank's share, fp32
        grads[keep] = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    for kept, gathered in zip(grads[True], grads[False], strict=True):
        torch.testing.assert_close(kept, gathered, rtol=0, atol=0)  # the same blocks either way

    events: list[str] = []
    originals = (comm.all_gather, ring._block_forward, ring._wait)

    def start(*args: Any, **kwargs: Any) -> Any:
        events.append("start")
        return originals[0](*args, **kwargs)

    def compute(*args: Any) -> Any:
        events.append("compute")
        return originals[1](*args)

    def wait(works: Any) -> None:
        events.append("wait")
        originals[2](works)

    comm.all_gather, ring._block_forward, ring._wait = start, compute, wait
    try:
        ring.ring_attention(q, k, v, positions)
    finally:
        comm.all_gather, ring._block_forward, ring._wait = originals
    # The own block's calls (3 in zigzag) between the start and the wait, the others after.
    assert events[:4] == ["start", "compute", "compute", "compute"], events
    assert events[4] == "wait" and events.count("compute") == world_size + 2, events
    assert events.count("start") == events.count("wait") == 1, events


def _comm(rank: int, world_size: int) -> None:
    """The key/value block hops P-1 times forward; backward adds P hops of its gradient."""
    from colossal.core import CommTracker
    from colossal.shardformer.sequence.layout import token_indices
    from colossal.shardformer.sequence.ring import ring_attention

    b, h, s, d = 1, 2, 8, 4
    q, k, v = (torch.randn(b, h, s // world_size, d, requires_grad=True) for _ in range(3))
    positions = [token_indices(s, r, world_size, "zigzag") for r in range(world_size)]
    kv_bytes = 2 * k.numel() * 4
    with CommTracker() as fwd:
        out = ring_attention(q, k, v, positions)
    with CommTracker() as bwd:
        out.sum().backward()
    assert fwd.calls("send") == world_size - 1
    assert fwd.bytes("send") == (world_size - 1) * kv_bytes
    assert bwd.calls("send") == 2 * world_size - 1
    assert bwd.bytes("send") == (world_size - 1) * kv_bytes + world_size * kv_bytes

    # Overlap: the next block's send/receive is started before this block's attention and
    # waited for after it (an exchange finished before computing would serialize them).
    import colossal.core.comm as comm
    from colossal.shardformer.sequence import ring

    events: list[str] = []
    originals = (comm.batch_isend_irecv, ring._block_forward, ring._wait)

    def start(ops: Any) -> Any:
        events.append("start")
        return originals[0](ops)

    def scores(*args: Any) -> torch.Tensor:
        events.append("compute")
        return originals[1](*args)

    def wait(works: Any) -> None:
        events.append("wait")
        originals[2](works)

    comm.batch_isend_irecv, ring._block_forward, ring._wait = start, scores, wait
    try:
        ring_attention(q, k, v, positions)
    finally:
        comm.batch_isend_irecv, ring._block_forward, ring._wait = originals
    first = events.index("start")
    assert events[first + 1] == "compute" and "wait" in events[first + 2 :], events
    assert events.count("start") == events.count("wait") == world_size - 1, events


def _refusals() -> None:
    """Wrong position lists, head counts, chunks and dropout are refused naming the values."""
    from colossal.shardformer.sequence.ring import ring_attention, ring_attention_forward

    size = torch.distributed.get_world_size()
    q = torch.randn(1, 2, 4, 4)
    pos = [torch.arange(4)] * size
    with pytest.raises(ValueError, match="position lists"):
        ring_attention(q, q, q, [torch.arange(3)] * size)
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(torch.randn(1, 3, 4, 4), q, q, pos)
    with pytest.raises(ValueError, match="equal chunks"):
        ring_attention(q, q, q, pos, chunks=3)
    with pytest.raises(NotImplementedError, match="dropout"):
        ring_attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1)


def test_ring_layout_follows_causality() -> None:
    """Zigzag only where it balances causal work; bidirectional models split contiguously.

    Catches ViT refused by ring attention (its patches + [CLS] never split in 2P chunks)
    and a causal model losing zigzag's load balance.
    """
    import _sp_attention_cases as c

    from colossal.shardformer.sequence.attention import sequence_layout

    for build, ring in ((c.gpt2, "zigzag"), (c.opt, "zigzag"), (c.bert, "contiguous"),
                        (c.vit, "contiguous")):  # fmt: skip
        model = build()()
        assert sequence_layout(model, "ring_attn") == ring, type(model).__name__
        assert sequence_layout(model, "all_to_all") == "contiguous"
    with pytest.raises(ValueError, match="split_gather"):
        sequence_layout(model, "split_gather")


def _families(rank: int, world_size: int) -> None:
    """Every supporting family with ring attention at SP 2 equals the unsharded model.

    Catches: a layer seeing other tokens' rotary/positions, or the zigzag split and the
    attention's positions disagreeing (wrong logits); the padded mask cut for the wrong
    block (padded rows); BERT's bidirectional 4-D mask treated as causal; a stack
    parameter's gradient not summed over the group. Bidirectional models (BERT, ViT) run
    in the contiguous layout (ViT's 10 tokens, patches + [CLS], are never a multiple of
    2P). Refused: Bloom (ALiBi), and a causal length the zigzag cannot split (a ValueError
    naming the length, never a silent wrong split).
    """
    import _sp_attention_cases as c

    from colossal.shardformer import ShardConfig, ShardFormer

    kw = c.sp_kwargs("ring_attn")
    padded = c.batch(pad=True)
    c.check_family(c.derived("tiny_llama_config"), padded, "Llama (GQA, padded)", kw, local=True)
    # causal (zigzag) batch, parallel_output=False, head/norm/stack grad sync
    c.head_cases("ring_attn", partial=("model.layers.0.input_layernorm.weight",))
    mqa = c.derived("tiny_llama_config", num_key_value_heads=1)
    c.check_family(mqa, padded, "Llama (1 key/value head)", kw, steps=0, local=True)
    qwen = c.derived("tiny_qwen2_config", "Qwen2ForCausalLM")
    c.check_family(qwen, padded, "Qwen2 (tied, padded)", kw, local=True)
    c.check_family(c.gpt2(), padded, "GPT-2 (padded)", kw, local=True)
    c.check_family(c.bert(), c.mlm(padded), "BERT MLM (padded)", kw)
    c.check_family(c.opt(), padded, "OPT (padded)", kw, local=True)

    c.check_family(c.vit(), c.pixels(), "ViT (10 tokens, contiguous)", kw)

    with pytest.raises(ValueError, match="Bloom.*split_gather"):
        ShardFormer(ShardConfig(**kw)).optimize(c.bloom()())
    model, _ = ShardFormer(ShardConfig(**kw)).optimize(c.gpt2()())
    with pytest.raises(ValueError, match="sequence length 6 is not divisible by 4.*pad"):
        model(**c.batch(seq_len=6))


@distributed_test(2)
def test_ring(rank: int, world_size: int) -> None:
    """SP 2: the ring alone (masks, GQA, layouts, skipped blocks), comm, every family."""
    _direct(rank, world_size)
    _comm_allgather(rank, world_size)
    with _rotation("ring"):
        _direct(rank, world_size)
        _comm(rank, world_size)
    _refusals()
    _families(rank, world_size)


@distributed_test(4)
def test_attention_modes_world4(rank: int, world_size: int) -> None:
    """Ring at SP 4 alone, TP 2 x SP 2 (Llama) for both attention modes, PP 2 x SP 2.

    Catches: a block's gradient not carried all the way back (SP 4: it passes ranks that
    neither own nor first touched it); head checks or splits using global instead of
    TP-local head counts (4 query / 2 key-value heads per TP rank, split again by Ulysses);
    the grad sync summing over the wrong group (TP shards mixed: wrong gradients). PP 2 x
    SP 2: the sharded causal-LM head on the last pipeline slice only (a gather skipped on
    stage 0 would send half a sequence), a tied embedding split over two chunks of stage 0
    (its gradient counted twice without the cross-chunk scale).
    """
    import _sp_attention_cases as c

    from colossal.core import ProcessGroupMesh

    _direct(rank, world_size)
    with _rotation("ring"):
        _direct(rank, world_size)
    mesh = ProcessGroupMesh(2, 2, axis_names=("sp", "tp"))
    sp, tp = mesh.get_group_along_axis("sp"), mesh.get_group_along_axis("tp")
    for mode in ("all_to_all", "ring_attn"):
        kw = c.sp_kwargs(mode, sp, tp)
        llama = c.derived("tiny_llama_config")
        c.check_family(llama, c.batch(), f"Llama TP2xSP2 {mode}", kw, local=True)
    c.pipeline_cases(ProcessGroupMesh(2, 2, axis_names=("pp", "sp")))
