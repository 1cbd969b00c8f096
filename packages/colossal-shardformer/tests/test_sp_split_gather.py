"""``split_gather`` (Megatron sequence parallelism) against the unsharded models, at TP = SP = 2.

Every family with a tensor-parallel policy (GPT-2, BERT, ViT, OPT, Bloom hand-written; Llama
and Qwen2 derived from their plan) runs through ``reference_check`` with
``enable_sequence_parallelism=True`` and ``SequenceParallelGradSync`` after each backward:
logits (gathered), loss, every gradient (TP shards gathered), replicated gradients equal on
both ranks, and the parameters after SGD steps, at relative error <= 1e-5 in fp32. Causal
models run with a padded mask (row 1 left-padded) and without padding; BERT with a padded
mask; ViT has none. One spawn holds all families (CI budget).

What each check catches:
- the stack's entry split or exit gather wrong (wrong slice, layout, or a missing all-gather
  of the entry's gradient): wrong logits or wrong embedding / position gradients;
- a region entry or column-parallel linear still doing ``copy_to_tp_region`` on a shard
  (attention would see half the sequence): wrong logits; a row-parallel linear still
  all-reducing: a shape error or doubled activations;
- the reduce-scatter / all-gather pair swapped in backward: wrong gradients of every
  parameter before the layer;
- OPT's MLP sees ``(batch * seq, hidden)`` activations: the primitives must accept the
  flattened form (else a shape error);
- a parameter not marked partial (norms, row-parallel biases) or marked twice: its gradient
  is half / double the reference (see :func:`_check_sync_matters`, which also pins the set
  of marked parameters);
- a sequence length the group cannot split is refused with a ValueError, never silently
  wrong.

The exact communication volume: :func:`_check_comm_volume`.
"""

from __future__ import annotations

from typing import Any

import _families as fam
import pytest
import torch

from colossal.core.testing import distributed_test

RTOL = 1e-5
UPDATE_RTOL = 1e-3  # a parameter's total change is a difference of nearby fp32 numbers
SEQ = 8
STEPS = 2
ZERO_GRAD_SUFFIXES = ("key.bias", "k_proj.bias")  # exact gradient 0: compared absolutely
ZERO_GRAD_ATOL = 1e-6
SP = {"enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}


def _sync(model: torch.nn.Module) -> None:
    from colossal.shardformer import SequenceParallelGradSync

    SequenceParallelGradSync(model)()


def _batch(pad: bool = True, seq_len: int = SEQ) -> dict[str, torch.Tensor]:
    return fam.lm_batch(pad=pad, seq_len=seq_len)


def _check(
    build: Any, batch: dict[str, torch.Tensor], what: str, steps: int = STEPS, **kwargs: Any
) -> Any:
    """``reference_check`` with split_gather and the grad sync; raises listing failures."""
    from _models import reference_check

    built: list[Any] = []

    def recording_build() -> Any:
        built.append(build())
        return built[-1]

    kwargs.setdefault("after_backward", _sync)
    report = reference_check(
        recording_build,
        batch,
        shard_config_kwargs=dict(SP),
        steps=steps,
        rtol=RTOL,
        check=False,
        **kwargs,
    )
    ref, model = built
    failures = [
        f
        for f in report.failures
        if not f.startswith(("grad ", "param ", "update ", "replicated grad spread"))
    ]
    for label, errs, tol in (
        ("grad", report.grads, RTOL),
        ("param", report.params, RTOL),
        ("update", report.updates, UPDATE_RTOL),
        ("replicated grad spread", report.replicated_spread, RTOL),
    ):
        for n, e in errs.items():
            if not n.endswith(ZERO_GRAD_SUFFIXES) and not e <= tol:
                failures.append(f"{label} {n}: relative error {e:.3e} > {tol:.1e}")
    if steps:
        from colossal.core import sharded_view

        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if n.endswith(ZERO_GRAD_SUFFIXES):
                view = sharded_view(p, like=p)
                full = p.detach() if view is None else view.gather()
                diff = float((full - ref_params[n].detach()).abs().max())
                if not diff <= ZERO_GRAD_ATOL:
                    failures.append(f"param {n}: max abs difference {diff:.3e}")
    assert not failures, f"{what} (split_gather): differs from unsharded:\n" + "\n".join(
        failures[:30]
    )
    assert report.grads, f"{what}: no gradient was compared"
    return report


def _check_sync_matters() -> None:
    """Without the grad sync a norm's gradient is this rank's part only; the marks are exact."""
    from _models import reference_check

    from colossal.core import shard_spec
    from colossal.shardformer.sequence import partial_grad_group

    report = reference_check(
        fam.gpt2(), _batch(), shard_config_kwargs=dict(SP), steps=0, rtol=RTOL, check=False
    )
    # Catches a missing grad sync (or split_gather leaving norms on the whole sequence).
    assert report.grads["transformer.h.0.ln_1.weight"] > 1e-2, report.grads
    assert report.grads["transformer.h.1.mlp.c_proj.bias"] > 1e-2, report.grads
    # Outside the stack nothing is partial: the final norm and embeddings are exact.
    assert report.grads["transformer.ln_f.weight"] <= RTOL
    assert report.grads["transformer.wpe.weight"] <= RTOL

    from colossal.shardformer import ShardConfig, ShardFormer

    model, _ = ShardFormer(ShardConfig(**SP)).optimize(fam.gpt2()())
    marked = {n for n, p in model.named_parameters() if partial_grad_group(p)[0]}
    expected = {
        n
        for n, p in model.named_parameters()
        if n.startswith("transformer.h.") and shard_spec(p) is None
    }
    # ln_1, ln_2 (weight, bias) and the two row-parallel biases of each of the 2 blocks.
    assert marked == expected and len(marked) == 2 * 6, sorted(marked)


def _check_refuses_odd_length() -> None:
    """A sequence the TP group cannot split raises the ValueError naming length and size."""
    from colossal.shardformer import ShardConfig, ShardFormer

    model, _ = ShardFormer(ShardConfig(**SP)).optimize(fam.gpt2()())
    batch = _batch(seq_len=7)
    with pytest.raises(ValueError, match=r"sequence length 7 is not divisible by 2.*pad"):
        model(**batch)


@distributed_test(2)
def test_split_gather(rank: int, world_size: int) -> None:
    """Every family at TP = SP = 2 equals the unsharded model; grad sync; refusal; comm volume.

    One spawn for all cases (CI budget): the per-process import and start-up cost dominates.
    """
    padded, causal = _batch(pad=True), _batch(pad=False)
    _check(fam.gpt2(), padded, "GPT2LMHeadModel (padded)")
    _check(fam.gpt2(), causal, "GPT2LMHeadModel (causal)", steps=0)
    _check(fam.bert(), fam.masked_lm(padded), "BertForMaskedLM (padded)")
    _check(fam.vit(), fam.images(), "ViT")  # 12 x 12: 9 patches + [CLS], divisible by SP 2
    _check(fam.opt(), padded, "OPTForCausalLM (padded)")
    _check(fam.bloom(), padded, "BloomForCausalLM (padded)")
    no_mask = {k: v for k, v in causal.items() if k != "attention_mask"}
    _check(fam.bloom(), no_mask, "BloomForCausalLM (no mask)", steps=0)
    _check(fam.derived("tiny_llama_config"), padded, "LlamaForCausalLM (padded)")
    _check(fam.derived("tiny_llama_config"), causal, "LlamaForCausalLM (causal)", steps=0)
    _check(fam.derived("tiny_qwen2_config", "Qwen2ForCausalLM"), padded, "Qwen2 (tied, padded)")
    _check_sync_matters()
    _check_refuses_odd_length()
    _check_comm_volume(world_size)


# ------------------------------------------------------------------------------ comm volume


def _tracked_step(build: Any, batch: dict[str, torch.Tensor], group_key: tuple[int, ...]) -> Any:
    """Forward + backward of the split_gather model under a CommTracker."""
    from colossal.core import CommTracker
    from colossal.shardformer import ShardConfig, ShardFormer

    torch.manual_seed(0)
    model, _ = ShardFormer(ShardConfig(**SP)).optimize(build())
    model.train(False)
    with CommTracker() as tracker:
        out = model(**batch)
        hidden = out.last_hidden_state
        weight = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(3))
        (hidden * weight).sum().backward()
    return {
        kind: (tracker.calls(kind, group_key), tracker.bytes(kind, group_key))
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
    }


