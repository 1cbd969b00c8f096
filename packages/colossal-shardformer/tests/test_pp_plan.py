"""Pipeline stages without processes: plans, splits, placeholders, shared parameters, errors.

A duck-typed stage manager places this process on any stage, so every stage of a model can
be built in one process from the same model and chained slice by slice: the loss and every
gradient must equal the unsharded model's. What each check catches:
- a wrong placeholder kind (an embedding added twice on a later stage, a position embedding
  not zeroed, a final norm applied on every stage) or a keyword not passed on (attention
  mask, labels, the ``input_ids`` GPT-2's sequence classification pools with): a wrong loss;
- a layer held twice or skipped, or slices out of order (loop vs V layout): wrong loss or
  gradients, and the partition check (every parameter on exactly one slice);
- a renamed layer (re-indexed from 0): the Hugging Face name check;
- a split that reads or copies modules it does not hold: the meta-model check;
- a tied embedding reported wrongly across stages (or split on one stage): the shared checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _pp_cases import CASES, PPCase, build_pair
from torch import nn

from colossal.pipeline import StageLayout, distribute_layers, stage_index
from colossal.shardformer import ShardConfig, ShardFormer, StagePlan
from colossal.shardformer.pipeline import (
    HIDDEN_KEY,
    HeldLayers,
    StagePlaceholder,
    derive_stage_plan,
    is_placeholder,
)

LAYOUTS = [(2, 1, "loop"), (4, 1, "loop"), (2, 2, "loop"), (2, 2, "v")]


class FakeManager:
    """The stage-manager attributes the split reads, for any stage, without processes."""

    def __init__(
        self, stages: int, stage: int, chunks: int = 1, kind: str = "loop", counts: Any = None
    ) -> None:
        self.num_stages, self.stage, self.num_model_chunks = stages, stage, chunks
        self.layout = StageLayout(stages, chunks, kind)
        self.counts = counts

    def distribute_layers(self, num_layers: int) -> list[int]:
        if self.counts is not None:
            return list(self.counts)
        return distribute_layers(num_layers, self.num_stages, self.num_model_chunks)

    def get_stage_index(self, counts: list[int]) -> Any:
        ranges = stage_index(counts, self.stage, self.layout)
        return ranges[0] if self.num_model_chunks == 1 else ranges


def _split(model: nn.Module, manager: FakeManager) -> tuple[list[nn.Module], list[Any]]:
    config = ShardConfig(pipeline_stage_manager=manager, enable_tensor_parallelism=False)
    out, shared = ShardFormer(config).optimize(model)
    return (list(out) if isinstance(out, nn.ModuleList) else [out]), shared


def _all_slices(model: nn.Module, stages: int, chunks: int, kind: str) -> dict[int, nn.Module]:
    layout = StageLayout(stages, chunks, kind)
    slices = {}
    for stage in range(stages):
        got, _ = _split(model, FakeManager(stages, stage, chunks, kind))
        for chunk_id, chunk in enumerate(got):
            slices[layout.slice_of(stage, chunk_id)] = chunk
    return slices


def _names(module: nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_stages_chained_in_one_process_equal_the_model(name: str) -> None:
    """Every layout's slices, run one after the other, give the model's loss and gradients."""
    case: PPCase = CASES[name]
    batch = case.batch()
    ref, model = build_pair(case)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    for stages, chunks, kind in LAYOUTS:
        model.zero_grad(set_to_none=True)  # the split leaves the model itself as it was
        slices = _all_slices(model, stages, chunks, kind)
        what = f"{name} {stages}x{chunks} {kind}"
        # every parameter on exactly one slice (a tied pair counts once per slice holding it)
        owners: dict[int, list[int]] = {}
        for v, chunk in slices.items():
            for _, p in chunk.named_parameters():
                owners.setdefault(id(p), []).append(v)
        all_params = {id(p): n for n, p in model.named_parameters()}
        assert set(owners) == set(all_params), what
        for pid, vs in owners.items():
            assert len(vs) == 1 or (case.tied and sorted(vs) == [0, len(slices) - 1]), (
                f"{what}: {all_params[pid]} on slices {vs}"
            )
        x: Any = batch
        for v in range(len(slices)):
            x = slices[v](**x)
            if v < len(slices) - 1:
                assert isinstance(x, dict) and HIDDEN_KEY in x, what
                assert "token_type_ids" not in x and "pixel_values" not in x, what
        assert x.loss is not None, what
        torch.testing.assert_close(x.loss, ref_loss, rtol=1e-5, atol=0, msg=what)
        x.loss.backward()
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            assert p.grad is not None, f"{what}: {n} got no gradient"
            torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-5, atol=1e-7)


def test_held_layers_keep_hugging_face_names_and_the_model_is_untouched() -> None:
    """Stage 1 of 2 holds layers 2 and 3 under their names; the original keeps all four."""
    _, model = build_pair(CASES["gpt2-lm"])
    (chunk,), _ = _split(model, FakeManager(2, 1))
    names = _names(chunk)
    assert any(n.startswith("transformer.h.2.") for n in names)
    assert not any(n.startswith(("transformer.h.0.", "transformer.h.1.")) for n in names)
    assert "transformer.wte.weight" not in names and "transformer.wpe.weight" not in names
    assert "lm_head.weight" in names and "transformer.ln_f.weight" in names
    assert set(chunk.state_dict()) <= set(model.state_dict())
    held = chunk.transformer.h
    assert isinstance(held, HeldLayers) and held.global_indices == [2, 3]
    assert held[0] is model.transformer.h[2] and len(held[:1]) == 1
    assert is_placeholder(chunk.transformer.wte) and is_placeholder(chunk.transformer.wpe)
    assert len(model.transformer.h) == 4 and isinstance(model.transformer.wte, nn.Embedding)
    assert type(chunk) is type(model) and chunk.config is model.config


def test_meta_model_split_never_touches_other_stages_modules() -> None:
    """A meta model's stage holds only its modules, still on meta (nothing materialized)."""
    with torch.device("meta"):
        _, model = build_pair(CASES["llama-lm"])
    (chunk,), _ = _split(model, FakeManager(4, 2))
    params = dict(chunk.named_parameters())
    assert all(p.is_meta for p in params.values())
    assert {n.split(".")[2] for n in params if n.startswith("model.layers.")} == {"2"}
    assert not any(n.startswith(("model.embed_tokens", "model.norm", "lm_head")) for n in params)


