"""ColossalStrategy (lightning.Trainer on a Colossal plugin) against Lightning's DDPStrategy.

Both run the same LightningModule (a tiny GPT-2 from a config) on two gloo ranks with gradient
accumulation 2 and ``gradient_clip_val`` small enough to clip every step. The mean loss over
the ranks of every micro-batch must agree at fp32 precision (2e-5 relative) under ZeRO-2,
Gemini and tensor parallelism (TP 2: one data-parallel rank reading batches of 4, the same
samples the two DDP ranks read as 2 + 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from hf_testlib import assert_curve, tiny_gpt2, token_data
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.utils.data import DataLoader

from colossal.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin
from colossal.core.testing import distributed_test
from colossal.integrations import ColossalStrategy
from colossal.integrations.lightning_strategy import STATE_FILE

RTOL = 2e-5


class TinyLM(pl.LightningModule):
    """A GPT-2 language model; records the loss of every micro-batch."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.model = tiny_gpt2()
        self.batch_size = batch_size
        self.losses: list[torch.Tensor] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch["input_ids"], batch["labels"])
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self) -> object:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - 0.1 * step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_data(), batch_size=self.batch_size, shuffle=True)


def _fit(
    strategy: Strategy,
    batch_size: int,
    out: str,
    max_steps: int = 4,
    ckpt_path: str | None = None,
    **kw: object,
) -> TinyLM:
    torch.manual_seed(0)
    module = TinyLM(batch_size)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
        gradient_clip_val=0.3, num_sanity_val_steps=0, default_root_dir=out,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


def _mean_losses(module: TinyLM) -> list[float]:
    losses = torch.stack(module.losses)
    dist.all_reduce(losses)
    return (losses / dist.get_world_size()).tolist()


@distributed_test(2)
def test_losses_equal_ddp_strategy(rank: int, world_size: int, tmp_path: Path) -> None:
    """Every plugin's per-micro-batch losses equal DDPStrategy's; value clipping is refused.

    Catches: backward outside the booster (Gemini: no gradients; ZeRO: nothing reduced),
    ``optimizer.step(closure)`` refused or the closure run twice, clipping skipped or by the
    local norm (loss from micro-batch 7 off by ~1e-4), the sampler split over the world
    instead of the data-parallel ranks (TP peers on different batches), the schedule not
    driving the boosted optimizer.
    """
    out = str(tmp_path)
    want = _mean_losses(_fit(DDPStrategy(process_group_backend="gloo"), 2, f"{out}/ddp"))
    assert len(want) == 8 and want[-1] < want[0], want
    cases = {
        "zero2": (LowLevelZeroPlugin(stage=2, precision="fp32"), 2),
        "gemini": (GeminiPlugin(precision="fp32", enable_gradient_accumulation=True), 2),
        "tp2": (HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"), 4),
    }
    for name, (plugin, batch) in cases.items():
        # TP shards a Hugging Face model: boost the module's `model` attribute
        attribute = "model" if name == "tp2" else None
        strategy = ColossalStrategy(plugin=plugin, module_attribute=attribute)
        got = _mean_losses(_fit(strategy, batch, f"{out}/{name}"))
        assert_curve(got, want, RTOL, f"{name} loss")
    with pytest.raises(ValueError, match="gradient_clip_algorithm='norm'"):
        _fit(
            ColossalStrategy(plugin=LowLevelZeroPlugin(stage=2, precision="fp32")), 2,
            f"{out}/value", gradient_clip_algorithm="value",
        )  # fmt: skip
    with pytest.raises(ValueError, match="pp_size=2"):
        ColossalStrategy(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32"))


@distributed_test(2)
def test_checkpoint_resume_matches_ddp_resume(rank: int, world_size: int, tmp_path: Path) -> None:
    """A ModelCheckpoint directory from the end of epoch 0 resumes as DDPStrategy's file does.

    Epoch 0 is 4 steps (8 micro-batches); each run saves at its end and goes on to step 6, then
    a new fit resumes from the checkpoint. The resumed losses must equal DDPStrategy's resumed
    losses (Lightning's loop decides where accumulation restarts; both strategies share it),
    and the first resumed loss must equal the uninterrupted run's first loss of epoch 1.
    Catches: weights or optimizer moments not restored into the boosted objects (first or
    later resumed losses differ), the scheduler or loop state lost, a checkpoint written by
    rank 0 alone (ZeRO shards of rank 1 missing: the save hangs or the load fails).
    """
    out = str(tmp_path)
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for name in ("ddp", "zero2"):

        def strategy(name: str = name) -> Strategy:
            if name == "ddp":
                return DDPStrategy(process_group_backend="gloo")
            return ColossalStrategy(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))

        saver = ModelCheckpoint(
            dirpath=f"{out}/{name}/ckpt", every_n_epochs=1, save_top_k=-1,
            save_on_train_epoch_end=True,
        )  # fmt: skip
        run = _mean_losses(_fit(strategy(), 2, f"{out}/{name}/run", 6, callbacks=[saver]))
        saved = sorted(os.listdir(f"{out}/{name}/ckpt"))
        assert len(run) == 12 and saved and saved[0].startswith("epoch=0"), (run, saved)
        ckpt = os.path.join(out, name, "ckpt", saved[0])
        if name == "zero2":
            assert os.path.isfile(os.path.join(ckpt, STATE_FILE))
            assert os.path.isfile(os.path.join(ckpt, "model.safetensors.index.json"))
        resumed = _mean_losses(_fit(strategy(), 2, f"{out}/{name}/resumed", 6, ckpt_path=ckpt))
        curves[name] = (run, resumed)
    (want_run, want_resumed), (run, resumed) = curves["ddp"], curves["zero2"]
    assert_curve(run, want_run, RTOL, "uninterrupted run")
    assert_curve(resumed, want_resumed, RTOL, "resumed run")
    assert_curve(resumed[:1], run[8:9], RTOL, "first loss of epoch 1")
