"""Train a character-level GPT-2 with the Colossal Booster (DDP, FSDP2, ZeRO, Gemini, hybrid).

Run on 2 CPU processes (nanoGPT's shakespeare_char CPU settings)::

    torchrun --nproc_per_node=2 examples/train_gpt.py --plugin zero2
    torchrun --nproc_per_node=2 examples/train_gpt.py --plugin gemini --precision bf16
    colossal run --nproc_per_node 4 examples/train_gpt.py --plugin hybrid --tp 2 --pp 2

``--plugin``: ``ddp`` (torch DDP; ``--precision`` through the Booster's mixed precision),
``fsdp`` (FSDP2; fp32/bf16), ``zero1``/``zero2`` (colossal.zero) or ``gemini`` (chunk-based
ZeRO-3, ``GeminiPlugin`` with static placement: every chunk sharded, nothing offloaded).
``--precision fp32|bf16|fp16``: ZeRO and Gemini hold the parameters in that dtype with fp32
master weights; fp16 adds a dynamic loss scaler (initial scale 2**16). ZeRO and Gemini clip
the gradients themselves (``max_norm=--grad-clip``); DDP and FSDP clip through the optimizer.
The optimizer is built before boosting, as Gemini needs (it moves the parameters into chunks).

``--plugin hybrid`` is ``HybridParallelPlugin``: ``--tp`` tensor-parallel and ``--pp``
pipeline ranks, ``--sp-mode`` sequence parallelism (``split_gather``/``ring`` split the
sequence over the tensor-parallel group; ``all_to_all``/``ring_attn`` over ``--sp`` ranks of
their own), ``--zero-stage`` 0-2 over the data-parallel ranks that remain (dp = world / (tp x
pp x sp)); every data-parallel replica takes ``--batch-size / dp`` sequences. The loss is
transformers' own (``labels`` with ``shift_labels``: vocab-parallel under TP). With ``--pp``
a step is ``booster.execute_pipeline`` over ``--num-microbatches`` (default: pp; more shrink
the bubble on real devices, but each costs overhead on CPU) and only the last stage holds
the loss. Validation calls ``plugin.execute_pipeline`` under ``torch.no_grad()``, where the
schedule runs its forward-only IR (colossal-pipeline's ``forward_only``: each microbatch's
forwards through the stages, no backward, no gradients). Logged losses are averaged over
the ranks that hold one. Checkpoints are the one format of every plugin (save under hybrid,
resume under any plugin and world size, and back); ``--async-save`` needs ``--tp 1 --pp 1``
(the plugin saves optimizer states synchronously under TP/PP).

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
    HybridParallelPlugin,
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
SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--plugin", choices=["ddp", "fsdp", "zero1", "zero2", "gemini", "hybrid"], default="ddp"
    )
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
    h = p.add_argument_group("--plugin hybrid")
    h.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    h.add_argument("--pp", type=int, default=1, help="pipeline stages")
    h.add_argument("--sp", type=int, default=None,
                   help="sequence-parallel size of its own (all_to_all, ring_attn)")
    h.add_argument("--sp-mode", choices=SP_MODES, default=None,
                   help="enable sequence parallelism in this mode")
    h.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0)
    h.add_argument("--num-microbatches", type=int, default=None,
                   help="microbatches per step with --pp > 1 (default: pp)")
    args = p.parse_args(argv)
    check_hybrid_args(p, args)
    return args


def check_hybrid_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse hybrid options without ``--plugin hybrid`` and what the hybrid plugin cannot do."""
    hybrid_opts = {"--tp": args.tp != 1, "--pp": args.pp != 1, "--sp": args.sp is not None,
                   "--sp-mode": args.sp_mode is not None, "--zero-stage": args.zero_stage != 0,
                   "--num-microbatches": args.num_microbatches is not None}
    given = [name for name, set_ in hybrid_opts.items() if set_]
    if args.plugin != "hybrid":
        if given:
            p.error(f"{', '.join(given)} need --plugin hybrid")
        return
    if args.sp is not None and args.sp_mode not in ("all_to_all", "ring_attn"):
        p.error(f"--sp {args.sp} is the group of --sp-mode all_to_all or ring_attn "
                f"(got --sp-mode {args.sp_mode}); split_gather and ring use the --tp group")
    if args.tp * args.pp > 1 and args.async_save:
        p.error(
            f"--async-save with --plugin hybrid --tp {args.tp} --pp {args.pp}: "
            "HybridParallelPlugin saves optimizer states asynchronously only with tp = pp = 1 "
            "(its save_optimizer raises NotImplementedError otherwise); drop --async-save"
        )


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
    if args.plugin == "hybrid":
        return Booster(plugin=make_hybrid_plugin(args))
    stage = int(args.plugin[-1])
    return Booster(
        plugin=LowLevelZeroPlugin(
            stage=stage, precision=args.precision, max_norm=args.grad_clip, initial_scale=2**16
        )
    )


