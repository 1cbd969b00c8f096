"""``gradient_checkpoint_config``: which layers are recomputed, and the gradients they give.

What each check catches:
- ``get_num_ckpt_layers`` values against hand-computed numbers: a wrong list index for model
  chunks (``stage + chunk * num_stages``), the ratio rounded up instead of down or floored on
  float noise (0.29 * 100 = 28.999...), the ratio winning over the explicit counts;
- validation: a ratio outside [0, 1], no ratio and no counts, sizes contradicting each other,
  a pipeline shape other than the config's, more recomputed layers than a stage holds;
- recompute counts (forward pre-hooks on each layer's ``mlp``, counted separately in forward
  and in backward): checkpointing the wrong layers (last N instead of first N, all of them,
  none), or a recompute that does not happen (the layer flag set without the function);
- gradients equal the no-checkpointing model's exactly (fp32): a cache passed positionally
  (GPT-2's ``past_key_values``) written a second time by the recompute (attention over
  doubled keys), kwargs lost in the recompute;
- with dropout > 0 and the same seed: the global RNG not replayed (``nn.Dropout``, SDPA's
  dropout), and in the TP=2 case the seeded tensor-parallel dropouts' private generators not
  replayed (different masks in the recompute), or not put back afterwards (the next step's
  masks differ from the reference's: checked over two steps);
- a layer class without transformers' ``GradientCheckpointingLayer``: the instance-level
  wrapper recomputes it and leaves parameter names alone.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from colossal.core.testing import distributed_test, relative_error
from colossal.shardformer import PipelineGradientCheckpointConfig, ShardConfig, ShardFormer

VOCAB = 250


# ------------------------------------------------------------------------------ the config


def test_num_ckpt_layers_values() -> None:
    """Explicit counts by (stage, chunk), ratio rounding, precedence, the layer-count bases."""
    explicit = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[4, 3, 2, 1, 0, 5, 6, 7])
    # 4 stages x 2 chunks: chunk c of stage s is entry s + 4 * c
    assert [explicit.get_num_ckpt_layers(s, 4, 2, 0) for s in range(4)] == [4, 3, 2, 1]
    assert [explicit.get_num_ckpt_layers(s, 4, 2, 1) for s in range(4)] == [0, 5, 6, 7]
    # 8 stages x 1 chunk: entry s
    assert [explicit.get_num_ckpt_layers(s, 8, 1) for s in range(8)] == [4, 3, 2, 1, 0, 5, 6, 7]

    # the counts win over the ratio (and over num_layers)
    both = PipelineGradientCheckpointConfig(
        gradient_checkpointing_ratio=1.0, num_ckpt_layers_per_stage=[1, 0]
    )
    assert both.get_num_ckpt_layers(0, 2, 1, num_layers=10) == 1
    assert both.get_num_ckpt_layers(1, 2, 1, num_layers=10) == 0

    # ratio of num_model_layers // (stages * chunks): 80 // 8 = 10 -> floor(0.35 * 10) = 3
    ratio = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.35, num_model_layers=80)
    assert ratio.get_num_ckpt_layers(0, 8, 1) == 3
    assert ratio.get_num_ckpt_layers(1, 4, 2, 1) == 3
    # 80 // 3 = 26 -> floor(0.35 * 26) = floor(9.1) = 9
    assert ratio.get_num_ckpt_layers(2, 3, 1) == 9
    # num_layers (what the chunk holds) is the base when given: floor(0.35 * 7) = 2
    assert ratio.get_num_ckpt_layers(0, 8, 1, num_layers=7) == 2
    # float noise: 0.29 * 100 is 28.999999999999996 but means 29
    assert (
        PipelineGradientCheckpointConfig(
            gradient_checkpointing_ratio=0.29, num_model_layers=100
        ).get_num_ckpt_layers(0, 1, 1)
        == 29
    )
    # ratio of num_layers_per_stage[stage + chunk * stages]
    per_stage = PipelineGradientCheckpointConfig(
        gradient_checkpointing_ratio=0.5,
        num_layers_per_stage=[9, 9, 9, 10, 11, 10, 11, 11],
        num_model_layers=80,
    )
    assert [per_stage.get_num_ckpt_layers(s, 8, 1) for s in range(8)] == [4, 4, 4, 5, 5, 5, 5, 5]
    assert per_stage.get_num_ckpt_layers(1, 4, 2, 1) == 5  # entry 5: 10 layers
    assert (
        PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.0).get_num_ckpt_layers(
            0, 1, 1, num_layers=6
        )
        == 0
    )
    assert (
        PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1).get_num_ckpt_layers(
            0, 1, 1, num_layers=6
        )
        == 6
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, ValueError, "gradient_checkpointing_ratio .* or num_ckpt_layers_per_stage"),
        ({"gradient_checkpointing_ratio": 1.5}, ValueError, r"\[0, 1\].*1\.5"),
        ({"gradient_checkpointing_ratio": -0.1}, ValueError, r"\[0, 1\]"),
        ({"gradient_checkpointing_ratio": True}, TypeError, "number"),
        ({"gradient_checkpointing_ratio": "0.5"}, TypeError, "number"),
        ({"num_ckpt_layers_per_stage": [1, -1]}, ValueError, r"ints >= 0.*\[1, -1\]"),
        ({"num_ckpt_layers_per_stage": []}, ValueError, "non-empty"),
        ({"num_ckpt_layers_per_stage": 3}, TypeError, "list of ints"),
        (
            {"num_ckpt_layers_per_stage": [1, 1, 1], "num_stages": 2, "num_model_chunks": 1},
            ValueError,
            "3 entries.*needs 2",
        ),
        (
            {"num_ckpt_layers_per_stage": [3, 3], "num_model_layers": 5},
            ValueError,
            "recomputes 6 layers, more than num_model_layers=5",
        ),
        (
            {
                "gradient_checkpointing_ratio": 0.5,
                "num_layers_per_stage": [2, 2],
                "num_model_layers": 5,
            },
            ValueError,
            "sums to 4, not num_model_layers=5",
        ),
        (
            {"num_ckpt_layers_per_stage": [2, 3], "num_layers_per_stage": [2, 2]},
            ValueError,
            r"exceeds .* at entries \[1\]",
        ),
        ({"gradient_checkpointing_ratio": 0.5, "num_stages": 0}, ValueError, "num_stages"),
    ],
)
def test_config_validation(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PipelineGradientCheckpointConfig(**kwargs)


def test_get_num_ckpt_layers_validation() -> None:
    explicit = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 2])
    with pytest.raises(ValueError, match="2 entries, the pipeline has 4 stages x 1 chunks = 4"):
        explicit.get_num_ckpt_layers(0, 4, 1)
    with pytest.raises(ValueError, match="stage must be an int >= 0 < 2, got 2"):
        explicit.get_num_ckpt_layers(2, 2, 1)
    with pytest.raises(ValueError, match="model_chunk_id"):
        explicit.get_num_ckpt_layers(0, 2, 1, 1)
    sized = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5, num_stages=4)
    with pytest.raises(ValueError, match="made for num_stages=4 but the pipeline has 2"):
        sized.get_num_ckpt_layers(0, 2, 1, num_layers=4)
    with pytest.raises(ValueError, match="needs a layer count"):
        PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5).get_num_ckpt_layers(
            0, 1, 1
        )
    with pytest.raises(TypeError, match="get_num_ckpt_layers"):
        ShardConfig(gradient_checkpoint_config=object())


# --------------------------------------------------------------------------- single process


def _llama(layers: int = 4, **overrides: Any) -> nn.Module:
    from _models import tiny_llama_config
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(layers, **overrides)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _gpt2(layers: int = 4, dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=layers,
        n_head=8,
        n_positions=64,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )  # use_cache stays True: GPT-2 hands the cache to each block positionally
    return GPT2LMHeadModel(config)


def _batch(seq_len: int = 8) -> dict[str, torch.Tensor]:
    from _models import causal_lm_batch

    return causal_lm_batch(VOCAB, batch_size=2, seq_len=seq_len, pad=True)


class _Counter:
    """Counts forward pre-hook calls on each layer's ``mlp``, per phase."""

    def __init__(self, layers: list[nn.Module]) -> None:
        self.phase = "forward"
        self.calls = {phase: [0] * len(layers) for phase in ("forward", "backward")}
        for i, layer in enumerate(layers):
            layer.mlp.register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.calls[self.phase][i] += 1

        return hook


