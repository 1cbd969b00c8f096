"""Train a character-level GPT-2 with the Colossal Booster (DDP, FSDP2, ZeRO-1/2 or Gemini).

Run on 2 CPU processes (nanoGPT's shakespeare_char CPU settings)::

    torchrun --nproc_per_node=2 examples/train_gpt.py --plugin zero2
    torchrun --nproc_per_node=2 examples/train_gpt.py --plugin gemini --precision bf16

``--plugin``: ``ddp`` (torch DDP; ``--precision`` through the Booster's mixed precision),
``fsdp`` (FSDP2; fp32/bf16), ``zero1``/``zero2`` (colossal.zero) or ``gemini`` (chunk-based
ZeRO-3, ``GeminiPlugin`` with static placement: every chunk sharded, nothing offloaded).
``--precision fp32|bf16|fp16``: ZeRO and Gemini hold the parameters in that dtype with fp32
master weights; fp16 adds a dynamic loss scaler (initial scale 2**16). ZeRO and Gemini clip
the gradients themselves (``max_norm=--grad-clip``); DDP and FSDP clip through the optimizer.
The optimizer is built before boosting, as Gemini needs (it moves the parameters into chunks).

By default GPT-2's composed ``gelu_new`` runs as colossal-kernels' fused tanh-GELU (the same
function; ``--no-fused-kernels`` keeps the model's modules). ``--metrics-json`` writes the
per-iteration times and losses (``benchmarks/main_job.py`` reads them).

Data: ``../shared/data/tinyshakespeare.txt`` (relative to the repository) when present, else
a corpus built from local text files (the Python sources and docs of this repository). The
model is ``transformers.GPT2LMHeadModel`` built from a config (no weights are downloaded).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F  # noqa: N812

from colossal.booster import Booster
from colossal.booster.plugin import (
    GeminiPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from colossal.core import destroy, launch_from_torch
from colossal.kernels import replace_activations
from colossal.lazy import LazyInitContext

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SHAKESPEARE = os.path.join(REPO, "..", "shared", "data", "tinyshakespeare.txt")
LOG_EVERY = 100  # iterations between the all-reduces of the logged training loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plugin", choices=["ddp", "fsdp", "zero1", "zero2", "gemini"], default="ddp")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--data", default=None, help="text file (default: tinyshakespeare if present)")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=12, help="global batch (sequences)")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument(
        "--out",
        default=os.path.join(tempfile.gettempdir(), "colossal_train_gpt"),
        help="checkpoints and the loss curve",
    )
    p.add_argument("--save-interval", type=int, default=0, help="checkpoint every N iters")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument(
        "--stop-after", type=int, default=0, help="stop after N iterations (simulate a crash)"
    )
    p.add_argument("--lazy", action="store_true", help="build the model with LazyInitContext")
    p.add_argument(
        "--no-fused-kernels",
        dest="fused_kernels",
        action="store_false",
        help="keep the model's own modules (default: GPT-2's composed gelu_new runs as "
        "colossal-kernels' one fused tanh-GELU kernel, the same function)",
    )
    p.add_argument(
        "--metrics-json",
        default=None,
        help="rank 0 writes the per-iteration times (ms) and the losses here",
    )
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def load_text(path: str | None) -> str:
    if path:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    if os.path.isfile(SHAKESPEARE):
        with open(SHAKESPEARE, encoding="utf-8") as fh:
            return fh.read()
    parts = []
    for pattern in ("**/*.py", "**/*.md"):
        for name in sorted(glob.glob(os.path.join(REPO, pattern), recursive=True)):
            if "/out/" in name or "/." in name:
                continue
            with open(name, encoding="utf-8", errors="ignore") as fh:
                parts.append(fh.read())
    return "\n".join(parts)


def load_data(path: str | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The vocabulary size and the train / validation characters (90% / 10%) as ids."""
    text = load_text(path)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return len(chars), data[:split], data[split:]