def make_hybrid_plugin(args: argparse.Namespace) -> HybridParallelPlugin:
    """``HybridParallelPlugin`` for ``--tp/--pp/--sp/--sp-mode/--zero-stage``."""
    microbatches = None
    if args.pp > 1:  # one microbatch per stage: on CPU a microbatch's overhead beats the bubble
        microbatches = args.num_microbatches or args.pp
    return HybridParallelPlugin(
        tp_size=args.tp,
        pp_size=args.pp,
        sp_size=args.sp,
        precision=args.precision,
        zero_stage=args.zero_stage,
        enable_sequence_parallelism=args.sp_mode is not None,
        sequence_parallelism_mode=args.sp_mode,
        num_microbatches=microbatches,
        max_norm=args.grad_clip,
        initial_scale=2**16,
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


def hf_batch(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Keywords for transformers' own loss on targets ``y`` (already shifted: ``shift_labels``).

    The hybrid plugin's model computes it vocab-parallel under TP (its logits are split).
    """
    return {"input_ids": x, "labels": y, "shift_labels": y}


def hf_loss(outputs, microbatch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The pipeline's criterion: the last stage's transformers loss."""
    return outputs.loss


def mean_over_holders(values: list[float] | None, n: int = 1) -> list[float]:
    """Each of ``n`` values averaged over the ranks that hold them, in one all-reduce.

    ``values`` is None on ranks without them (pipeline stages before the last); with every
    rank holding values this is the plain mean over the ranks.

    Raises:
        RuntimeError: No rank holds the values.
    """
    t = torch.zeros(n + 1, dtype=torch.float64)
    if values is not None:
        if len(values) != n:
            raise ValueError(f"{len(values)} values, expected {n}")
        t[:n] = torch.tensor(values, dtype=torch.float64)
        t[n] = 1.0
    dist.all_reduce(t)
    if t[n] == 0:
        raise RuntimeError("no rank holds a loss to average")
    return (t[:n] / t[n]).tolist()


def pipeline_losses(plugin: HybridParallelPlugin, model, batches) -> list[float] | None:
    """Validation losses of ``batches`` through the pipeline (None before the last stage).

    Called under ``torch.no_grad``, where the plugin's schedule runs only the forwards of
    each batch's microbatches; the loss exists on the last stage.
    """
    losses = []
    for x, y in batches:
        out = plugin.execute_pipeline(iter([hf_batch(x, y)]), model, hf_loss, None)
        if out["loss"] is not None:
            losses.append(out["loss"].item())
    return losses if plugin.stage_manager.is_last_stage() else None


@torch.no_grad()
def evaluate(model, data, args, dp_rank: int, dp: int, plugin=None) -> float:
    """Mean validation loss over ``--eval-iters`` batches per data-parallel replica."""
    model.eval()
    gen = torch.Generator().manual_seed(12345 + dp_rank)
    per_rank = max(1, args.batch_size // dp)
    batches = (get_batch(data, per_rank, args.block, gen) for _ in range(args.eval_iters))
    if plugin is not None and plugin.pp_size > 1:
        losses = pipeline_losses(plugin, model, batches)
    elif plugin is not None:
        losses = [model(**hf_batch(x, y)).loss.item() for x, y in batches]
    else:
        losses = [lm_loss(model, x, y).item() for x, y in batches]
    model.train()
    return mean_over_holders(None if losses is None else [sum(losses) / len(losses)])[0]


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
    if args.batch_size % world and args.plugin != "hybrid":
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
    hybrid = booster.plugin if args.plugin == "hybrid" else None
    dp_rank, dp = rank, world  # the data-parallel replica this rank belongs to, of dp
    if hybrid is not None:
        dp_rank, dp = hybrid.parallel_dims.coordinate("dp"), hybrid.dp_size
        if args.batch_size % dp:
            raise ValueError(f"--batch-size {args.batch_size} must be divisible by the {dp} "
                             f"data-parallel replicas (world {world} / tp x pp x sp)")
        micro = hybrid.config.num_microbatches
        if hybrid.pp_size > 1 and micro and (args.batch_size // dp) % micro:
            raise ValueError(f"--num-microbatches {micro} must divide each replica's batch of "
                             f"{args.batch_size // dp} sequences (--batch-size / dp {dp})")
        if rank == 0:
            seq = f"{args.sp_mode} over {hybrid.sp_size} ranks" if args.sp_mode else "off"
            print(f"hybrid layout: dp {dp} x pp {hybrid.pp_size} x sp "
                  f"{hybrid.config.resolved_sp_size} x tp {hybrid.tp_size}, zero stage "
                  f"{args.zero_stage}, sequence parallelism {seq}, microbatches "
                  f"{hybrid.config.num_microbatches}", flush=True)
    pipelined = hybrid is not None and hybrid.pp_size > 1
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

    per_rank = args.batch_size // dp  # every rank of a data-parallel replica draws the same
    gen = torch.Generator().manual_seed(args.seed * 1000 + dp_rank)
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
    # Under a pipeline only the last stage's ranks hold losses; the mean is over them.
    unreduced: list[float] = []
    pending = 0  # iterations since the last all-reduce (ranks without losses count too)

    def flush_losses() -> None:
        nonlocal pending
        if pending:
            history["train"].extend(mean_over_holders(unreduced or None, pending))
            unreduced.clear()
            pending = 0
    for it in range(start, args.iters):
        if it % args.eval_interval == 0 or it == args.iters - 1:
            val = evaluate(model, val_data, args, dp_rank, dp, hybrid)
            history["val_iter"].append(it)
            history["val"].append(val)
            if rank == 0:
                msg = f"iter {it}: val loss {val:.4f}"
                print(msg, flush=True) if bar is None else bar.write(msg)
        started = time.perf_counter()
        x, y = get_batch(train_data, per_rank, args.block, gen)
        if pipelined:  # the loss is on the last stage only (None elsewhere)
            loss = booster.execute_pipeline(
                iter([hf_batch(x, y)]), model, hf_loss, optimizer, return_loss=True
            )["loss"]
        else:
            loss = model(**hf_batch(x, y)).loss if hybrid is not None else lm_loss(model, x, y)
            booster.backward(loss, optimizer)
        if args.grad_clip > 0 and args.plugin in ("ddp", "fsdp"):  # the others clip in step
            optimizer.clip_grad_by_norm(args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        local_loss = None if loss is None else loss.item()
        if local_loss is not None:
            unreduced.append(local_loss)
        pending += 1
        iter_ms.append((time.perf_counter() - started) * 1e3)
        history["iter"].append(it)
        if it % LOG_EVERY == 0 or it == args.iters - 1:
            flush_losses()
            if bar is None and rank == 0:
                print(f"iter {it}: loss {history['train'][-1]:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
        if bar is not None:  # this rank's loss; the history has the mean over ranks
            shown = local_loss if local_loss is not None else (history["train"] or [val])[-1]
            bar.set_postfix(loss=f"{shown:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
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
            f"({time.time() - t0:.0f}s, plugin {args.plugin}{layout_name(args)}, {world} ranks)",
            flush=True,
        )
        plot(history, os.path.join(args.out, "loss.png"))
        if args.metrics_json:
            layout = {} if hybrid is None else {"layout": {
                "dp": dp, "pp": hybrid.pp_size, "sp": hybrid.config.resolved_sp_size,
                "tp": hybrid.tp_size, "sp_mode": args.sp_mode, "zero_stage": args.zero_stage,
                "num_microbatches": hybrid.config.num_microbatches,
            }}
            write_atomic(args.metrics_json, json.dumps(
                {"iter_ms": iter_ms, "final_val": val, "plugin": args.plugin, "world": world,
                 "fused_kernels": args.fused_kernels, **layout, **history}))
    dist.barrier()
    destroy()  # groups stay alive to the process's end, so freeing the model cannot deadlock
    return val


def layout_name(args: argparse.Namespace) -> str:
    """`` tp2 pp2 split_gather`` (`` tp1 pp1 sp2 all_to_all``) for ``--plugin hybrid``."""
    if args.plugin != "hybrid":
        return ""
    sp = f" sp{args.sp}" if args.sp else ""
    mode = f" {args.sp_mode}" if args.sp_mode else ""
    return f" tp{args.tp} pp{args.pp}{sp}{mode}"


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
