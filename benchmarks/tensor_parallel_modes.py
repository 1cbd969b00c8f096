"""Tensor parallel modes: 1D vs 2D at world 4, 1D vs 2.5D (depth 2) vs 3D at world 8.

A stack of transformer blocks (pre-norm softmax attention with separate q/k/v projections and
a GELU MLP, see ``_tp_modes_model.py``) is built once as a plain model and sharded into each
mode's layers (``Linear1D_Col``/``Linear1D_Row``; ``Linear2D``/``LayerNorm2D``;
``Linear2p5D``/``LayerNorm2p5D``; ``Linear3D``/``LayerNorm3D``) on gloo CPU processes with one
thread each. One spawned run per world size builds every mode of that world from the same
weights, input and output gradient, checks that the gathered output equals the plain model's,
then measures per rank, against the formulas of ``_tp_modes_formulas.py``:

* parameter memory (bytes of the parameters the rank holds) -- goal: within 5 %;
* activation memory (bytes of every activation a block produces on the rank: module outputs,
  attention probabilities and context, GELU, residual sums) -- goal: within 5 %; next to it,
  the bytes autograd saves for the backward (``torch.autograd.graph.saved_tensors_hooks``,
  parameters left out, each storage once) as a fraction of the plain model's (reported: the
  layers may save gathered inputs, e.g. 3D keeps its input gathered along one axis);
* communicated bytes of one training step (``colossal.core.CommTracker``, every rank) --
  goal: equal to the formula on every rank;
* step time (``zero_grad`` + forward + backward of a fixed output gradient + SGD step, first
  rank's start to last rank's end; median of >= 3 rounds, the modes alternating order every
  round) against 1D at the same world size (reported, no goal: CPU gloo favours fewer, larger
  messages and world 8 shares 2 cores here).

The "GPU estimate" columns turn the tracker's per-group record into what one rank sends with
ring algorithms (all-reduce ``2(g-1)/g`` of the tensor, the other collectives ``(g-1)/g``) and
the ring steps, then price them at ``--gpu-gbps`` GB/s per rank and ``--gpu-latency-us`` per
step: a cluster's communication time per step, where the per-rank compute (``1/P`` of the
FLOPs in every mode) is the same for all modes.

Usage::

    python3 benchmarks/tensor_parallel_modes.py [--hidden 512] [--heads 8] [--layers 2]
        [--batch 8] [--seq 128] [--rounds 5] [--warmup 1] [--worlds 4 8]
        [--gpu-gbps 100] [--gpu-latency-us 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from _tp_modes_formulas import activation_elems, comm_bytes, param_elems, wire_bytes
from _tp_modes_model import MODES, RECORD, Size, Stack, gather_output, mode_dims, shard
from _tp_modes_model import split_input as split_part
from bench_common import goal, machine, markdown_table, write_json
from torch import nn

from colossal.core.testing import spawn

E = 4


class Config:
    """One mode at this world size: its model, input part, output gradient part, optimizer."""

    def __init__(self, mode: str, world: int, plain: Stack, x: torch.Tensor, dy: torch.Tensor):
        self.mode = mode
        self.dims = mode_dims(mode, world)
        self.model = shard(plain, mode, self.dims)
        self.x = split_part(x, mode, self.dims).detach().requires_grad_()
        self.dy = split_part(dy, mode, self.dims).detach()
        self.optim = torch.optim.SGD(self.model.parameters(), lr=1e-3)

    def step(self) -> None:
        """One training step."""
        self.optim.zero_grad(set_to_none=True)
        self.x.grad = None
        self.model(self.x).backward(self.dy)
        self.optim.step()


def _param_bytes(model: nn.Module) -> int:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() * p.element_size() for p in params)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for the backward of one forward (parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.device.type != "meta":
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    del y
    return sum(storages.values())


def _span(fn: Any) -> float:
    """Wall time of ``fn()`` from the first rank's start to the last rank's end."""
    from colossal.core.comm import all_gather_object, barrier

    barrier()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    spans = all_gather_object((t0, t1))
    return max(e for _, e in spans) - min(s for s, _ in spans)


def _measure(cfg: Config, plain: Stack, x: torch.Tensor, size: Size, world: int) -> dict[str, Any]:
    from colossal.core import CommTracker
    from colossal.core.comm import all_gather_object
    from colossal.core.testing import relative_error

    with RECORD:
        out = cfg.model(cfg.x)
    act = sum(numel for _, numel in RECORD.items) * E
    whole = gather_output(out.detach(), cfg.mode, cfg.dims)
    with torch.no_grad():
        error = relative_error(whole, plain(x))
    saved = _saved_bytes(cfg.model, cfg.x)
    with CommTracker() as tracker:
        cfg.step()
    summary = {
        kind: {ranks: (s.calls, s.nbytes) for ranks, s in groups.items()}
        for kind, groups in tracker.summary().items()
    }
    sent, steps = wire_bytes(summary)
    mine = (tracker.bytes(), tracker.calls(), _param_bytes(cfg.model), act, saved, sent, steps)
    every = all_gather_object(mine)
    return {
        "world": world,
        "mode": cfg.mode,
        "output_rel_error": error,
        "param_bytes": max(r[2] for r in every),
        "param_formula": param_elems(cfg.mode, size, world) * E,
        "act_bytes": max(r[3] for r in every),
        "act_formula": activation_elems(cfg.mode, size, world) * E,
        "saved_bytes": max(r[4] for r in every),
        "comm_bytes": every[0][0],
        "comm_bytes_all_ranks": sorted({r[0] for r in every}),
        "comm_calls": every[0][1],
        "comm_formula": comm_bytes(cfg.mode, size, world),
        "wire_bytes": max(r[5] for r in every),
        "ring_steps": max(r[6] for r in every),
    }


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Build every mode of this world size, measure it, time the modes in alternating rounds."""
    size: Size = args.size
    plain = Stack(size)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(size.batch, size.seq, size.hidden, generator=gen)
    dy = torch.randn(size.batch, size.seq, size.hidden, generator=gen)
    configs = [Config(mode, world, plain, x, dy) for mode, w in MODES if w == world]
    rows = [_measure(cfg, plain, x, size, world) for cfg in configs]
    if rank == 0:
        saved_plain = _saved_bytes(plain, x.clone().requires_grad_())
        for row in rows:
            row["saved_plain_bytes"] = saved_plain
    for _ in range(args.warmup):
        for cfg in configs:
            cfg.step()
    times: dict[str, list[float]] = {cfg.mode: [] for cfg in configs}
    for r in range(args.rounds):
        for cfg in configs if r % 2 == 0 else configs[::-1]:
            times[cfg.mode].append(_span(cfg.step))
    for row in rows:
        row["steps_ms"] = [round(t * 1e3, 1) for t in times[row["mode"]]]
        row["step_ms"] = statistics.median(times[row["mode"]]) * 1e3
        base = times["1d"]
        row["vs_1d"] = statistics.median(
            t / b for t, b in zip(times[row["mode"]], base, strict=True)
        )
    return rows if rank == 0 else []


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.3f}"