def gpt2_config(args: argparse.Namespace, vocab_size: int):
    """The ``GPT2Config`` of the model the arguments describe."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=args.block,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        resid_pdrop=args.dropout,
        embd_pdrop=args.dropout,
        attn_pdrop=args.dropout,
        bos_token_id=0,
        eos_token_id=0,
    )


def make_booster(args: argparse.Namespace) -> Booster:
    if args.plugin == "ddp":
        mp = None if args.precision == "fp32" else args.precision
        return Booster(plugin=TorchDDPPlugin(), mixed_precision=mp)
    if args.plugin == "fsdp":
        return Booster(plugin=TorchFSDPPlugin(precision=args.precision))
    if args.plugin == "gemini":
        return Booster(
            plugin=GeminiPlugin(
                precision=args.precision, max_norm=args.grad_clip, initial_scale=2**16
            )
        )
    stage = int(args.plugin[-1])
    return Booster(
        plugin=LowLevelZeroPlugin(
            stage=stage, precision=args.precision, max_norm=args.grad_clip, initial_scale=2**16
        )
    )


def lr_lambda(args: argparse.Namespace):
    def fn(it: int) -> float:
        if it < args.warmup:
            return (it + 1) / (args.warmup + 1)
        ratio = min(1.0, (it - args.warmup) / max(1, args.iters - args.warmup))
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return (args.min_lr + coeff * (args.lr - args.min_lr)) / args.lr

    return fn


def get_batch(data: torch.Tensor, n: int, block: int, gen: torch.Generator):
    starts = torch.randint(len(data) - block - 1, (n,), generator=gen)
    x = torch.stack([data[s : s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts.tolist()])
    return x, y


def lm_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def mean_over_ranks(values: list[float]) -> list[float]:
    """Each value averaged over the ranks, in one all-reduce for the whole list."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


