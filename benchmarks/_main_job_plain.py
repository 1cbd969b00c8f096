"""The plain single-process PyTorch loop that ``main_job.py`` measures the main job against.

Written as a plain PyTorch user would train the model of ``examples/train_gpt.py``: the same
``GPT2LMHeadModel`` (built from the example's ``GPT2Config``, seed 1337), the same corpus and
batches (``load_text``, ``get_batch``), ``torch.optim.AdamW`` with the example's parameter
groups and ``fused=True``, ``LambdaLR`` with the example's ``lr_lambda``, gradient clipping at
1.0. No Colossal code takes part in the training: only the example's data helpers and
defaults are imported (importing the example does not start it).

Each iteration is timed as the example times its own: batch, forward, backward, clip, step,
zero_grad, scheduler step and ``loss.item()``. The validation loss is estimated as the
example's ``evaluate`` does (``--eval-iters`` batches of the global batch size from the
validation split, generator seed 12345), at the same point: before the last iteration.

    python benchmarks/_main_job_plain.py --iters 2000 --threads 2 --batch-size 12 \
        --metrics-json out.json

The JSON file has ``iter_ms`` (per-iteration wall ms), ``final_val``, ``threads`` and
``batch_size``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
EVAL_SEED = 12345


def _example() -> Any:
    """The ``examples/train_gpt.py`` module (its helpers and defaults; nothing runs)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import train_gpt

    return train_gpt


@torch.no_grad()
def _evaluate(model: torch.nn.Module, data: torch.Tensor, ex: Any, args: Any) -> float:
    """Mean validation loss over ``args.eval_iters`` batches of ``args.batch_size``."""
    model.eval()
    gen = torch.Generator().manual_seed(EVAL_SEED)
    losses = [
        ex.lm_loss(model, *ex.get_batch(data, args.batch_size, args.block, gen)).item()
        for _ in range(args.eval_iters)
    ]
    model.train()
    return sum(losses) / len(losses)


def train(iters: int, threads: int, batch_size: int, eval_iters: int) -> dict[str, Any]:
    """Train the example's model in this process; per-iteration times and the final val loss."""
    torch.set_num_threads(threads)
    ex = _example()
    from transformers import GPT2LMHeadModel

    args = ex.parse_args(["--iters", str(iters), "--eval-iters", str(eval_iters)])
    eval_args = argparse.Namespace(**vars(args))  # evaluation batches: the global batch
    vocab, train_data, val_data = ex.load_data(args.data)
    config = ex.gpt2_config(args, vocab)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.99),
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ex.lr_lambda(args))
    gen = torch.Generator().manual_seed(args.seed * 1000)

    iter_ms: list[float] = []
    val = float("nan")
    for it in range(iters):
        if it == iters - 1:  # where the example takes its final validation loss
            val = _evaluate(model, val_data, ex, eval_args)
        started = time.perf_counter()
        x, y = ex.get_batch(train_data, batch_size, args.block, gen)
        loss = ex.lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        loss.item()
        iter_ms.append((time.perf_counter() - started) * 1e3)
    return {"iter_ms": iter_ms, "final_val": val, "threads": threads, "batch_size": batch_size}


def main(argv: list[str] | None = None) -> int:
    """Parse the options, train, write the JSON file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=12, help="sequences per iteration")
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--metrics-json", required=True)
    args = p.parse_args(argv)
    result = train(args.iters, args.threads, args.batch_size, args.eval_iters)
    with open(args.metrics_json, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