def _check_comm_volume(world_size: int) -> None:
    """One layer moves exactly Megatron-SP's volume on the TP group (forward + backward).

    Per layer per rank: an all-gather of the ``b * s * h`` activations before attention and
    before the MLP and a reduce-scatter of ``b * s * h`` after each, the same again in
    backward; no all-reduce inside the layer. Measured as the difference between a 2-layer
    and a 1-layer model (what lies outside the stack cancels), plus the absolute counts of
    the 1-layer model (its stack's exit all-gather forward and entry all-gather backward).
    Llama (derived policy: both blocks enter a region) and GPT-2 (its MLP's column-parallel
    ``c_fc`` gathers on its own). Catches a leftover all-reduce (``copy_to_tp_region`` /
    row all-reduce still active), a gather per projection instead of per region (q, k, v
    each gathering: 3x), or a missing backward collective.
    """
    ids = _batch(pad=False)["input_ids"]
    b, s, h = ids.shape[0], ids.shape[1], 64
    volume = b * s * h * 4  # fp32 bytes of the full activations
    group = tuple(range(world_size))
    cases = {
        "llama": lambda n: fam.derived("tiny_llama_config", "LlamaModel", layers=n),
        "gpt2": lambda n: fam.gpt2("GPT2Model", n_layer=n),
    }
    for name, make in cases.items():
        one = _tracked_step(make(1), {"input_ids": ids}, group)
        two = _tracked_step(make(2), {"input_ids": ids}, group)
        layer = {k: (two[k][0] - one[k][0], two[k][1] - one[k][1]) for k in one}
        assert layer["all_gather"] == (4, 4 * volume), (name, layer)
        assert layer["reduce_scatter"] == (4, 4 * volume), (name, layer)
        assert layer["all_reduce"] == (0, 0), (name, layer)
        assert layer["all_to_all"] == (0, 0), (name, layer)
        assert one["all_gather"] == (4 + 2, 6 * volume), (name, one)
        assert one["reduce_scatter"] == (4, 4 * volume), (name, one)