def _layers(model: nn.Module) -> list[nn.Module]:
    from colossal.shardformer.shard.stack import find_layer_stack

    return list(find_layer_stack(model)[1])


def _run(model: nn.Module, batch: dict[str, torch.Tensor], seed: int, counter: Any = None) -> Any:
    """Two training steps' gradients (fresh grads each step, same seed for both models)."""
    grads = []
    for step in range(2):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed + step)
        if counter is not None:
            counter.phase = "forward"
        loss = model(**batch).loss
        if counter is not None:
            counter.phase = "backward"
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads


def _checkpointed(model: nn.Module, ckpt: PipelineGradientCheckpointConfig) -> nn.Module:
    config = ShardConfig(enable_tensor_parallelism=False, gradient_checkpoint_config=ckpt)
    model, _ = ShardFormer(config).optimize(model)
    return model


DROPOUT_RTOL = 1e-5
"""With SDPA's attention dropout the recomputed gradients may differ from the stored ones by
float rounding (~1e-7 relative; the CPU kernel's backward differs); a dropout mask that is
not replayed changes them by O(1)."""


def _assert_equal_grads(
    got: list[dict[str, torch.Tensor]], ref: list[dict[str, Any]], rtol: float = 0.0
) -> None:
    """Bit-equal gradients (``rtol=0``) or relative error ``<= rtol`` per parameter."""
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.keys() == r.keys()
        if rtol == 0.0:
            bad = [n for n in g if not torch.equal(g[n], r[n])]
        else:
            bad = [n for n in g if not relative_error(g[n], r[n]) <= rtol]
        assert not bad, f"step {step}: gradients differ from no checkpointing: {bad[:5]}"


