"""Train a small ViT on scikit-learn's digits with the Colossal Booster (DDP to TP x PP).

The ColossalAI tutorial "Step By Step: Accelerate ViT Training With Colossal-AI", offline and
on CPU: ``transformers.ViTForImageClassification`` built from a ``ViTConfig`` (no weights are
downloaded) learns the 1,797 8x8 digit images bundled with scikit-learn (a fixed, stratified
20% held out). Run it with ``colossal run`` or ``torchrun``::

    colossal run --nproc_per_node 1 examples/vit/train_vit.py --plugin ddp
    colossal run --nproc_per_node 2 examples/vit/train_vit.py --plugin zero1
    colossal run --nproc_per_node 2 examples/vit/train_vit.py --plugin gemini
    colossal run --nproc_per_node 4 examples/vit/train_vit.py --plugin hybrid_parallel \\
        --tp 2 --pp 2 --num-microbatches 2

``--plugin``: ``ddp`` (``TorchDDPPlugin``; ``--precision`` through the Booster's mixed
precision), ``zero1`` (``LowLevelZeroPlugin(stage=1)``), ``gemini`` (``GeminiPlugin``, static
placement, small chunks: every chunk sharded, nothing offloaded) or ``hybrid_parallel``
(``HybridParallelPlugin``: ``--tp`` tensor-parallel ranks, ``--pp`` pipeline stages with
``--num-microbatches``, ``--zero-stage``; the data-parallel size is what is left of the world).
``--batch-size`` is the global batch: each data-parallel replica takes its share of every
batch (``plugin.prepare_dataloader``), so every layout sees the same batches in the same
order. Under a pipeline each step is ``booster.execute_pipeline`` (the loss exists on the
last stage only); held-out evaluation runs a forward-only pipeline (see ``heldout.py``).

Rank 0 prints the held-out accuracy after every epoch and writes ``--out``/``metrics.json``
and ``--out``/``curves.png`` (loss and accuracy per epoch).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from data import IMAGE_SIZE, NUM_CLASSES, load_digits_split
from heldout import evaluate, is_reporter
from report import plot_curves, write_metrics
from torch.nn import functional as F  # noqa: N812

from colossal.booster import Booster
from colossal.core import destroy, launch_from_torch

PLUGINS = ("ddp", "zero1", "gemini", "hybrid_parallel")
GEMINI_CHUNK = 2**15
"""Gemini's chunk size in elements (the model has ~136k parameters: a few chunks)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plugin", choices=PLUGINS, default="ddp")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (hybrid_parallel)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (hybrid_parallel)")
    p.add_argument("--num-microbatches", type=int, default=2, help="per batch, with --pp > 1")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0,
                   help="hybrid_parallel's ZeRO stage (2 cannot run with --pp > 1)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (images)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--label-smoothing", type=float, default=0.1, help="of the training loss")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the steps warming up")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=2)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "colossal_train_vit"),
                   help="directory of metrics.json and curves.png")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.plugin != "hybrid_parallel" and (args.tp, args.pp) != (1, 1):
        p.error(f"--tp {args.tp} --pp {args.pp}: only --plugin hybrid_parallel splits the model")
    for name in ("tp", "pp", "num_microbatches", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    """A ``ViTForImageClassification`` for 8x8 one-channel images, from a config."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=IMAGE_SIZE,
        patch_size=args.patch_size,
        num_channels=1,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=2 * args.hidden_size,
        num_labels=NUM_CLASSES,
    )
    torch.manual_seed(args.seed)  # the same weights on every rank, whatever the layout
    return ViTForImageClassification(config)


def make_booster(args: argparse.Namespace) -> Booster:
    """The Booster with the plugin ``--plugin`` names."""
    from colossal.booster.plugin import (
        GeminiPlugin,
        HybridParallelPlugin,
        LowLevelZeroPlugin,
        TorchDDPPlugin,
    )

    if args.plugin == "ddp":
        mixed = None if args.precision == "fp32" else args.precision
        return Booster(plugin=TorchDDPPlugin(), mixed_precision=mixed)
    if args.plugin == "zero1":
        return Booster(plugin=LowLevelZeroPlugin(stage=1, precision=args.precision))
    if args.plugin == "gemini":
        return Booster(plugin=GeminiPlugin(
            precision=args.precision,
            placement_policy="static",
            chunk_config_dict={"chunk_size": GEMINI_CHUNK, "keep_gathered": False},
        ))
    return Booster(plugin=HybridParallelPlugin(
        tp_size=args.tp,
        pp_size=args.pp,
        num_microbatches=args.num_microbatches if args.pp > 1 else None,
        precision=args.precision,
        zero_stage=args.zero_stage,
    ))


def make_criterion(label_smoothing: float):
    """``criterion(outputs, batch)``: the label-smoothed cross-entropy of the fp32 logits.

    Under a pipeline the schedule calls it on the last stage with each microbatch.
    """

    def criterion(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = outputs.logits.float()
        return F.cross_entropy(logits, batch["labels"], label_smoothing=label_smoothing)

    return criterion


def warmup_cosine(total: int, warmup: float):
    """LambdaLR factor: linear warm-up over ``warmup`` of the steps, then cosine to zero."""
    warm = max(1, int(warmup * total))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

    return factor


def train_step(
    booster: Booster, model: Any, optimizer: Any, criterion: Any, batch: dict
) -> float | None:
    """One optimizer step on ``batch``; the loss where this rank has it, else None."""
    if booster.plugin.support_pipeline():
        out = booster.execute_pipeline(
            iter([batch]), model, criterion, optimizer, return_loss=True
        )
        loss = out["loss"]
    else:
        loss = criterion(model(pixel_values=batch["pixel_values"]), batch)
        booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return None if loss is None else loss.item()


def mean_over_reporters(total: float, count: int) -> float:
    """The mean of the values the reporting ranks summed (one all-reduce, every rank joins)."""
    t = torch.tensor([total, count], dtype=torch.float64)
    dist.all_reduce(t)
    return (t[0] / t[1]).item() if t[1] > 0 else float("nan")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    started = time.time()
    args = parse_args(argv)
    launch_from_torch(seed=args.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # a tiny model: intra-op threads only contend for the cores
    booster = make_booster(args)
    plugin = booster.plugin
    dp = plugin.world_size  # the data-parallel size of every plugin (DPPluginBase)
    per_replica, rest = divmod(args.batch_size, dp)
    if rest or (args.pp > 1 and per_replica % args.num_microbatches):
        micro = args.num_microbatches if args.pp > 1 else 1
        raise SystemExit(f"--batch-size {args.batch_size} must split evenly into {dp} "
                         f"data-parallel replica(s) x {micro} microbatch(es); choose a multiple "
                         f"of {dp * micro}")
    train_set, held_out = load_digits_split()
    loader = plugin.prepare_dataloader(
        train_set, per_replica, shuffle=True, seed=args.seed, drop_last=True
    )
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    total = args.epochs * len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, args.warmup))
    criterion = make_criterion(args.label_smoothing)
    model, optimizer, criterion, loader, scheduler = booster.boost(
        model, optimizer, criterion=criterion, dataloader=loader, lr_scheduler=scheduler
    )
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, dynamic_ncols=True, desc="train")
    say = print if bar is None else bar.write
    history: dict[str, list[float]] = {"epoch": [], "train_loss": [], "val_loss": [],
                                       "val_accuracy": [], "elapsed": []}
    reporter = is_reporter(plugin)
    t0 = time.time()
    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)
        losses = []
        for batch in loader:
            loss = train_step(booster, model, optimizer, criterion, batch)
            scheduler.step()
            if loss is not None and reporter:
                losses.append(loss)
            if bar is not None:
                bar.update(1)
                if loss is not None:
                    bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.3f}")
        train_loss = mean_over_reporters(sum(losses), len(losses))
        accuracy, val_loss = evaluate(model, held_out, plugin)
        for key, value in zip(history, (epoch + 1, train_loss, val_loss, accuracy,
                                        time.time() - t0), strict=True):
            history[key].append(value)
        if rank == 0:
            say(f"epoch {epoch + 1}/{args.epochs}: train loss {train_loss:.4f}, held-out loss "
                f"{val_loss:.4f}, held-out accuracy {accuracy:.4f} ({time.time() - t0:.0f}s)")
    if bar is not None:
        bar.close()
    result = {
        "plugin": args.plugin, "world": world, "dp": dp, "tp": args.tp, "pp": args.pp,
        "num_microbatches": args.num_microbatches if args.pp > 1 else None,
        "zero_stage": args.zero_stage if args.plugin == "hybrid_parallel" else None,
        "precision": args.precision, "epochs": args.epochs, "batch_size": args.batch_size,
        "lr": args.lr, "label_smoothing": args.label_smoothing, "seed": args.seed,
        "final_accuracy": history["val_accuracy"][-1],
        "train_seconds": time.time() - t0, "seconds": time.time() - started, **history,
    }
    if rank == 0:
        say(f"final held-out accuracy {result['final_accuracy']:.4f} (plugin {args.plugin}, "
            f"{world} processes, tp {args.tp} x pp {args.pp} x dp {dp}, "
            f"{result['seconds']:.0f}s)")
        write_metrics(result, os.path.join(args.out, "metrics.json"))
        plot_curves(history, os.path.join(args.out, "curves.png"))
    dist.barrier()
    destroy()
    return result


if __name__ == "__main__":
    main()