def test_shared_params_of_tied_embeddings() -> None:
    """1F1B: ``{0: wte, 1: lm_head}`` with None for the other stage; ZB-V: one Parameter."""
    for stage in (0, 1):
        _, model = build_pair(CASES["gpt2-lm"])
        (chunk,), shared = _split(model, FakeManager(2, stage))
        assert len(shared) == 1 and sorted(shared[0]) == [0, 1]
        mine = chunk.transformer.wte.weight if stage == 0 else chunk.lm_head.weight
        assert shared[0][stage] is mine and shared[0][1 - stage] is None
    _, model = build_pair(CASES["gpt2-lm"])
    chunks, shared = _split(model, FakeManager(2, 0, 2, "v"))
    assert shared == [] and chunks[0].transformer.wte.weight is chunks[1].lm_head.weight
    _, untied = build_pair(CASES["llama-lm"])
    assert _split(untied, FakeManager(2, 0))[1] == []


def test_num_layers_per_stage_overrides_and_bad_counts_are_refused() -> None:
    """[1, 3] puts three layers on stage 1; an empty slice or a wrong sum names the counts."""
    _, model = build_pair(CASES["llama-lm"])
    (chunk,), _ = _split(model, FakeManager(2, 1, counts=[1, 3]))
    assert chunk.model.layers.global_indices == [1, 2, 3]
    with pytest.raises(ValueError, match=r"\[0, 4\].*without layers"):
        _split(model, FakeManager(2, 0, counts=[0, 4]))
    with pytest.raises(ValueError, match=r"\[2, 1\] sum to 3.*4 layers"):
        _split(model, FakeManager(2, 0, counts=[2, 1]))


def test_plans_derived_written_and_refused() -> None:
    """Llama's plan comes from base_model_pp_plan; a model with neither plan is refused."""
    _, llama = build_pair(CASES["llama-lm"])
    assert derive_stage_plan(llama) == StagePlan(
        layers="layers", first={"embed_tokens": "input"}, last={"norm": "identity"}
    )
    _, gpt2 = build_pair(CASES["gpt2-lm"])
    with pytest.raises(ValueError, match="stage_plan"):
        derive_stage_plan(gpt2)
    with pytest.raises(ValueError, match="placeholder kind"):
        StagePlan(layers="h", first={"wte": "maybe"})
    with pytest.raises(ValueError, match="both first and last"):
        StagePlan(layers="h", first={"x": "input"}, last={"x": "identity"})


