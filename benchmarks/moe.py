"""Expert parallelism (``colossal.shardformer.moe``) against torch-written EP and pure DP.

World 4 (gloo, CPU, one thread per rank). A Mixtral-style stack (``_moe_models.py``:
``--layers`` attention-free blocks ``x + moe(rmsnorm(x))``, hidden ``--hidden``, ``--experts``
SwiGLU experts of width ``--ffn``, top-2 dropless routing, load-balancing aux loss 0.01) is
trained with ``AdamW(lr=1e-4)`` on ``--tokens`` random tokens per rank against a random
target, three ways, in ONE spawned run from the same weights and data:

* **ours** -- ``MoeLayer(TopKRouter(2, None), GroupedExperts(gated=True, ep_group=world))``:
  experts sharded over ep 4 (one count all-to-all and two uneven token all-to-alls per layer
  forward, two in the backward, through ``colossal.core.comm``);
* **torch_ep** -- the same EP written plainly in torch the way torchtitan's
  ``expert_parallel.py`` dispatches (``TorchEpMoe``: sort by expert, ``all_to_all_single`` of
  counts and of tokens with split sizes, autograd through
  ``_functional_collectives.all_to_all_single_autograd``, a loop over the local experts);
* **dp** -- the same module with every expert on every rank (pure data parallelism);
* **ours_loop** (diagnostic) -- ours with ColossalAI's ``Experts`` (one SwiGLU module per local
  expert, run whole on its rows) instead of ``GroupedExperts`` (whose CPU path,
  ``grouped_ffn``, splits the rows once, runs each expert's block on weights unbound once per
  step, and concatenates once).

Gradients: the non-expert ones (norms, gates) and, for ``dp``, every one are summed with one
flat all-reduce and divided by the world; EP expert gradients already hold every rank's
tokens (they come back through the all-to-all) and are divided by the world.

Measured: step time (``zero_grad`` + forward + loss + backward + gradient sync + ``AdamW``;
a barrier, then first rank's start to last rank's end), ``--steps`` steps per configuration per
round over ``--rounds`` rounds after ``--warmup`` steps, the configurations alternating step by
step and their order flipping every round; per configuration the median with min and max over
every timed step, the per-round ratio to ``torch_ep`` (median over rounds); tokens per second
(global tokens / step time); the CPU time of a step summed over the ranks (process time: less
sensitive to other load on the machine than the wall time);
per-rank expert parameter bytes against ``total / ep``; the collectives of one step of ours
(``CommTracker``) next to the reference's (the same calls by construction, counted from the
code). Sanity: the first step's loss (averaged over ranks) of every configuration and the loss
after the timed steps must agree across configurations (same function, same updates).

Goals (issue 33): ours <= 0.95x ``torch_ep``'s step time (median of >= 3 alternating rounds);
per-rank expert parameter memory = total / ep within 5 %.

    python3 benchmarks/moe.py [--quick] [--rounds N] [--steps N] [--warmup N] [--json PATH]
        [--hidden 256] [--ffn 512] [--experts 8] [--layers 2] [--tokens 2048] [--profile N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _moe_models import Stack, copy_weights
from bench_common import goal, machine, markdown_table, write_json

from colossal.core.testing import spawn

WORLD = 4
KINDS = ("ours", "torch_ep", "dp", "ours_loop")


class Config:
    """One configuration on this rank: model, AdamW, data, gradient sync."""

    def __init__(
        self, kind: str, src: Stack, args: argparse.Namespace, x: torch.Tensor, target: torch.Tensor
    ) -> None:
        group = None if kind == "dp" else dist.group.WORLD
        self.kind = kind
        self.model = Stack(
            kind if kind.startswith("ours") else "torch",
            args.hidden,
            args.ffn,
            args.experts,
            args.layers,
            group,
        )
        ep = 1 if group is None else WORLD
        copy_weights(self.model, src, args.experts, 0 if ep == 1 else dist.get_rank(), ep)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x, self.target = x, target
        self.experts = self.model.expert_params()
        reduced = self.model.dense_params() + (self.experts if kind == "dp" else [])
        self.reduced = reduced
        self.scaled = [] if kind == "dp" else self.experts
        self.last_loss = float("nan")

    def _sync(self) -> None:
        grads = [p.grad for p in self.reduced if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.kind.startswith("ours"):
            from colossal.core import comm

            comm.all_reduce(flat)
        else:
            dist.all_reduce(flat)
        flat.div_(WORLD)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        for p in self.scaled:
            if p.grad is not None:
                p.grad.div_(WORLD)

    def step(self) -> None:
        """One training step."""
        self.optim.zero_grad(set_to_none=True)
        loss = self.model.loss(self.x, self.target)
        loss.backward()
        self._sync()
        self.optim.step()
        self.last_loss = loss.item()


def _span(fn: Any) -> tuple[float, float]:
    """Wall time of ``fn()`` from the first rank's start to the last rank's end, and the CPU
    time (process time) it took summed over the ranks."""
    from colossal.core.comm import all_gather_object, barrier

    barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    t1, c1 = time.perf_counter(), time.process_time()
    spans = all_gather_object((t0, t1, c1 - c0))
    return max(e for _, e, _ in spans) - min(s for s, _, _ in spans), sum(c for *_, c in spans)


def _mean_loss(cfg: Config) -> float:
    t = torch.tensor([cfg.last_loss], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / WORLD


def _profile(cfgs: list[Config], top: int) -> dict[str, str]:
    """torch.profiler's top ``top`` ops (own CPU time) of one step of each configuration."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for cfg in cfgs:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            cfg.step()
        tables[cfg.kind] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return tables


def worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build the three configurations, check their losses, time them in alternating rounds."""
    from colossal.core import CommTracker

    torch.set_num_threads(1)
    torch.manual_seed(0)
    src = Stack("torch", args.hidden, args.ffn, args.experts, args.layers, None)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    target = torch.randn(args.tokens, args.hidden, generator=gen)
    cfgs = [Config(kind, src, args, x, target) for kind in args.configs]
    for cfg in cfgs:
        cfg.step()
    first = {cfg.kind: _mean_loss(cfg) for cfg in cfgs}
    ours = next((c for c in cfgs if c.kind == "ours"), None)
    comm: dict[str, Any] = {}
    for cfg in cfgs:  # every configuration takes the same number of steps
        if cfg is not ours:
            cfg.step()
    if ours is not None:
        with CommTracker() as tracker:
            ours.step()
        comm = {
            kind: {str(ranks): (s.calls, s.nbytes) for ranks, s in groups.items()}
            for kind, groups in tracker.summary().items()
        }
    for _ in range(args.warmup):
        for cfg in cfgs:
            cfg.step()
    times: dict[str, list[list[float]]] = {cfg.kind: [] for cfg in cfgs}
    cpu: dict[str, list[float]] = {cfg.kind: [] for cfg in cfgs}
    for r in range(args.rounds):
        for cfg in cfgs:
            times[cfg.kind].append([])
        for _ in range(args.steps):  # configurations alternate step by step
            for cfg in cfgs if r % 2 == 0 else cfgs[::-1]:
                wall, cpu_s = _span(cfg.step)
                times[cfg.kind][-1].append(wall)
                cpu[cfg.kind].append(cpu_s)
    last = {cfg.kind: _mean_loss(cfg) for cfg in cfgs}
    expert_bytes = {
        cfg.kind: sum(p.numel() * p.element_size() for p in cfg.experts) for cfg in cfgs
    }
    every = [None] * world
    dist.all_gather_object(every, expert_bytes)
    profile = _profile(cfgs, args.profile) if args.profile else {}  # collective: every rank
    return {
        "times": times,
        "cpu": cpu,
        "first": first,
        "last": last,
        "comm": comm,
        "expert_bytes": every,
        "profile": profile if rank == 0 else {},
    }


def _rows(res: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    total = args.layers * args.experts * 3 * args.hidden * args.ffn * 4
    tokens = args.tokens * WORLD
    base = [statistics.median(r) for r in res["times"].get("torch_ep", [])]
    rows = []
    for kind, rounds in res["times"].items():
        flat = [t for r in rounds for t in r]
        med = statistics.median(flat)
        per_round = [statistics.median(r) for r in rounds]
        ratio = (
            statistics.median(a / b for a, b in zip(per_round, base, strict=True))
            if base
            else float("nan")
        )
        mem = max(e[kind] for e in res["expert_bytes"])
        rows.append(
            {
                "config": kind,
                "step_ms": med * 1e3,
                "step_min_ms": min(flat) * 1e3,
                "step_max_ms": max(flat) * 1e3,
                "round_medians_ms": [round(t * 1e3, 1) for t in per_round],
                "vs_torch_ep": ratio,
                "tokens_per_s": tokens / med,
                "cpu_s_all_ranks": statistics.median(res["cpu"][kind]),
                "expert_MiB_per_rank": mem / 2**20,
                "expert_vs_total_over_ep": mem / (total / WORLD),
                "first_loss": res["first"][kind],
                "last_loss": res["last"][kind],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 1 step, 1 layer")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per config per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--profile", type=int, default=0, help="top N ops of one step (rank 0)")
    parser.add_argument("--json", help="write results as JSON to this path")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.layers, args.tokens = 3, 1, 1, 1024
    if args.rounds < 1 or args.steps < 1:
        raise ValueError(f"--rounds ({args.rounds}) and --steps ({args.steps}) must be >= 1")
    if args.experts % WORLD:
        raise ValueError(f"--experts ({args.experts}) must divide by the world ({WORLD})")

    start = time.time()
    res = spawn(worker, WORLD, args=(args,), timeout=3600)[0]
    elapsed = time.time() - start
    rows = _rows(res, args)
    print(
        f"\nMoE: {args.layers} attention-free blocks, hidden {args.hidden}, {args.experts} "
        f"SwiGLU experts of {args.ffn}, top-2 dropless, {args.tokens} tokens/rank, world "
        f"{WORLD} (ep {WORLD}), fp32 AdamW, gloo CPU, 1 thread/rank, {args.rounds} rounds x "
        f"{args.steps} steps, {elapsed:.0f} s\n"
    )
    cols = [
        "config",
        "step_ms",
        "step_min_ms",
        "step_max_ms",
        "round_medians_ms",
        "vs_torch_ep",
        "tokens_per_s",
        "cpu_s_all_ranks",
        "expert_MiB_per_rank",
        "expert_vs_total_over_ep",
        "first_loss",
        "last_loss",
    ]
    print(markdown_table(rows, cols))
    if res["comm"]:
        print("\ncollectives of one step of ours (kind: {ranks: (calls, bytes)}):")
        for kind, groups in res["comm"].items():
            print(f"  {kind}: {groups}")
        print(
            f"torch_ep by construction: all_to_all {5 * args.layers} (per layer 3 forward: "
            "counts + tokens out and back, 2 backward), all_reduce 1 (flat gradients)"
        )
    for kind, table in res["profile"].items():
        print(f"\nprofile of one step, {kind} (rank 0):\n{table}")
    by = {r["config"]: r for r in rows}
    goals = []
    for kind in ("ours", "ours_loop"):
        if kind in by and "torch_ep" in by:
            ratio = by[kind]["vs_torch_ep"]
            goals.append(
                goal(
                    f"{kind} step time / torch_ep (median of rounds)",
                    round(ratio, 3),
                    "<= 0.95",
                    args.rounds >= 3 and ratio <= 0.95,
                )
            )
    if "ours" in by:
        mem = by["ours"]["expert_vs_total_over_ep"]
        goals.append(
            goal(
                "ours expert bytes/rank / (total / ep)",
                round(mem, 4),
                "within 5 %",
                abs(mem - 1) <= 0.05,
            )
        )
    losses = [r["first_loss"] for r in rows]
    spread = (max(losses) - min(losses)) / abs(min(losses))
    goals.append(
        goal("first-step loss spread across configs (relative)", spread, "<= 1e-5", spread <= 1e-5)
    )
    lasts = [r["last_loss"] for r in rows]
    spread_last = (max(lasts) - min(lasts)) / abs(min(lasts))
    goals.append(
        goal(
            "last loss spread across configs (relative)",
            spread_last,
            "<= 1e-4",
            spread_last <= 1e-4,
        )
    )
    print("\n| goal | value | target | met |\n|---|---:|---|---|")
    for g in goals:
        print(f"| {g['name']} | {g['value']:.3g} | {g['target']} | {'yes' if g['met'] else 'NO'} |")
    print(f"\nmachine: {machine()}")
    write_json(args.json, "moe", rows, goals)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