@pytest.mark.parametrize(
    ("family", "ckpt", "expected", "dropout"),
    [
        ("llama", {"gradient_checkpointing_ratio": 0.5}, 2, 0.0),
        ("llama", {"num_ckpt_layers_per_stage": [3]}, 3, 0.1),
        ("gpt2", {"num_ckpt_layers_per_stage": [3]}, 3, 0.0),
        ("gpt2", {"gradient_checkpointing_ratio": 0.3}, 1, 0.1),
    ],
)
def test_first_layers_recompute_and_gradients_match(
    family: str, ckpt: dict[str, Any], expected: int, dropout: float
) -> None:
    """4 layers, N recomputed: exactly layers 0..N-1 run again in the backward; the gradients of
    two steps equal the no-checkpointing model's bit for bit (with dropout: same seed)."""
    torch.manual_seed(0)
    if family == "llama":
        ref = _llama(4, attention_dropout=dropout)
    else:
        ref = _gpt2(4, dropout=dropout)
    model = copy.deepcopy(ref)
    ref.train()
    model = _checkpointed(model, PipelineGradientCheckpointConfig(**ckpt))
    model.train()
    counter = _Counter(_layers(model))
    batch = _batch()
    got = _run(model, batch, seed=11, counter=counter)
    want = _run(ref, batch, seed=11)
    assert counter.calls["forward"] == [2] * 4  # two steps
    assert counter.calls["backward"] == [2] * expected + [0] * (4 - expected)
    _assert_equal_grads(got, want, rtol=DROPOUT_RTOL if dropout else 0.0)
    if dropout:  # the masks matter: a different seed gives other gradients
        other = _run(ref, batch, seed=12)
        assert max(relative_error(other[0][n], want[0][n]) for n in want[0]) > 1e-2
    # eval mode: each layer runs once, as without checkpointing
    model.eval()
    counter.calls["forward"] = [0] * 4
    counter.phase = "forward"
    model(**batch).loss.backward()
    assert counter.calls["forward"] == [1] * 4


def test_too_many_layers_refused() -> None:
    torch.manual_seed(0)
    model = _llama(2)
    with pytest.raises(ValueError, match="recompute 3 layers, but it holds 2"):
        _checkpointed(model, PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[3]))


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.drop(self.mlp(self.norm(x))) * scale


