"""search_chunk_configuration: low waste on real shapes, equal to a brute-force minimum."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from colossal.gemini import search_chunk_configuration

M = 2**20


def gpt2_small_shapes() -> list[tuple[str, tuple[int, ...]]]:
    vocab, positions, hidden, layers = 50257, 1024, 768, 12
    out = [("wte.weight", (vocab, hidden)), ("wpe.weight", (positions, hidden))]
    for i in range(layers):
        b = f"h.{i}."
        out += [
            (b + "ln_1.weight", (hidden,)), (b + "ln_1.bias", (hidden,)),
            (b + "attn.c_attn.weight", (hidden, 3 * hidden)),
            (b + "attn.c_attn.bias", (3 * hidden,)),
            (b + "attn.c_proj.weight", (hidden, hidden)), (b + "attn.c_proj.bias", (hidden,)),
            (b + "ln_2.weight", (hidden,)), (b + "ln_2.bias", (hidden,)),
            (b + "mlp.c_fc.weight", (hidden, 4 * hidden)), (b + "mlp.c_fc.bias", (4 * hidden,)),
            (b + "mlp.c_proj.weight", (4 * hidden, hidden)), (b + "mlp.c_proj.bias", (hidden,)),
        ]
    return out + [("ln_f.weight", (hidden,)), ("ln_f.bias", (hidden,))]


def llama_7b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    vocab, hidden, inter, layers = 32000, 4096, 11008, 32
    out = [("embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        b = f"layers.{i}."
        out += [(b + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        out += [(b + "mlp.gate_proj.weight", (inter, hidden)),
                (b + "mlp.up_proj.weight", (inter, hidden)),
                (b + "mlp.down_proj.weight", (hidden, inter)),
                (b + "input_layernorm.weight", (hidden,)),
                (b + "post_attention_layernorm.weight", (hidden,))]
    return out + [("norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


@pytest.mark.parametrize("shapes", [gpt2_small_shapes, llama_7b_shapes])
@pytest.mark.parametrize("dp_size", [1, 2, 8])
def test_real_shapes_waste_at_most_ten_percent(shapes, dp_size: int) -> None:
    named = shapes()
    result = search_chunk_configuration(named, dp_size=dp_size)
    total = sum(torch.Size(s).numel() for _, s in named)
    assert result.total_numel == total
    assert result.wasted_fraction <= 0.10, result
    assert result.chunk_size % dp_size == 0
    assert 32 * M <= result.chunk_size <= 64 * M + dp_size
    first = named[0][0]
    assert first in result.large_params  # the embedding is far above mean + 3 std


def _brute_force(sizes, lo, hi, dp, filter_large):
    """Pack greedily at every size in [lo, hi], one at a time; (least waste, largest argmin)."""
    mean = sum(sizes) / len(sizes)
    std = (sum((s - mean) ** 2 for s in sizes) / len(sizes)) ** 0.5
    pad = lambda n: -(-n // dp) * dp  # noqa: E731
    best = None
    for c in range(lo, hi + 1):
        cap, chunks, waste = pad(c), [], 0
        current = 0
        for s in sizes:
            if (filter_large and s > mean + 3 * std) or s > cap:
                waste += pad(s) - s
                chunks.append([s])
                continue
            if current + s > cap:
                waste += cap - current
                current = 0
            if current == 0:
                chunks.append([])
            chunks[-1].append(s)
            current += s
        waste += pad(current) - current
        if best is None or waste <= best[0]:
            best = (waste, cap, len(chunks))
    return best


@pytest.mark.parametrize("dp_size", [1, 3])
@pytest.mark.parametrize("filter_large", [True, False])
def test_equals_brute_force_minimum(dp_size: int, filter_large: bool) -> None:
    g = torch.Generator().manual_seed(7)
    sizes = torch.randint(1, 60, (24,), generator=g).tolist()
    sizes[9] = 2000  # above mean + 3 std
    lo, width = 64, 150
    result = search_chunk_configuration(
        [(f"p{i}", s) for i, s in enumerate(sizes)],
        search_range_m=width / M,
        search_interval=1,
        min_chunk_size_m=lo / M,
        filter_exlarge_params=filter_large,
        dp_size=dp_size,
    )
    waste, cap, n_chunks = _brute_force(sizes, lo, lo + width, dp_size, filter_large)
    # Catches a wrong waste formula, a missed candidate, or losing the tie to the smaller size.
    assert (result.wasted_numel, result.chunk_size, result.n_chunks) == (waste, cap, n_chunks)
    assert result.large_params == ("p9",)
    # The step is hidden_dim when given: only multiples of it above the minimum are tried.
    stepped = search_chunk_configuration(
        sizes, search_range_m=width / M, min_chunk_size_m=lo / M, dp_size=dp_size,
        hidden_dim=16, filter_exlarge_params=filter_large,
    )
    tried = {-(-(lo + 16 * k) // dp_size) * dp_size for k in range(width // 16 + 1)}
    assert stepped.chunk_size in tried
    assert stepped.wasted_numel >= result.wasted_numel


def test_small_models_get_one_chunk_and_tied_weights_count_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied: 40 + 10 bias elements
    result = search_chunk_configuration(model, dp_size=4)
    # Catches a tied weight counted twice, or the total not rounded to the dp size.
    assert (result.total_numel, result.chunk_size, result.n_chunks) == (50, 52, 1)
    assert result.wasted_numel == 2 and result.large_params == ()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="dp_size"):
        search_chunk_configuration([4, 4], dp_size=0)
    with pytest.raises(ValueError, match="search_interval"):
        search_chunk_configuration([4, 4], search_interval=0)
    with pytest.raises(TypeError, match="nn.Module"):
        search_chunk_configuration(42)
    with pytest.raises(TypeError, match="parameter 'x'"):
        search_chunk_configuration([("x", "big")])


def test_ties_go_to_the_larger_chunk() -> None:
    # Sizes 20 and 30 both pack eight 10-element parameters without waste.
    result = search_chunk_configuration(
        [10] * 8, search_range_m=15 / M, search_interval=1, min_chunk_size_m=20 / M
    )
    # Catches the tie resolved to the smaller size (more chunks, more collectives).
    assert (result.chunk_size, result.wasted_numel, result.n_chunks) == (30, 0, 3)
