"""ResNet-18 image classification with the Booster: the seeds' Booster API page, runnable.

The seeds' "Booster API" page builds ``resnet18()``, boosts it with a plugin and trains it
on CIFAR-10 (ColossalAI's ``examples/tutorial/new_api/cifar_resnet``). Here, offline and on
CPU:

- the model is torchvision's ResNet-18 layout (``BasicBlock`` x [2, 2, 2, 2]) written in
  ``examples/legacy/stand_ins/resnet.py`` (torchvision's wheel does not load against the CPU
  torch build), with a configurable first width (``--width``, torchvision: 64);
- the data is CIFAR-like: scikit-learn's bundled digits upscaled to 32x32 RGB, 10 classes;
- every plugin of the page: ``torch_ddp``, ``torch_ddp_fp16`` (the Booster's fp16 mixed
  precision), ``low_level_zero`` (ZeRO-2), ``gemini``, and ``torch_fsdp`` (FSDP2).
  ``HybridParallelPlugin`` is for transformer models (Shardformer policies) and has no
  ResNet policy; it is not offered.

Each epoch prints its mean training loss, the held-out accuracy (reduced over the ranks) and
its throughput. ``--checkpoint DIR`` saves the model (sharded safetensors), the optimizer and
the scheduler every ``--interval`` epochs; ``--resume N`` continues from the checkpoint of
epoch N (under any plugin and world size: the one checkpoint format).

    torchrun --nproc_per_node 2 examples/resnet/train.py --plugin low_level_zero
    colossal run --nproc_per_node 2 examples/resnet/train.py --plugin gemini --epochs 4
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "legacy"))

from stand_ins.digits import NUM_CLASSES, digits_datasets  # noqa: E402
from stand_ins.resnet import BasicBlock, ResNet  # noqa: E402

from colossal.booster import Booster  # noqa: E402
from colossal.booster.plugin import (  # noqa: E402
    GeminiPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from colossal.core import launch_from_torch  # noqa: E402
from colossal.kernels import HybridAdam  # noqa: E402

PLUGINS = ["torch_ddp", "torch_ddp_fp16", "low_level_zero", "gemini", "torch_fsdp"]


def resnet18(num_classes: int, width: int) -> ResNet:
    """torchvision's ``resnet18`` layout with ``width`` channels in the first stage."""
    return ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes, base_width=width)


def make_booster(plugin: str) -> Booster:
    """The page's plugins by their names in ColossalAI's example."""
    if plugin == "torch_ddp":
        return Booster(plugin=TorchDDPPlugin())
    if plugin == "torch_ddp_fp16":
        return Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16")
    if plugin == "low_level_zero":
        return Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32"))
    if plugin == "gemini":
        return Booster(plugin=GeminiPlugin(placement_policy="static", precision="fp32"))
    return Booster(plugin=TorchFSDPPlugin())


def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader) -> float:
    """Held-out accuracy, counted over every rank's part."""
    model.eval()
    counts = torch.zeros(2)
    with torch.no_grad():
        for images, labels in loader:
            counts[0] += (model(images).argmax(-1) == labels).sum()
            counts[1] += labels.numel()
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-p", "--plugin", choices=PLUGINS, default="torch_ddp")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--width", type=int, default=16, help="first stage's channels (torchvision 64)")
    p.add_argument("--image-size", type=int, default=32, help="CIFAR: 32")
    p.add_argument("--max-steps", type=int, default=None, help="steps per epoch (default all)")
    p.add_argument("-c", "--checkpoint", default=None, help="directory for the checkpoints")
    p.add_argument("-i", "--interval", type=int, default=1, help="save every N epochs")
    p.add_argument("-r", "--resume", type=int, default=-1, help="continue from epoch N's save")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "width", "interval", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.resume >= 0 and args.checkpoint is None:
        p.error(f"--resume {args.resume} needs --checkpoint DIR (where epoch {args.resume} "
                "was saved)")
    return args


def main(argv: list[str] | None = None) -> None:
    """Train, evaluate and checkpoint as the page does."""
    args = parse(argv)
    torch.set_num_threads(args.threads)
    launch_from_torch(backend="gloo", seed=42, verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    booster = make_booster(args.plugin)
    train_set, test_set = digits_datasets(image_size=args.image_size, channels=3)
    train_loader = booster.plugin.prepare_dataloader(train_set, args.batch_size, shuffle=True,
                                                     drop_last=True)
    test_loader = booster.plugin.prepare_dataloader(test_set, args.batch_size)
    model = resnet18(NUM_CLASSES, args.width)
    optimizer = HybridAdam(model.parameters(), lr=args.lr, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(
        optimizer, milestones=[args.epochs // 2, args.epochs * 3 // 4], gamma=0.1)
    model, optimizer, criterion, _, scheduler = booster.boost(
        model, optimizer, nn.CrossEntropyLoss(), lr_scheduler=scheduler)
    start_epoch = 0
    if args.resume >= 0:
        path = os.path.join(args.checkpoint, f"epoch{args.resume}")
        booster.load_model(model, os.path.join(path, "model"))
        booster.load_optimizer(optimizer, os.path.join(path, "optimizer"))
        booster.load_lr_scheduler(scheduler, os.path.join(path, "scheduler.pt"))
        start_epoch = args.resume + 1
        if rank == 0:
            print(f"resumed from {path}", flush=True)
    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)
        total, steps, seen = 0.0, 0, 0
        start = time.perf_counter()
        for images, labels in train_loader:
            loss = criterion(model(images), labels)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
            steps += 1
            seen += labels.numel() * world
            if args.max_steps is not None and steps >= args.max_steps:
                break
        scheduler.step()
        elapsed = time.perf_counter() - start
        accuracy = evaluate(model, test_loader)
        if rank == 0:
            print(f"Epoch {epoch}: loss {total / steps:.4f}, accuracy {accuracy:.4f}, "
                  f"{seen / elapsed:.0f} images/s", flush=True)
        if args.checkpoint is not None and (epoch + 1) % args.interval == 0:
            path = os.path.join(args.checkpoint, f"epoch{epoch}")
            booster.save_model(model, os.path.join(path, "model"), shard=True)
            booster.save_optimizer(optimizer, os.path.join(path, "optimizer"), shard=True)
            booster.save_lr_scheduler(scheduler, os.path.join(path, "scheduler.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
