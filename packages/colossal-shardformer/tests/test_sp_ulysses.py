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

from colossal.core.testing import distributed_test


class _Attn(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.is_causal = causal


def _case(
    rank: int,
    size: int,
    name: str,
    mask: Any,
    causal: bool,
    hk: int = 4,
    layout: str = "contiguous",
) -> None:
    from _sp_attention_cases import check_slice, reference_case

    from colossal.core import CommTracker
    from colossal.shardformer.sequence.layout import token_indices
    from colossal.shardformer.sequence.ulysses import ulysses_attention_forward

    full, w, ref = reference_case(11, mask, causal, hk)
    b, hq, s, d = w.shape
    mine = token_indices(s, rank, size, layout)
    positions = None
    if layout != "contiguous":
        positions = torch.cat([token_indices(s, r, size, layout) for r in range(size)])
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in full]
    with CommTracker() as fwd:
        out, _ = ulysses_attention_forward(_Attn(causal), *local, mask, positions=positions)
    out = out.transpose(1, 2)  # [B, H, s/P, D]
    with CommTracker() as bwd:
        (out * w[:, :, mine]).sum().backward()
    check_slice(out, local, full, ref, mine, f"{name} (rank {rank}/{size})")
    h = hq * d
    elements = (2 + 2 * hk / hq) * b * s * h / size  # q, out: full h; k, v: hk heads
    for tracker in (fwd, bwd):
        assert tracker.calls("all_to_all") == 2  # q, k, v in one exchange; the output
        assert tracker.bytes("all_to_all") == elements * 4, name  # fp32


def _masks(s: int = 16) -> dict[str, Any]:
    pad = torch.ones(2, s, dtype=torch.long)
    pad[1, :5] = 0
    custom = torch.ones(s, s, dtype=torch.bool).tril()
    custom[:, 3] = False
    custom[3, 3] = True
    return {"pad": pad, "bool4": custom.expand(2, 1, s, s).clone()}


def _direct(rank: int, world_size: int) -> None:
    """Outputs and q/k/v gradients equal SDPA over the whole sequence; exact exchange volume."""
    m = _masks()
    _case(rank, world_size, "causal", None, True)
    _case(rank, world_size, "causal+padding", m["pad"], True)
    _case(rank, world_size, "not causal+padding", m["pad"], False)
    _case(rank, world_size, "4-D bool", m["bool4"], True)
    _case(rank, world_size, "GQA", m["pad"], True, hk=2)
    _case(rank, world_size, "zigzag", m["pad"], True, layout="zigzag")
    from colossal.shardformer.sequence.ulysses import seq_to_heads, ulysses_attention_forward

    with pytest.raises(ValueError, match="3 heads over 2"):
        seq_to_heads(torch.randn(1, 3, 4, 2), None)
    q = torch.randn(1, 2, 4, 2)
    with pytest.raises(ValueError, match="3 heads over 2"):  # checked before the exchange
        ulysses_attention_forward(_Attn(True), q, torch.randn(1, 3, 4, 2), q, None)
    with pytest.raises(TypeError, match="one dtype"):  # the packed exchange needs one dtype
        ulysses_attention_forward(_Attn(True), q, q, q.double(), None)


# ---------------------------------------------------------------------------- end to end


