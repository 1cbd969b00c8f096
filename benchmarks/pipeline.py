"""Pipeline schedules: colossal.pipeline vs torch.distributed.pipelining, and simulator accuracy.

A 4-stage stack of transformer encoder layers on 4 gloo CPU processes, trained with 8 and 16
microbatches. In one run, per configuration, alternating step by step:

* colossal ``OneForwardOneBackwardSchedule`` vs torch ``Schedule1F1B`` (8 layers, 2 per stage);
* colossal ``InterleavedSchedule`` vs torch ``ScheduleInterleaved1F1B`` (8 layers, 2 chunks of
  one layer per stage).

Both see the same layers, weights and data (their gradients are compared). Reported: median
step time (first rank's start to last rank's end) of each and their ratio (goal <= 1.0), the
CPU time per step summed over ranks, and the measured bubble fraction of the colossal run
(1 - compute time / (4 x the schedule's window)) next to the simulator's prediction (goal:
within 10 %, relative).

The prediction replays each timed step's schedule IR with that step's measured per-action
costs: every compute action's duration, the time each stage spent posting each transfer and
unpacking each receive that had already arrived, and per message the delay from posting a
send to the waiting receiver getting it. It tests that the IR and the simulator's model
(asynchronous sends, receives waited for at their use) match what the executor does. The
"uncontended model" column predicts from costs measured with one rank running at a time
instead, on ``min(cores, 4)`` shared processors; on a machine shared with other work (or
with fewer cores than ranks) that one is far off, and the replay is the meaningful check.

Usage::

    python3 benchmarks/pipeline.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from colossal.core import ProcessGroupMesh
from colossal.core.comm import all_gather_object, barrier
from colossal.core.testing import spawn
from colossal.pipeline import (
    ActionCosts,
    ActionType,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineP2P,
    PipelineStageManager,
    render_text,
    save_png,
    simulate,
)

WORLD = 4


def build_layers(args: argparse.Namespace) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.TransformerEncoderLayer(
            args.dim, args.heads, 4 * args.dim, dropout=0.0, batch_first=True, norm_first=True
        )
        for _ in range(args.layers)
    )


def criterion(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return ((out - batch.flip(-1)) ** 2).mean()


def torch_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _timed(fn) -> tuple[float, float, float]:
    barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    return t0, time.perf_counter(), time.process_time() - c0


def _span(t0: float, t1: float, cpu: float) -> tuple[float, float]:
    """Wall time from the first rank's start to the last rank's end, and CPU time of all ranks."""
    spans = all_gather_object((t0, t1, cpu))
    return max(e for _, e, _ in spans) - min(s for s, _, _ in spans), sum(c for _, _, c in spans)


def link_costs(
    sm: PipelineStageManager, shape: tuple[int, ...], reps: int = 20
) -> tuple[float, float]:
    """(time to post one activation-sized send, one-way delay) between stages 0 and 1.

    The delay is half a ping-pong round trip through PipelineP2P minus the posting time.
    """
    p2p = PipelineP2P(sm.pp_group)
    x = torch.randn(*shape)
    peer = sm.get_rank(1 - sm.stage) if sm.stage < 2 else None
    post = []
    barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        if sm.stage == 0:
            a = time.perf_counter()
            p2p.send(x, peer, tag=99)
            post.append(time.perf_counter() - a)
            p2p.recv(peer, tag=99)
        elif sm.stage == 1:
            p2p.send(p2p.recv(peer, tag=99), peer, tag=99)
    p2p.wait_all()
    rtt = (time.perf_counter() - t0) / reps
    send_cost = statistics.median(post) if post else 0.0
    return all_gather_object((send_cost, max(0.0, rtt / 2 - send_cost)))[0]


def calibrate(sm: PipelineStageManager, chunks: list[nn.Module], shape: tuple[int, ...], reps: int):
    """Uncontended forward / backward time of each chunk, one stage at a time.

    Returns, for every stage, ``{(chunk, ActionType): seconds}`` (medians of ``reps``).
    """
    table: dict[tuple[int, ActionType], float] = {}
    for s in range(sm.num_stages):
        barrier()
        if sm.stage != s:
            continue
        for c, mod in enumerate(chunks):
            fwd, bwd = [], []
            for _ in range(reps + 1):
                x = torch.randn(*shape, requires_grad=True)
                a = time.perf_counter()
                out = mod(x)
                b = time.perf_counter()
                out.backward(torch.ones_like(out))
                fwd.append(b - a)
                bwd.append(time.perf_counter() - b)
            table[(c, ActionType.FORWARD)] = statistics.median(fwd[1:])
            table[(c, ActionType.BACKWARD)] = statistics.median(bwd[1:])
            mod.zero_grad(set_to_none=True)
    barrier()
    return all_gather_object(table)


def measured_costs(timelines: list[list], num_stages: int) -> list[ActionCosts]:
    """Mean forward and backward time per stage in the pipelined run (over chunks and steps)."""
    per: dict[tuple[int, ActionType], list[float]] = defaultdict(list)
    for events in timelines:
        for e in events:
            per[(e.stage, e.action.type)].append(e.duration)
    return [
        ActionCosts(
            forward=statistics.mean(per[(s, ActionType.FORWARD)]),
            backward=statistics.mean(per[(s, ActionType.BACKWARD)]),
        )
        for s in range(num_stages)
    ]


def replay_costs(steps: list[tuple[list, list, list]], ir) -> tuple:
    """Per-action costs measured in the run, for the simulator.

    ``steps`` holds, per timed step, every rank's compute, posting and receive-wait events.
    Returns ``cost(stage, action)``: the mean duration of that compute action, or the time
    spent posting that transfer (plus, for a receive whose data had already arrived, the time
    spent taking it); ``delay(stage, send)``: the mean time from the end of posting
    a send to the receiver getting the data, over the steps where the receiver was already
    waiting (else the median of all such delays); and that median.
    """
    from colossal.pipeline.simulate import message_key

    durations: dict[tuple[int, object], list[float]] = defaultdict(list)
    delays: dict[tuple, list[float]] = defaultdict(list)
    unpack: dict[tuple[int, object], list[float]] = defaultdict(list)
    for compute, posting, waits in steps:
        posted = {}
        for e in [*compute, *posting]:
            durations[(e.stage, e.action)].append(e.duration)
            if e.action.type in (ActionType.SEND_FORWARD, ActionType.SEND_BACKWARD):
                posted[message_key(ir, e.stage, e.action)] = e.end
        for e in waits:
            key = message_key(ir, e.stage, e.action)
            if key in posted and e.start <= posted[key]:
                delays[key].append(e.end - posted[key])
            else:  # the data was there already: the "wait" is unpacking work of this stage
                unpack[(e.stage, e.action)].append(e.duration)
    mean = {k: statistics.mean(v) for k, v in durations.items()}
    for k, v in unpack.items():
        mean[k] = mean.get(k, 0.0) + statistics.mean(v)
    fallback = statistics.median([d for v in delays.values() for d in v] or [0.0])
    delay_of = {k: statistics.mean(v) for k, v in delays.items()}

    def cost(stage: int, action) -> float:
        return mean.get((stage, action), 0.0)

    def delay(stage: int, action) -> float:
        return delay_of.get(message_key(ir, stage, action), fallback)

    return cost, delay, fallback


def runners(schedule, ours: list[nn.Module], ref, theirs: list[nn.Module], stage: int, x):
    """One training step of colossal's schedule and of torch's, on the same data."""

    def run_ours() -> None:
        for mod in ours:
            mod.zero_grad(set_to_none=True)
        schedule.forward_backward_step(ours if len(ours) > 1 else ours[0], iter([x]), criterion)

    def run_theirs() -> None:
        for mod in theirs:
            mod.zero_grad(set_to_none=True)
        if stage == 0:
            ref.step(x)
        elif stage == WORLD - 1:
            ref.step(target=x.flip(-1))
        else:
            ref.step()

    return run_ours, run_theirs


def worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    device = torch.device("cpu")
    rows = []
    for kind in ("1f1b", "interleaved"):
        chunks = 1 if kind == "1f1b" else 2
        sm = PipelineStageManager(mesh, "pp", enable_interleave=chunks > 1, num_model_chunks=chunks)
        layers = build_layers(args)
        ranges = sm.get_stage_index(sm.distribute_layers(len(layers)))
        ranges = [ranges] if chunks == 1 else ranges
        ours = [nn.Sequential(*layers[a:b]) for a, b in ranges]
        theirs = [copy.deepcopy(m) for m in ours]
        shape = (args.mbs, args.seq, args.dim)
        send_cost, latency = link_costs(sm, shape)
        solo = calibrate(sm, ours, shape, reps=5)
        cores = len(os.sched_getaffinity(0))

        def cost(stage: int, action, solo=solo, send_cost=send_cost) -> float:
            if action.type.is_compute:
                return solo[stage][(action.chunk, action.type)]
            return send_cost

        for m in args.microbatches:
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m * args.mbs, args.seq, args.dim, generator=gen)
            if kind == "1f1b":
                schedule = OneForwardOneBackwardSchedule(
                    sm, num_microbatches=m, record_timeline=True
                )
                stage = PipelineStage(theirs[0], sm.stage, WORLD, device)
                ref = Schedule1F1B(stage, m, loss_fn=torch_loss)
            else:
                schedule = InterleavedSchedule(sm, 2, num_microbatches=m, record_timeline=True)
                stages = [
                    PipelineStage(mod, sm.layout.slice_of(sm.stage, c), WORLD * chunks, device)
                    for c, mod in enumerate(theirs)
                ]
                ref = ScheduleInterleaved1F1B(stages, m, loss_fn=torch_loss)

            run_ours, run_theirs = runners(schedule, ours, ref, theirs, sm.stage, x)

            for _ in range(args.warmup):
                run_ours()
                run_theirs()
            # same gradients as torch's schedule (a sanity check on what is being timed)
            err = max(
                float((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30))
                for a, b in zip(ours, theirs, strict=True)
                for p, q in zip(a.parameters(), b.parameters(), strict=True)
            )
            ours_t, theirs_t, bubbles, spans, timelines, comm_timelines = [], [], [], [], [], []
            ours_cpu, theirs_cpu = [], []
            for _ in range(args.steps):
                span, cpu = _span(*_timed(run_ours))
                ours_cpu.append(cpu)
                events = all_gather_object(
                    (
                        schedule.last_timeline,
                        schedule.last_comm_timeline,
                        schedule.last_wait_timeline,
                    )
                )
                flat = [e for rank_events, _, _ in events for e in rank_events]
                comm = [e for _, rank_events, _ in events for e in rank_events]
                waits = [e for _, _, rank_events in events for e in rank_events]
                busy = sum(e.duration for e in flat)
                ours_t.append(span)
                # the schedule's own window: first action to last (no barrier skew, no setup)
                window = max(e.end for e in [*flat, *comm, *waits]) - min(
                    e.start for e in [*flat, *comm, *waits]
                )
                bubbles.append(1 - busy / (WORLD * window))
                spans.append(span)
                timelines.append(flat)
                comm_timelines.append((comm, waits))
                span_theirs, cpu_theirs = _span(*_timed(run_theirs))
                theirs_t.append(span_theirs)
                theirs_cpu.append(cpu_theirs)
            ir = schedule.get_ir(m)
            costs = measured_costs(timelines, WORLD)
            # replay every timed step with that step's measured action costs and link delays
            sims, typical = [], []
            for compute, (comm, waits) in zip(timelines, comm_timelines, strict=True):
                run_cost, run_delay, typical_delay = replay_costs([(compute, comm, waits)], ir)
                sims.append(simulate(ir, run_cost, comm=run_delay))
                typical.append(typical_delay)
            model = simulate(ir, cost, comm=latency, processors=min(cores, WORLD))
            errs = all_gather_object(err)
            rows.append(
                {
                    "schedule": kind,
                    "microbatches": m,
                    "colossal_step_s": statistics.median(ours_t),
                    "torch_step_s": statistics.median(theirs_t),
                    "ratio": statistics.median(ours_t) / statistics.median(theirs_t),
                    "colossal_cpu_s": statistics.median(ours_cpu),
                    "torch_cpu_s": statistics.median(theirs_cpu),
                    "measured_bubble": statistics.median(bubbles),
                    "predicted_bubble": statistics.median(r.bubble_fraction for r in sims),
                    "predicted_step_s": statistics.median(r.step_time for r in sims),
                    "measured_step_s": statistics.median(spans),
                    "in_run_link_delay_ms": statistics.median(typical) * 1e3,
                    "uncontended_model_bubble": model.bubble_fraction,
                    "uncontended_model_step_s": model.step_time,
                    "comm_one_way_ms": latency * 1e3,
                    "send_post_ms": send_cost * 1e3,
                    "processors": min(cores, WORLD),
                    "solo_forward_ms": [
                        round(
                            sum(v for (_, t), v in tab.items() if t == ActionType.FORWARD) * 1e3, 3
                        )
                        for tab in solo
                    ],
                    "solo_backward_ms": [
                        round(
                            sum(v for (_, t), v in tab.items() if t == ActionType.BACKWARD) * 1e3, 3
                        )
                        for tab in solo
                    ],
                    "forward_ms": [round(c.forward * 1e3, 3) for c in costs],
                    "backward_ms": [round(c.backward * 1e3, 3) for c in costs],
                    "max_grad_rel_diff_vs_torch": max(errs),
                    "_timeline": timelines[len(timelines) // 2],
                }
            )
    return rows if rank == 0 else []


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": "gloo",
        "processes": WORLD,
        "threads_per_process": 1,
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under two minutes)")
    parser.add_argument("--json", type=Path, help="write results as JSON to this path")
    parser.add_argument("--png", type=Path, help="draw the measured 1F1B timeline (matplotlib)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--mbs", type=int, default=2, help="samples per microbatch")
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    args.microbatches = [8, 16]
    args.warmup, args.steps = (2, 5) if args.quick else (3, 15)

    start = time.time()
    info = machine()
    rows = spawn(worker, WORLD, args=(args,), timeout=1800)[0]
    elapsed = time.time() - start

    goals = []
    for r in rows:
        name = f"{r['schedule']} M={r['microbatches']}"
        goals.append(
            {
                "name": f"{name}: step time vs torch",
                "value": round(r["ratio"], 3),
                "target": "<= 1.0",
                "met": r["ratio"] <= 1.0,
            }
        )
        rel = abs(r["measured_bubble"] - r["predicted_bubble"]) / max(r["measured_bubble"], 1e-9)
        goals.append(
            {
                "name": f"{name}: simulated vs measured bubble (relative difference)",
                "value": round(rel, 3),
                "target": "<= 0.10",
                "met": rel <= 0.10,
            }
        )

    print(
        f"\npipeline benchmark: 4-stage stack of {args.layers} transformer layers "
        f"(dim {args.dim}, seq {args.seq}, microbatch {args.mbs}), 4 gloo CPU ranks, "
        f"{args.steps} timed steps, {elapsed:.0f} s\n"
    )
    print(
        "| schedule | M | colossal step (ms) | torch step (ms) | ratio | CPU/step colossal "
        "(ms) | CPU/step torch (ms) | measured bubble | simulated bubble | uncontended model "
        "bubble | in-run F/B per stage (ms) | link delay (ms) | grad diff vs torch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        run = " ".join(
            f"{f:.1f}/{b:.1f}" for f, b in zip(r["forward_ms"], r["backward_ms"], strict=True)
        )
        print(
            f"| {r['schedule']} | {r['microbatches']} | {r['colossal_step_s'] * 1e3:.1f} | "
            f"{r['torch_step_s'] * 1e3:.1f} | {r['ratio']:.3f} | {r['colossal_cpu_s'] * 1e3:.0f} | "
            f"{r['torch_cpu_s'] * 1e3:.0f} | {r['measured_bubble']:.3f} | "
            f"{r['predicted_bubble']:.3f} | {r['uncontended_model_bubble']:.3f} | {run} | "
            f"{r['in_run_link_delay_ms']:.2f} | {r['max_grad_rel_diff_vs_torch']:.1e} |"
        )
    print("\n| goal | value | target | met |\n|---|---:|---|---|")
    for g in goals:
        print(f"| {g['name']} | {g['value']} | {g['target']} | {'yes' if g['met'] else 'NO'} |")
    first = rows[0]
    print(f"\nmeasured timeline, {first['schedule']} M={first['microbatches']} (one step):")
    print(render_text(first["_timeline"], width=100))
    if args.png:
        written = save_png(first["_timeline"], args.png, title="colossal 1F1B, measured")
        print(f"PNG timeline: {written}" if written else "PNG timeline skipped (no matplotlib)")
    if args.json:
        payload = {
            "benchmark": "pipeline",
            "machine": info,
            "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
            "goals": goals,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"\nwrote {args.json}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