class _Plain(nn.Module):
    """Not a transformers model: its layers lack ``GradientCheckpointingLayer``."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=0.5)
        return self.head(h).sum()


def test_layer_without_transformers_mechanism() -> None:
    """The instance-level wrapper: layers 0 and 1 recomputed, names and gradients unchanged."""
    from colossal.shardformer.shard.grad_ckpt import apply_gradient_checkpointing

    torch.manual_seed(0)
    ref = _Plain()
    model = copy.deepcopy(ref)
    names = [n for n, _ in model.named_parameters()]
    config = ShardConfig(
        enable_tensor_parallelism=False,
        gradient_checkpoint_config=PipelineGradientCheckpointConfig(
            gradient_checkpointing_ratio=0.7
        ),
    )
    apply_gradient_checkpointing(model, config, 0)  # floor(0.7 * 3) = 2
    assert [n for n, _ in model.named_parameters()] == names
    counter = _Counter(list(model.layers))
    x = torch.randn(2, 5, 4)
    grads = []
    for net, c in ((model, counter), (ref, None)):
        torch.manual_seed(3)
        if c is not None:
            c.phase = "forward"
        out = net(x)
        if c is not None:
            c.phase = "backward"
        out.backward()
        grads.append([{n: p.grad.clone() for n, p in net.named_parameters()}])
    assert counter.calls == {"forward": [1, 1, 1], "backward": [1, 1, 0]}
    _assert_equal_grads(grads[0], grads[1])
    copied = copy.deepcopy(model)  # the wrapper follows the copy, not the original
    assert copied.layers[0].forward.layer is copied.layers[0]


# ------------------------------------------------------------------------------ TP = 2


def _one_f_one_b(
    model: nn.Module, batches: list[dict[str, torch.Tensor]], seed: int, counter: Any = None
) -> list[dict[str, torch.Tensor]]:
    """Gradients accumulated over 3 microbatches run in 1F1B order: F0 F1 B0 F2 B1 B2."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    losses: dict[int, torch.Tensor] = {}
    for kind, i in (("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("b", 2)):
        if counter is not None:
            counter.phase = "forward" if kind == "f" else "backward"
        if kind == "f":
            losses[i] = model(**batches[i]).loss
        else:
            losses.pop(i).backward()
    return [{n: p.grad.clone() for n, p in model.named_parameters()}]


def _tensor_parallel_seeded_dropout() -> None:
    """GPT-2 with TP 2 and dropout 0.1 (seeded dropouts with private generators inside the
    layers), 3 microbatches in 1F1B order: the checkpointed model's local gradients equal the
    non-checkpointed sharded model's. Catches generators not replayed in the recompute (B0's
    masks differ) and not put back after it (F2 would draw F1's masks again)."""
    from colossal.shardformer.layer.dropout import DropoutForParallelInput

    batches = [_batch() for _ in range(3)]
    models = []
    for ckpt in (None, PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[2])):
        torch.manual_seed(0)
        model = _gpt2(3, dropout=0.1)
        torch.manual_seed(5)  # the seeded dropouts draw their seeds while sharding
        model, _ = ShardFormer(ShardConfig(gradient_checkpoint_config=ckpt)).optimize(model)
        model.train()
        models.append(model)
    ref, model = models
    assert any(isinstance(m, DropoutForParallelInput) for m in model.transformer.h[0].modules())
    counter = _Counter(_layers(model))
    got = _one_f_one_b(model, batches, seed=21, counter=counter)
    want = _one_f_one_b(ref, batches, seed=21)
    assert counter.calls == {"forward": [3, 3, 3], "backward": [3, 3, 0]}
    _assert_equal_grads(got, want, rtol=DROPOUT_RTOL)


def _pipeline_1f1b(world_size: int) -> None:
    """PP 2 with colossal-pipeline's 1F1B (2 microbatches, 2 steps), 4 layers, 2 per stage,
    ``num_ckpt_layers_per_stage=[1, 2]``: stage 0 recomputes its first layer only, stage 1
    both; the held gradients equal the same pipeline without checkpointing (GPT-2 with dropout
    0.1: the global RNG is replayed across the interleaved microbatches). Catches a count
    looked up for the wrong stage, the last held layers recomputed instead of the first."""
    from _models import causal_lm_batch

    from colossal.core import ProcessGroupMesh
    from colossal.pipeline import OneForwardOneBackwardSchedule, PipelineStageManager

    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    batch = causal_lm_batch(VOCAB, batch_size=4, seq_len=8, pad=False)
    ckpt = PipelineGradientCheckpointConfig(
        num_ckpt_layers_per_stage=[1, 2], num_stages=2, num_model_chunks=1, num_model_layers=4
    )
    for family, dropout in (("llama", 0.0), ("gpt2", 0.1)):
        runs = []
        for config_ckpt in (None, ckpt):
            torch.manual_seed(0)
            model = _llama(4) if family == "llama" else _gpt2(4, dropout=dropout)
            sm = PipelineStageManager(mesh, "pp")
            config = ShardConfig(
                pipeline_stage_manager=sm,
                enable_tensor_parallelism=False,
                gradient_checkpoint_config=config_ckpt,
            )
            chunk, shared = ShardFormer(config).optimize(model)
            chunk.train()
            counter = _Counter(_layers(chunk))
            schedule = OneForwardOneBackwardSchedule(sm, num_microbatches=2, shared_params=shared)
            grads = []
            for step in range(2):
                chunk.zero_grad(set_to_none=True)
                torch.manual_seed(31 + step)
                schedule.forward_backward_step(chunk, iter([batch]), criterion=lambda o, mb: o.loss)
                grads.append({n: p.grad.clone() for n, p in chunk.named_parameters()})
            runs.append((grads, counter.calls["forward"]))
        (want, plain_calls), (got, calls) = runs
        assert plain_calls == [4, 4], (family, plain_calls)  # 2 microbatches x 2 steps
        expected = [8, 4] if sm.stage == 0 else [8, 8]  # + the recomputes
        assert calls == expected, (family, sm.stage, calls)
        _assert_equal_grads(got, want, rtol=DROPOUT_RTOL if dropout else 0.0)


@distributed_test(2)
def test_tensor_parallel_and_pipeline(rank: int, world_size: int) -> None:
    """One spawn (CI budget): TP 2 with seeded dropouts, then PP 2 with 1F1B."""
    _tensor_parallel_seeded_dropout()
    _pipeline_1f1b(world_size)
