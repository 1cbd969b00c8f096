"""The colossal attention behind transformers' AttentionInterface, and fused norms.

Single process: a tiny Llama with ``set_attn_implementation("colossal")`` against SDPA and
eager on causal, padded and custom masks; the fused-norm swap against the native norms.
"""

from __future__ import annotations

import pytest
import torch
from _models import causal_lm_batch, tiny_llama_config

from colossal.core.testing import assert_rel_close
from colossal.shardformer.attention import (
    ATTENTION_NAME,
    colossal_attention_forward,
    register_attention,
)
from colossal.shardformer.shard import ShardConfig, ShardFormer


def _llama(attn: str = "sdpa") -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(1, attn_implementation=attn)).eval()


def _custom_mask() -> torch.Tensor:
    """Additive float mask: causal, and nobody may look at position 3 (but itself)."""
    mask = torch.triu(torch.full((8, 8), -1e9), 1)
    mask[:, 3] = -1e9
    mask[3, 3] = 0.0
    return mask.expand(2, 1, 8, 8).clone()


@pytest.mark.parametrize(
    ("masking", "kind"),
    [
        ("causal", "causal"),
        ("padded", "padded_causal"),
        ("custom_float", "custom"),
        ("custom_bool", "custom"),
    ],
)
def test_colossal_attention_matches_sdpa(
    masking: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: a dropped or mis-oriented mask, a lost causal flag, a wrong output layout,
    and a padded batch that does not reach the kernels' padded kind."""
    import colossal.kernels

    kinds: list[str] = []
    dispatch = colossal.kernels.attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, **kw: object):
        kinds.append(mask.kind.value)  # type: ignore[attr-defined]
        return dispatch(q, k, v, mask, **kw)

    monkeypatch.setattr(colossal.kernels, "attention", spy)
    batch = causal_lm_batch(250)
    kwargs: dict[str, torch.Tensor] = {"input_ids": batch["input_ids"]}
    if masking == "padded":
        kwargs["attention_mask"] = batch["attention_mask"]
    elif masking.startswith("custom"):
        mask = _custom_mask()
        kwargs["attention_mask"] = mask == 0 if masking == "custom_bool" else mask
    model = _llama("sdpa")
    expected = model(**kwargs).logits
    assert register_attention() == register_attention() == ATTENTION_NAME  # idempotent
    model.set_attn_implementation(ATTENTION_NAME)
    assert model.config._attn_implementation == ATTENTION_NAME
    got = model(**kwargs).logits
    assert kinds == [kind]  # one layer, one call, the expected mask kind
    assert_rel_close(got, expected, 1e-5, name=masking)
    if masking == "custom_bool":
        return  # transformers' eager attention adds a bool mask as 0/1: no reference there
    # Against eager too (the math reference), on the positions that are real tokens.
    model.set_attn_implementation("eager")
    eager = model(**kwargs).logits
    real = batch["attention_mask"].bool() if masking == "padded" else slice(None)
    assert_rel_close(got[real], eager[real], 1e-5, name=f"{masking} vs eager")


def test_colossal_attention_takes_a_2d_padding_mask() -> None:
    """The padded kind: a [B, S] mask straight from the caller, with grouped-query heads."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    pad = torch.ones(2, 6, dtype=torch.long)
    pad[0, 4:] = 0  # right padding
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 2
    out, weights = colossal_attention_forward(module, q, k, v, pad, scaling=0.3)
    assert weights is None and out.shape == (2, 6, 4, 8)
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool)) & pad.bool()[:, None, None, :]
    ref, _ = sdpa_attention_forward(module, q, k, v, allowed, scaling=0.3)
    real = pad.bool()
    assert_rel_close(out[real], ref[real], 1e-5, name="padded")
    assert float(out[~real].abs().max()) == 0.0  # padded queries give zero rows


def test_colossal_attention_refuses_softcapping() -> None:
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="softcap"):
        colossal_attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)


def test_shard_config_switches_attention_and_fuses_norms() -> None:
    """enable_all_optimization without a process group: same logits, fused modules in place."""
    from colossal.kernels import FusedRMSNorm

    batch = causal_lm_batch(250)
    model = _llama("sdpa")
    expected = model(**batch)
    model, _ = ShardFormer(ShardConfig(enable_all_optimization=True)).optimize(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    assert len(norms) == 3  # input, post-attention and final norm of the 1-layer model
    got = model(**batch)
    assert_rel_close(got.logits, expected.logits, 1e-5, name="logits")
    assert_rel_close(got.loss, expected.loss, 1e-5, name="loss")
