"""ColossalTrainer (Hugging Face Trainer on a Colossal plugin) against the plain Trainer.

The reference is the same ``Trainer`` on the same two gloo ranks, distributed by Accelerate
(DDP), with the same arguments: gradient accumulation 2, ``max_grad_norm`` small enough to clip
every step, a linear schedule. The losses of every step, the logged gradient norms and the
evaluation loss must agree at fp32 precision (2e-5 relative; an unclipped step moves the
loss by ~5e-5, a wrong gradient by >1e-3), under ZeRO-1, ZeRO-2, Gemini, tensor parallelism
(dp 1, both ranks on the same batches), TorchDDPPlugin and TorchFSDPPlugin (FSDP2).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hf_testlib import (
    assert_curve,
    grad_norms,
    step_losses,
    tiny_gpt2,
    token_data,
    training_args,
)
from transformers import GPT2LMHeadModel, Trainer

from colossal.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from colossal.core.testing import distributed_test
from colossal.integrations import ColossalTrainer

RTOL = 2e-5
COMMON = dict(gradient_accumulation_steps=2, max_grad_norm=0.3)


def _plugins() -> dict[str, tuple[Plugin, int]]:
    """Plugin and per-rank batch: TP 2 has one data-parallel rank, so it reads the reference's
    global batch (2 ranks x 2) as one batch of 4 (the same samples: Accelerate deals the
    sampler's batches of 2 out to the ranks in order)."""
    return {
        "zero1": (LowLevelZeroPlugin(stage=1, precision="fp32"), 2),
        "zero2": (LowLevelZeroPlugin(stage=2, precision="fp32"), 2),
        "gemini": (GeminiPlugin(precision="fp32", enable_gradient_accumulation=True), 2),
        "tp2": (HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"), 4),
        "ddp": (TorchDDPPlugin(), 2),
        "fsdp": (TorchFSDPPlugin(precision="fp32"), 2),
    }


@distributed_test(2)
def test_plugins_match_ddp_trainer(rank: int, world_size: int, tmp_path: Path) -> None:
    """Every plugin's loss curve, grad norms and eval loss equal the DDP Trainer's.

    Catches: backward not through the booster (Gemini gets no gradients), clipping skipped
    or by a local instead of the global norm (loss from step 4, logged norms), the loss
    double-scaled or unscaled for accumulation, TP peers reading different batches (dp split
    over the world) or counted twice in the token normalisation, evaluation of the unboosted
    module, the scheduler not driving the wrapped optimizer's learning rate.
    """
    out = str(tmp_path)
    evaluation = token_data(16, seed=7)
    ref = Trainer(
        model=tiny_gpt2(), args=training_args(f"{out}/ref", **COMMON),
        train_dataset=token_data(), eval_dataset=evaluation,
    )  # fmt: skip
    ref.train()
    want_loss, want_norm = step_losses(ref), grad_norms(ref)
    want_eval = ref.evaluate()["eval_loss"]
    assert want_loss[-1] < want_loss[0] - 0.05, f"reference does not learn: {want_loss}"
    assert all(n > COMMON["max_grad_norm"] for n in want_norm), f"no clipping: {want_norm}"
    for name, (plugin, batch) in _plugins().items():
        args = training_args(f"{out}/{name}", per_device_train_batch_size=batch, **COMMON)
        trainer = ColossalTrainer(
            model=tiny_gpt2(), args=args,
            train_dataset=token_data(), eval_dataset=evaluation, plugin=plugin,
        )  # fmt: skip
        trainer.train()
        assert_curve(step_losses(trainer), want_loss, RTOL, f"{name} loss")
        assert_curve(grad_norms(trainer), want_norm, 1e-4, f"{name} grad norm")
        got_eval = trainer.evaluate()["eval_loss"]
        assert math.isclose(got_eval, want_eval, rel_tol=RTOL), f"{name} eval {got_eval}"


@distributed_test(2)
def test_bf16_and_refusals(rank: int, world_size: int, tmp_path: Path) -> None:
    """bf16 through the plugin follows the fp32 curve loosely; bad set-ups are refused.

    Catches: TrainingArguments(bf16=True) ignored or autocast on top of the plugin's cast
    (curve off by more than bf16 rounding), a precision mismatch, pipeline parallelism or
    Gemini accumulation without its flag accepted silently (wrong gradients later).
    """
    out = str(tmp_path)
    ref = Trainer(model=tiny_gpt2(), args=training_args(f"{out}/ref"), train_dataset=token_data())
    ref.train()
    bf16 = ColossalTrainer(
        model=tiny_gpt2(), args=training_args(f"{out}/bf16", bf16=True),
        train_dataset=token_data(), plugin=LowLevelZeroPlugin(stage=2, precision="bf16"),
    )  # fmt: skip
    bf16.train()
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    assert_curve(step_losses(bf16), step_losses(ref), 2e-2, "bf16 loss")
    with pytest.raises(ValueError, match="precision='bf16' on the plugin"):
        ColossalTrainer(
            model=tiny_gpt2(), args=training_args(f"{out}/x", bf16=True),
            plugin=LowLevelZeroPlugin(stage=2, precision="fp32"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="pp_size=2"):
        ColossalTrainer(
            model=tiny_gpt2(), args=training_args(f"{out}/x"),
            plugin=HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32"),
        )  # fmt: skip
    with pytest.raises(ValueError, match="enable_gradient_accumulation=True"):
        ColossalTrainer(
            model=tiny_gpt2(), args=training_args(f"{out}/x", gradient_accumulation_steps=2),
            plugin=GeminiPlugin(precision="fp32"),
        )  # fmt: skip
    with pytest.raises(TypeError, match="colossal.booster.plugin.Plugin"):
        ColossalTrainer(model=tiny_gpt2(), args=training_args(f"{out}/x"), plugin="zero")  # type: ignore[arg-type]


@distributed_test(2)
def test_save_steps_and_resume_continue_the_curve(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    """``save_steps`` writes our format plus the Trainer's files; resuming continues the curve.

    The run saves at step 3 of 6; a new trainer resumed from ``checkpoint-3`` (under ZeRO-2,
    and under Gemini reading ZeRO's checkpoint) must log steps 4-6 exactly as the run did.
    Catches: optimizer moments or the schedule not restored (steps 4-6 differ), weights loaded
    before boosting and lost, the checkpoint not loadable by ``from_pretrained``, the Trainer's
    own state (``trainer_state.json``, RNG) missing, so the data position is wrong.
    """
    out = str(tmp_path)
    save = dict(max_steps=6, save_strategy="steps", save_steps=3, **COMMON)
    first = ColossalTrainer(
        model=tiny_gpt2(), args=training_args(f"{out}/run", **save), train_dataset=token_data(),
        plugin=LowLevelZeroPlugin(stage=2, precision="fp32"),
    )  # fmt: skip
    first.train()
    curve = step_losses(first)
    ckpt = os.path.join(out, "run", "checkpoint-3")
    names = set(os.listdir(ckpt))
    for expected in ("model.safetensors.index.json", "config.json", "lr_scheduler.json",
                     "optimizer.safetensors.index.json", "trainer_state.json",
                     "training_args.bin", f"rng_state_{rank}.pth"):  # fmt: skip
        assert expected in names, f"{expected} missing from {sorted(names)}"
    if rank == 0:
        loaded = GPT2LMHeadModel.from_pretrained(ckpt)
        assert loaded.lm_head.weight.shape == (64, 16)
    plugins: dict[str, Plugin] = {
        "zero2": LowLevelZeroPlugin(stage=2, precision="fp32"),
        "gemini": GeminiPlugin(precision="fp32", enable_gradient_accumulation=True),
    }
    for name, plugin in plugins.items():
        resumed = ColossalTrainer(
            model=tiny_gpt2(), args=training_args(f"{out}/{name}", **save),
            train_dataset=token_data(), plugin=plugin,
        )  # fmt: skip
        resumed.train(resume_from_checkpoint=ckpt)
        # log_history comes back from trainer_state.json: steps 1-3 restored, 4-6 trained again
        assert_curve(step_losses(resumed), curve, RTOL, f"resumed under {name}")
        assert resumed.state.global_step == 6


@distributed_test(1)
def test_one_process_matches_plain_trainer(rank: int, world_size: int, tmp_path: Path) -> None:
    """At world size 1 ZeRO-2 and Gemini give the plain single-process Trainer's curve.

    Catches: a dataloader or loss normalisation that assumes several ranks (a world of one
    divides by the wrong count), accumulation or clipping that only works when gradients are
    reduced.
    """
    out = str(tmp_path)
    ref = Trainer(
        model=tiny_gpt2(), args=training_args(f"{out}/ref", **COMMON), train_dataset=token_data()
    )
    ref.train()
    plugins: dict[str, Plugin] = {
        "zero2": LowLevelZeroPlugin(stage=2, precision="fp32"),
        "gemini": GeminiPlugin(precision="fp32", enable_gradient_accumulation=True),
    }
    for name, plugin in plugins.items():
        trainer = ColossalTrainer(
            model=tiny_gpt2(), args=training_args(f"{out}/{name}", **COMMON),
            train_dataset=token_data(), plugin=plugin,
        )  # fmt: skip
        trainer.train()
        assert_curve(step_losses(trainer), step_losses(ref), RTOL, f"{name} at world 1")