def test_placeholder_kinds() -> None:
    """Absent raises naming the module; identity, zero and input return what they stand for."""
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="transformer.wte.*another pipeline stage"):
        StagePlaceholder("absent", "transformer.wte", "Embedding")(x)
    assert StagePlaceholder("identity", "ln_f")(x) is x
    zero = StagePlaceholder("zero", "wpe")(torch.arange(3))
    assert zero.dim() == 0 and float(zero) == 0.0
    stand_in = StagePlaceholder("input", "wte")
    with pytest.raises(RuntimeError, match="outside the stage forward"):
        stand_in(torch.arange(3))
    with stand_in.receive(x):
        assert stand_in(torch.arange(3)) is x
    with pytest.raises(ValueError, match="not one of"):
        StagePlaceholder("sometimes", "wte")
    assert list(StagePlaceholder("input", "wte").parameters()) == []


def test_stage_forward_passes_on_what_later_stages_need() -> None:
    """A first stage returns the hidden state plus masks, labels and ids (not token types)."""
    case = CASES["bert-mlm"]
    _, model = build_pair(case)
    (chunk,), _ = _split(model, FakeManager(2, 0))
    batch = case.batch()
    out = chunk(**batch)
    assert set(out) == {HIDDEN_KEY, "input_ids", "attention_mask", "labels"}
    assert out[HIDDEN_KEY].shape == (*batch["input_ids"].shape, 64)
    with pytest.raises(TypeError, match="keyword arguments only"):
        chunk(batch["input_ids"])
    (last,), _ = _split(model, FakeManager(2, 1))
    with pytest.raises(TypeError, match="hidden_states"):
        last(**batch)


def test_mixed_layer_types_split_on_the_pattern_or_refused() -> None:
    """Qwen2 with alternating full/sliding layers: [2, 2] matches the model, [1, 3] is refused.

    Its forward picks layer ``i``'s mask as ``layer_types[i]`` counted over the held layers,
    so a stage starting at an odd layer would give sliding layers the full mask.
    """
    kinds = ["full_attention", "sliding_attention"] * 2
    case = PPCase("qwen2-sliding", lambda: _qwen2_sliding(kinds), CASES["llama-lm"].batch)
    batch = case.batch()
    ref, model = build_pair(case)
    ref_loss = ref(**batch).loss
    first, _ = _split(model, FakeManager(2, 0))
    last, _ = _split(model, FakeManager(2, 1))
    torch.testing.assert_close(last[0](**first[0](**batch)).loss, ref_loss, rtol=1e-5, atol=0)
    with pytest.raises(NotImplementedError, match=r"layer_types.*layers \[1, 4\)"):
        _split(model, FakeManager(2, 1, counts=[1, 3]))


def _qwen2_sliding(kinds: list[str]) -> nn.Module:
    import transformers
    from _pp_cases import DECODER

    config = transformers.Qwen2Config(
        **DECODER, layer_types=kinds, use_sliding_window=True, sliding_window=3
    )
    return transformers.Qwen2ForCausalLM(config)


@pytest.mark.parametrize("cls_name", ["GPT2Model", "BertModel"])
def test_bare_base_model_last_stage_returns_its_output(cls_name: str) -> None:
    """A base model (no head) split in 2: the last stage returns its usual output object."""
    import transformers
    from _pp_cases import BERT, GPT2

    config = (transformers.GPT2Config(**GPT2) if cls_name == "GPT2Model"
              else transformers.BertConfig(**BERT))  # fmt: skip
    case = PPCase(cls_name, lambda: getattr(transformers, cls_name)(config), CASES["gpt2-lm"].batch)
    batch = {k: v for k, v in case.batch().items() if k != "labels"}
    ref, model = build_pair(case)
    expected = ref(**batch).last_hidden_state
    (first,), _ = _split(model, FakeManager(2, 0))
    (last,), _ = _split(model, FakeManager(2, 1))
    out = last(**first(**batch))
    assert type(out) is type(ref(**batch))
    torch.testing.assert_close(out.last_hidden_state, expected, rtol=1e-5, atol=1e-6)