@torch.no_grad()
def evaluate(model, data, args, rank: int, world: int) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(12345 + rank)
    per_rank = max(1, args.batch_size // world)
    losses = [
        lm_loss(model, *get_batch(data, per_rank, args.block, gen)).item()
        for _ in range(args.eval_iters)
    ]
    model.train()
    return mean_over_ranks([sum(losses) / len(losses)])[0]


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a crash leaves the old file or the new one, whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_latest(ckpt: str) -> str | None:
    """Name of the newest complete checkpoint directory under ``ckpt`` (None if none)."""
    try:
        with open(os.path.join(ckpt, "latest"), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except FileNotFoundError:
        return None


def latest_checkpoint(ckpt: str) -> str:
    """Directory of the newest complete checkpoint, or a clear error for ``--resume``."""
    name = read_latest(ckpt)
    if name is None:
        raise SystemExit(f"--resume: no complete checkpoint under {ckpt} (no 'latest' file); "
                         "train with --save-interval N first, or drop --resume")
    return os.path.join(ckpt, name)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    launch_from_torch()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by {world} ranks")
    from transformers import GPT2LMHeadModel

    vocab, train_data, val_data = load_data(args.data)
    config = gpt2_config(args, vocab)
    torch.manual_seed(args.seed)
    if args.lazy:
        with LazyInitContext():
            model = GPT2LMHeadModel(config)
    else:
        model = GPT2LMHeadModel(config)
    if args.fused_kernels:
        replace_activations(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.99),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    booster = make_booster(args)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)

    ckpt = os.path.join(args.out, "checkpoint")
    start, history = 0, {"iter": [], "train": [], "val_iter": [], "val": []}
    if args.resume:
        where = latest_checkpoint(ckpt)
        booster.load_model(model, os.path.join(where, "model"))
        booster.load_optimizer(optimizer, os.path.join(where, "optimizer"))
        booster.load_lr_scheduler(scheduler, os.path.join(where, "lr_scheduler.json"))
        with open(os.path.join(where, "train_state.json"), encoding="utf-8") as fh:
            saved = json.load(fh)
        start, history = saved["iter"], saved["history"]
        if rank == 0:
            print(f"resumed from {where} at iteration {start}")

    def save(it: int) -> None:
        # Each checkpoint goes to a directory of its own; the "latest" pointer moves to it
        # only once all of it is on disk, so a crash at any moment leaves a whole checkpoint.
        where = os.path.join(ckpt, f"iter-{it:07d}")
        booster.save_model(
            model, os.path.join(where, "model"), shard=True, use_async=args.async_save
        )
        booster.save_optimizer(
            optimizer, os.path.join(where, "optimizer"), shard=True, use_async=args.async_save
        )
        booster.save_lr_scheduler(scheduler, os.path.join(where, "lr_scheduler.json"))
        booster.wait_async_saves()  # the pointer below must refer to a committed checkpoint
        dist.barrier()
        if rank == 0:
            write_atomic(os.path.join(where, "train_state.json"),
                         json.dumps({"iter": it, "history": history}))
            previous = read_latest(ckpt)
            write_atomic(os.path.join(ckpt, "latest"), os.path.basename(where))
            if previous is not None and previous != os.path.basename(where):
                shutil.rmtree(os.path.join(ckpt, previous), ignore_errors=True)
        dist.barrier()

    per_rank = args.batch_size // world
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    for _ in range(start):  # the same data order as an uninterrupted run
        get_batch(train_data, per_rank, args.block, gen)
    bar = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=args.iters, initial=start, dynamic_ncols=True)
        except ImportError:
            bar = None
    t0 = time.time()
    val = float("nan")
    iter_ms: list[float] = []
    # Training losses are averaged over the ranks every LOG_EVERY iterations in one
    # all-reduce: a per-iteration one would wait, every step, for the parameter all-gather
    # that ZeRO lets overlap the next forward (gloo runs a group's collectives in order).
    unreduced: list[float] = []

    def flush_losses() -> None:
        if unreduced:
            history["train"].extend(mean_over_ranks(unreduced))
            unreduced.clear()
    for it in range(start, args.iters):
        if it % args.eval_interval == 0 or it == args.iters - 1:
            val = evaluate(model, val_data, args, rank, world)
            history["val_iter"].append(it)
            history["val"].append(val)
            if rank == 0:
                msg = f"iter {it}: val loss {val:.4f}"
                print(msg, flush=True) if bar is None else bar.write(msg)
        started = time.perf_counter()
        x, y = get_batch(train_data, per_rank, args.block, gen)
        loss = lm_loss(model, x, y)
        booster.backward(loss, optimizer)
        if args.grad_clip > 0 and args.plugin in ("ddp", "fsdp"):  # ZeRO/Gemini clip in step
            optimizer.clip_grad_by_norm(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        local_loss = loss.item()
        unreduced.append(local_loss)
        iter_ms.append((time.perf_counter() - started) * 1e3)
        history["iter"].append(it)
        if it % LOG_EVERY == 0 or it == args.iters - 1:
            flush_losses()
            if bar is None and rank == 0:
                print(f"iter {it}: loss {history['train'][-1]:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
        if bar is not None:  # this rank's loss; the history has the mean over ranks
            bar.set_postfix(loss=f"{local_loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            bar.update(1)
        if args.save_interval and (it + 1) % args.save_interval == 0:
            flush_losses()
            save(it + 1)
        if args.stop_after and it + 1 - start >= args.stop_after:
            flush_losses()
            if rank == 0:
                print(f"stopping after iteration {it + 1} (--stop-after)", flush=True)
            destroy()
            return val
    if bar is not None:
        bar.close()
    if rank == 0:
        print(
            f"final val loss {val:.4f} after {args.iters} iterations "
            f"({time.time() - t0:.0f}s, plugin {args.plugin}, {world} ranks)",
            flush=True,
        )
        plot(history, os.path.join(args.out, "loss.png"))
        if args.metrics_json:
            write_atomic(args.metrics_json, json.dumps(
                {"iter_ms": iter_ms, "final_val": val, "plugin": args.plugin, "world": world,
                 "fused_kernels": args.fused_kernels, **history}))
    dist.barrier()
    destroy()  # groups stay alive to the process's end, so freeing the model cannot deadlock
    return val


def plot(history: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss curve", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(history["iter"], history["train"], label="train", alpha=0.6)
    ax.plot(history["val_iter"], history["val"], label="val", marker="o")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"loss curve: {path}")


if __name__ == "__main__":
    main()
