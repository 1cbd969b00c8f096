"""The seeds' ColoTensor GPT-2 at tp 2 against ``HybridParallelPlugin(tp_size=2)``, 2 gloo ranks.

The "Parallelize Your Training like Megatron-LM via ColoTensor" tutorial's model
(``examples/legacy/colotensor_gpt.py``: a transformers GPT-2 built under ``ColoInitContext``
and split by the page's parameter loop; every operator runs on DTensor's sharding
propagation, outputs made whole over tp as the page's compute specs say) is trained with
torch ``AdamW(lr=1e-4)`` next to the same GPT-2 (same initial weights, seed 0) boosted with
``HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")`` (Shardformer's GPT-2 policy:
head-aligned q/k/v columns, vocab-parallel embedding and LM head), on the same random token
batches (labels = inputs), in ONE spawned run of 2 processes (gloo, one thread each).

A step is forward + loss + backward + ``step`` + ``zero_grad``. After ``--warmup`` steps of
each, ``--rounds`` rounds alternate the two step by step (the order flips every round); a
step's time is a barrier, then the slowest rank's wall time. Reported: median, min and max
step time per configuration, the ratio ColoTensor / Hybrid on the medians and the paired
per-round median, CPU time of a step summed over the ranks (load-insensitive), and the
first step's loss of each (same weights, same batch: a wrong model cannot look fast).
Goal (issue 34): ratio <= 1.3x.

    python3 benchmarks/colotensor.py [--rounds N] [--warmup N] [--hidden H] [--layers L]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples", "legacy"))

from bench_common import goal, markdown_table, paired_median, spread  # noqa: E402

from colossal.core.testing import spawn  # noqa: E402

WORLD = 2


def _cpu() -> float:
    return time.process_time()


def _timed(step: Any) -> tuple[float, float]:
    """(slowest rank's wall time, CPU time summed over ranks) of one ``step()``."""
    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu()
    step()
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    out = torch.tensor([wall, cpu], dtype=torch.float64)
    walls = [torch.zeros_like(out) for _ in range(WORLD)]
    dist.all_gather(walls, out)
    return max(float(w[0]) for w in walls), sum(float(w[1]) for w in walls)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    from colossalai.tensor import ProcessGroup
    from colossalai.utils.model.colo_init_context import ColoInitContext
    from colotensor_gpt import GPTLMLoss, GPTLMModel, tensor_parallelize

    from colossal.booster import Booster
    from colossal.booster.plugin import HybridParallelPlugin

    size = dict(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        max_seq_len=args.seq,
        vocab_size=args.vocab,
    )
    torch.manual_seed(0)
    with ColoInitContext(device=torch.device("cpu")):
        colo = GPTLMModel(**size)
    tensor_parallelize(colo, ProcessGroup(tp_degree=world_size))
    colo_opt = torch.optim.AdamW(colo.parameters(), lr=1e-4)
    criterion = GPTLMLoss()

    torch.manual_seed(0)
    plain = GPTLMModel(**size).model  # the same GPT2LMHeadModel, plain
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    hyb, hyb_opt, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4))

    gen = torch.Generator().manual_seed(1)
    steps = args.warmup + args.rounds
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
               for _ in range(steps)]  # fmt: skip
    losses: dict[str, list[float]] = {"colotensor": [], "hybrid": []}

    def colo_step(ids: torch.Tensor) -> None:
        loss = criterion(colo(ids, torch.ones_like(ids)), ids)
        loss.backward()
        colo_opt.step()
        colo_opt.zero_grad()
        losses["colotensor"].append(float(loss.detach()))

    def hyb_step(ids: torch.Tensor) -> None:
        loss = hyb(input_ids=ids, labels=ids, use_cache=False).loss
        booster.backward(loss, hyb_opt)
        hyb_opt.step()
        hyb_opt.zero_grad()
        losses["hybrid"].append(float(loss.detach()))

    runs = {"colotensor": colo_step, "hybrid": hyb_step}
    for i in range(args.warmup):
        for fn in runs.values():
            fn(batches[i])
    walls: dict[str, list[float]] = {k: [] for k in runs}
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            ids = batches[args.warmup + r]
            wall, cpu = _timed(lambda n=name, b=ids: runs[n](b))
            walls[name].append(wall)
            cpus[name].append(cpu)
    rows = []
    for name in runs:
        rows.append({"config": name, **spread("step", walls[name]),
                     "cpu_s": statistics.median(cpus[name]), "first_loss": losses[name][0],
                     "walls": walls[name]})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (>= 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    if args.rounds < 3 or args.warmup < 1:
        parser.error(f"--rounds must be >= 3 and --warmup >= 1, got {args.rounds}, {args.warmup}")
    start = time.time()
    load0 = os.getloadavg()
    rows = spawn(worker, WORLD, args=(args,), timeout=3600, comm_timeout=600)[0]
    by = {r["config"]: r for r in rows}
    ratio = by["colotensor"]["step_s"] / by["hybrid"]["step_s"]
    paired = paired_median(by["colotensor"]["walls"], by["hybrid"]["walls"])
    for r in rows:
        r.pop("walls")
        r["vs_hybrid"] = r["step_s"] / by["hybrid"]["step_s"]
    print(
        f"\nColoTensor GPT-2 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"vocab {args.vocab}), batch {args.batch} x {args.seq}, AdamW, tp 2 on {WORLD} gloo "
        f"CPU ranks x 1 thread, {args.warmup} warm-up + {args.rounds} rounds, "
        f"{time.time() - start:.0f} s, load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}\n"
    )
    print(markdown_table(rows, ["config", "step_s", "step_min_s", "step_max_s", "cpu_s",
                                "first_loss", "vs_hybrid"]))  # fmt: skip
    gl = goal("colotensor / hybrid step time (medians)", ratio, "<= 1.3", ratio <= 1.3)
    print(f"\nratio on medians {ratio:.3f}x, paired per-round median {paired:.3f}x; "
          f"goal <= 1.3x: {'met' if gl['met'] else 'not met'}")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