def _families(rank: int, world_size: int) -> None:
    """Every supporting family at SP 2 (no TP): logits, loss, gradients, a step equal unsharded.

    Causal LMs (Llama, Qwen2, GPT-2, OPT) return this rank's tokens' logits, compared with
    the unsharded logits at their token indices (``head_cases``: a batch with no label on
    rank 0's tokens, ``parallel_output=False``, the head's and final norm's partial
    gradients); tied heads (Qwen2, GPT-2) catch the embedding's share counted twice.

    Catches: a layer seeing the wrong tokens' rotary/positions (Llama, Qwen2: wrong logits);
    a mask not applied over the gathered sequence (padded rows: wrong logits); a stack
    parameter's gradient not summed over the group (and ``sync_matters``: without the sync
    it is visibly partial); Bloom and a key/value head count SP does not divide refused.
    """
    import _sp_attention_cases as c

    from colossal.shardformer import ShardConfig, ShardFormer

    kw = c.sp_kwargs("all_to_all")
    padded = c.batch(pad=True)
    llama = c.derived("tiny_llama_config")
    c.check_family(llama, padded, "Llama (GQA, padded)", kw, local=True)
    c.head_cases("all_to_all")  # causal batch, parallel_output=False, head/norm grad sync
    qwen = c.derived("tiny_qwen2_config", "Qwen2ForCausalLM")
    c.check_family(qwen, padded, "Qwen2 (tied, padded)", kw, local=True)
    c.check_family(c.gpt2(), padded, "GPT-2 (padded)", kw, local=True)
    c.check_family(c.bert(), c.mlm(padded), "BERT MLM (padded)", kw)
    c.check_family(c.vit(), c.pixels(), "ViT (10 tokens)", kw)
    c.check_family(c.opt(), padded, "OPT (padded)", kw, local=True)
    c.sync_matters(c.gpt2(), padded, kw, "transformer.h.0.ln_1.weight")

    with pytest.raises(ValueError, match="Bloom.*split_gather"):
        ShardFormer(ShardConfig(**kw)).optimize(c.bloom()())
    mqa = c.derived("tiny_llama_config", num_key_value_heads=1)()
    with pytest.raises(ValueError, match="8 query and 1 key/value heads.*ring_attn"):
        ShardFormer(ShardConfig(**kw)).optimize(mqa)
    model, _ = ShardFormer(ShardConfig(**kw)).optimize(c.gpt2()())
    with pytest.raises(ValueError, match="sequence length 7 is not divisible by 2.*pad"):
        model(**c.batch(seq_len=7))


def _tracked(layers: int, heads: int, kv: int, ids: torch.Tensor) -> tuple[Any, Any]:
    from _models import tiny_llama_config
    from transformers import LlamaModel

    from colossal.core import CommTracker
    from colossal.shardformer import ShardConfig, ShardFormer

    torch.manual_seed(0)
    config = tiny_llama_config(layers, num_attention_heads=heads, num_key_value_heads=kv)
    kw = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all",
          "enable_tensor_parallelism": False}  # fmt: skip
    model, _ = ShardFormer(ShardConfig(**kw)).optimize(LlamaModel(config).eval())
    with CommTracker() as fwd:
        hidden = model(input_ids=ids).last_hidden_state
    with CommTracker() as bwd:
        hidden.sum().backward()
    return fwd, bwd


def _comm_volume(rank: int, world_size: int) -> None:
    """Ulysses moves exactly 4 * s * h / P elements per layer per rank (per sequence).

    Counted: the input of each ``all_to_all`` on the SP group (the tracker's logical volume;
    the rank's own 1/P slice included), q, k, v before the attention and its output after.
    Forward and backward each: ``4 * b * s * h / P`` elements per layer with as many
    key/value heads as query heads, ``(2 + 2 * Hk / H) * b * s * h / P`` with grouped-query
    attention (key/value heads exchanged unrepeated). No other collective inside the stack.
    Catches key/value heads repeated before the exchange, an extra or missing exchange, a
    backward that gathers instead of exchanging.
    """
    ids = torch.randint(0, 250, (2, 8), generator=torch.Generator().manual_seed(0))
    b, s, h, layers = ids.shape[0], ids.shape[1], 64, 2
    group = tuple(range(world_size))
    for heads, kv in ((8, 8), (8, 4)):
        fwd, bwd = _tracked(layers, heads, kv, ids)
        elements = (2 + 2 * kv / heads) * b * s * h
        per_layer = elements / world_size * 4  # fp32 bytes
        for tracker in (fwd, bwd):
            assert tracker.calls("all_to_all", group) == 2 * layers  # q/k/v, output
            assert tracker.bytes("all_to_all", group) == layers * per_layer
        if kv == heads:
            assert fwd.bytes("all_to_all", group) == layers * 4 * s * h * b // world_size * 4
        # Outside the attention: the stack's exit all-gather forward, entry's in backward.
        assert fwd.calls("all_reduce") == bwd.calls("all_reduce") == 0
        assert fwd.calls("all_gather") == 1 and bwd.calls("all_gather") == 1


@distributed_test(2)
def test_ulysses(rank: int, world_size: int) -> None:
    """SP 2: the attention alone, every family end to end, refusals, exact comm volume."""
    _direct(rank, world_size)
    _families(rank, world_size)
    _comm_volume(rank, world_size)