def _tables(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The memory table and the communication / time table, in markdown."""
    gbps, lat = args.gpu_gbps * 1e9, args.gpu_latency_us * 1e-6
    memory, comm = [], []
    for r in rows:
        base = next(b for b in rows if b["world"] == r["world"] and b["mode"] == "1d")
        r["gpu_comm_ms"] = (r["wire_bytes"] / gbps + r["ring_steps"] * lat) * 1e3
        base_ms = (base["wire_bytes"] / gbps + base["ring_steps"] * lat) * 1e3
        memory.append(
            {
                "world": r["world"],
                "mode": r["mode"],
                "param MiB/rank": _mib(r["param_bytes"]),
                "formula": _mib(r["param_formula"]),
                "ratio": f"{r['param_bytes'] / r['param_formula']:.4f}",
                "activation MiB/rank": _mib(r["act_bytes"]),
                "formula (act)": _mib(r["act_formula"]),
                "ratio (act)": f"{r['act_bytes'] / r['act_formula']:.4f}",
                "saved for backward MiB/rank": _mib(r["saved_bytes"]),
                "/ plain model's": f"{r['saved_bytes'] / r['saved_plain_bytes']:.3f}",
                "1/P": f"{1 / r['world']:.3f}",
                "output rel. error": f"{r['output_rel_error']:.1e}",
            }
        )
        comm.append(
            {
                "world": r["world"],
                "mode": r["mode"],
                "comm bytes/step": r["comm_bytes"],
                "formula": r["comm_formula"],
                "ratio": f"{r['comm_bytes'] / r['comm_formula']:.4f}",
                "collectives": r["comm_calls"],
                "step ms (median)": f"{r['step_ms']:.1f}",
                "vs 1D": f"{r['vs_1d']:.2f}",
                "GPU est.: sent MiB/rank": _mib(r["wire_bytes"]),
                "sent vs 1D": f"{r['wire_bytes'] / base['wire_bytes']:.2f}",
                "ring steps": r["ring_steps"],
                "comm ms": f"{r['gpu_comm_ms']:.2f}",
                "comm ms vs 1D": f"{r['gpu_comm_ms'] / base_ms:.2f}",
            }
        )
    return markdown_table(memory, list(memory[0])) + "\n\n" + markdown_table(comm, list(comm[0]))


def _gpu_note(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """What a GPU cluster would see, from the bytes and ring steps of each mode."""
    parts = []
    for r in rows:
        if r["mode"] == "1d":
            continue
        base = next(b for b in rows if b["world"] == r["world"] and b["mode"] == "1d")
        parts.append(
            f"{r['mode']} (world {r['world']}) sends {r['wire_bytes'] / base['wire_bytes']:.2f}x "
            f"1D's bytes per rank in {r['ring_steps'] / base['ring_steps']:.1f}x the ring steps "
            f"({r['comm_calls']} collectives vs {base['comm_calls']})"
        )
    return (
        f"\nGPU estimate (ring algorithms, {args.gpu_gbps:g} GB/s per rank, "
        f"{args.gpu_latency_us:g} us per ring step): every mode computes 1/P of the FLOPs per "
        "rank, so communication is what differs. " + "; ".join(parts) + ". Each 2D/2.5D/3D "
        "layer moves activation terms that shrink with q (n*h/q, n*h/(d*q), n*h/q^2) plus "
        "weight terms that do not depend on the batch, while 1D all-reduces whole activations "
        "(n*h): the larger batch*seq is against hidden, the more 2.5D/3D gain over 1D in bytes; "
        "their more numerous collectives add a latency per ring step, which at small sizes is "
        "most of their estimated time (compare 'comm ms' with 'sent MiB/rank')."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="divisible by 4 (2.5D and 3D rows)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per mode (>= 3)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    parser.add_argument("--gpu-gbps", type=float, default=100.0, help="GB/s one rank sends")
    parser.add_argument("--gpu-latency-us", type=float, default=10.0, help="per ring step")
    parser.add_argument("--json", help="write results as JSON to this path")
    args = parser.parse_args()
    if args.rounds < 3:
        raise ValueError(f"--rounds must be >= 3, got {args.rounds}")
    if args.batch % 4 or args.hidden % args.heads or args.heads % 8:
        raise ValueError(
            f"--batch ({args.batch}) must divide by 4 and --heads ({args.heads}) by 8 (1D at "
            f"world 8 splits the heads, 2D-3D the head columns), and --hidden "
            f"({args.hidden}) by --heads"
        )
    args.size = Size(args.hidden, args.heads, args.layers, args.batch, args.seq)

    start = time.time()
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        rows += spawn(worker, world, args=(args,), timeout=3600)[0]
    elapsed = time.time() - start
    s = args.size
    print(
        f"\ntensor parallel modes: {s.layers} blocks, hidden {s.hidden}, {s.heads} heads, MLP "
        f"{s.ffn}, batch {s.batch} x {s.seq}, fp32, gloo CPU, 1 thread/rank, SGD, "
        f"{args.rounds} timed rounds, {elapsed:.0f} s\n"
    )
    print(_tables(rows, args))
    print(_gpu_note(rows, args))
    goals = []
    for r in rows:
        tag = f"world {r['world']} {r['mode']}"
        for what, got, want in (
            ("param bytes/rank", r["param_bytes"], r["param_formula"]),
            ("activation bytes/rank", r["act_bytes"], r["act_formula"]),
        ):
            ratio = got / want
            goals.append(
                goal(
                    f"{tag}: {what} / formula",
                    round(ratio, 4),
                    "within 5 %",
                    abs(ratio - 1) <= 0.05,
                )
            )
        equal = r["comm_bytes_all_ranks"] == [r["comm_formula"]]
        goals.append(
            goal(
                f"{tag}: comm bytes/step on every rank (formula {r['comm_formula']})",
                r["comm_bytes"],
                "== formula",
                equal,
            )
        )
        goals.append(
            goal(
                f"{tag}: gathered output vs plain model (relative)",
                r["output_rel_error"],
                "<= 1e-5",
                r["output_rel_error"] <= 1e-5,
            )
        )
    print("\n| goal | value | target | met |\n|---|---:|---|---|")
    for g in goals:
        print(f"| {g['name']} | {g['value']} | {g['target']} | {'yes' if g['met'] else 'NO'} |")
    print(f"\nmachine: {machine()}")
    write_json(args.json, "tensor_parallel_modes", rows, goals)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
