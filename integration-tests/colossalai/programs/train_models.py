"""Tiny GPT-2, Llama and ViT training the way ColossalAI's examples write it (run under
torchrun: ``colossalai.launch_from_torch()``).

- GPT-2 sequence classification with HybridParallelPlugin (tensor parallel 2) and a warm-up
  LR scheduler (examples/language/gpt/hybridparallelism/finetune.py);
- Llama causal LM with HybridParallelPlugin (pipeline parallel 2, 1F1B over 2 micro-batches)
  through ``booster.execute_pipeline`` (examples/language/llama, its benchmark);
- ViT image classification with GeminiPlugin and ``plugin.prepare_dataloader``
  (examples/images/vit/vit_train_demo.py).

Each trains on a small fixed data set; its loss must fall below ``RATIO`` of the first one
(a run whose updates do nothing stays within a few percent of where it started).
"""

import colossalai
import torch
import torch.distributed as dist
from colossalai.accelerator import get_accelerator
from colossalai.booster import Booster
from colossalai.booster.plugin import GeminiPlugin, HybridParallelPlugin
from colossalai.cluster import DistCoordinator
from colossalai.logging import get_dist_logger
from colossalai.nn.lr_scheduler import LinearWarmupLR
from colossalai.nn.optimizer import HybridAdam
from torch.utils.data import TensorDataset
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

RATIO = 0.7
STEPS = 8


def check_learns(name: str, losses: list) -> None:
    logger = get_dist_logger()
    logger.info(f"{name}: losses {[round(x, 4) for x in losses]}", ranks=[0])
    assert losses[-1] < RATIO * losses[0], f"{name} did not learn: {losses}"


def train_gpt2(coordinator: DistCoordinator) -> None:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4, num_labels=2,
        pad_token_id=0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2ForSequenceClassification(config)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=0, precision="fp32")
    optimizer = HybridAdam(model.parameters(), lr=3e-3)
    lr_scheduler = LinearWarmupLR(optimizer, total_steps=STEPS, warmup_steps=2)
    booster = Booster(plugin=plugin)

    def _criterion(outputs, inputs):
        return outputs.loss

    model, optimizer, _criterion, _, lr_scheduler = booster.boost(
        model, optimizer, criterion=_criterion, lr_scheduler=lr_scheduler
    )
    ids = torch.randint(1, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    labels = (ids[:, 0] > 64).long()  # the first token decides the label
    device = get_accelerator().get_current_device()
    batch = {"input_ids": ids.to(device), "labels": labels.to(device)}
    losses = []
    for _ in range(STEPS):
        outputs = model(**batch)
        loss = _criterion(outputs, None)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        lr_scheduler.step()
        losses.append(loss.item())
    check_learns("GPT-2 (HybridParallelPlugin tp_size=2)", losses)


def train_llama(coordinator: DistCoordinator) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, num_microbatches=2, zero_stage=0, precision="fp32"
    )
    optimizer = HybridAdam(model.parameters(), lr=3e-3)
    booster = Booster(plugin=plugin)
    model, optimizer, _, _, _ = booster.boost(model, optimizer)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    losses = []
    for _ in range(STEPS):
        outputs = booster.execute_pipeline(
            iter([batch]), model, lambda outputs, inputs: outputs.loss, optimizer,
            return_loss=True,
        )  # fmt: skip
        optimizer.step()
        optimizer.zero_grad()
        loss = outputs["loss"]
        if loss is None:  # only the last stage has it: share it with every rank
            loss = torch.zeros(())
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item())
    check_learns("Llama (HybridParallelPlugin pp_size=2)", losses)


def train_vit(coordinator: DistCoordinator) -> None:
    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=2,
    )  # fmt: skip
    model = ViTForImageClassification(config)
    generator = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 2, (32,), generator=generator)
    images = 0.5 * torch.randn(32, 3, 16, 16, generator=generator)
    images += (2.0 * labels - 1.0).view(-1, 1, 1, 1)  # bright or dark images
    plugin = GeminiPlugin(precision="fp32", placement_policy="static")
    dataloader = plugin.prepare_dataloader(
        TensorDataset(images, labels), batch_size=8, shuffle=True, drop_last=True
    )
    optimizer = HybridAdam(model.parameters(), lr=3e-3)
    booster = Booster(plugin=plugin)
    model, optimizer, _, dataloader, _ = booster.boost(model, optimizer, dataloader=dataloader)
    epoch_losses = []
    for epoch in range(6):
        dataloader.sampler.set_epoch(epoch)
        total = 0.0
        for pixel_values, target in dataloader:
            loss = model(pixel_values=pixel_values, labels=target).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        mean = torch.tensor(total / len(dataloader))
        dist.all_reduce(mean)  # the mean over both ranks' halves of the data
        epoch_losses.append(mean.item() / dist.get_world_size())
    check_learns("ViT (GeminiPlugin)", epoch_losses)


def main() -> None:
    colossalai.launch_from_torch(backend="gloo")
    torch.set_num_threads(1)
    coordinator = DistCoordinator()
    train_gpt2(coordinator)
    train_llama(coordinator)
    train_vit(coordinator)
    coordinator.print_on_master("train_models: OK")


if __name__ == "__main__":
    main()
