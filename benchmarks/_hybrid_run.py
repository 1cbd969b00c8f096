"""The configurations of ``benchmarks/hybrid.py`` and the per-rank worker that times them.

Every configuration is a trainer with one ``step(global_batch)`` (zero_grad, forward, loss,
backward, ``AdamW.step``) that records this rank's time per phase, and a ``memory()`` of the
model states it holds (parameters, gradients, optimizer states; read after a backward).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _hybrid_peers import (
    LR,
    TorchPipeline,
    build_model,
    dp_rows,
    global_batch,
    local,
    model_state_bytes,
    torch_tp_dp,
)

# --------------------------------------------------------------------------------------------
# time spent inside Colossal's communication helpers (instrumentation of this process only)


class CommTimer:
    """Seconds this process spends inside ``colossal.core.comm``'s helpers, per kind and group.

    Every helper runs its collective (and every ``CommWork.wait``) inside ``comm_guard``; the
    benchmark wraps that context manager to add the time of the outermost one to a counter.
    It includes waiting for the other ranks (a slower peer shows up as communication) and,
    for an asynchronous collective, only the posting and the final wait.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.active = False
        self.by_key: dict[tuple[str, tuple[int, ...]], float] = {}
        self._local = threading.local()

    def install(self) -> bool:
        """Wrap ``comm_guard`` where the helpers look it up; False if that layout changed."""
        try:
            from colossal.core.comm import errors, ops, sharded

            original = errors.comm_guard
            if ops.comm_guard is not original or sharded.comm_guard is not original:
                return False
        except (ImportError, AttributeError):
            return False
        timer = self

        @contextlib.contextmanager
        def timed_guard(kind: str, group_ranks: tuple[int, ...]) -> Iterator[None]:
            depth = getattr(timer._local, "depth", 0)
            timer._local.depth = depth + 1
            start = time.perf_counter()
            try:
                with original(kind, group_ranks):
                    yield
            finally:
                timer._local.depth = depth
                if depth == 0:
                    took = time.perf_counter() - start
                    timer.seconds += took
                    key = (kind, tuple(group_ranks))
                    timer.by_key[key] = timer.by_key.get(key, 0.0) + took

        ops.comm_guard = timed_guard
        sharded.comm_guard = timed_guard
        return True

    def snapshot(self) -> dict[tuple[str, tuple[int, ...]], float]:
        """A copy of the per-(kind, group) seconds so far."""
        return dict(self.by_key)


def axis_of(ranks: tuple[int, ...], inner: str) -> str:
    """The axis of a group of the 2 x 2 layout: pairs ``{2k, 2k+1}`` are ``inner``, ``{r, r+2}``
    are ``dp`` (tp / pp innermost, as ``ParallelDims`` orders them), four ranks the world."""
    if len(ranks) == 4:
        return "world"
    if len(ranks) == 2:
        return inner if ranks[1] - ranks[0] == 1 else "dp"
    return "other"


COMM = CommTimer()


# --------------------------------------------------------------------------------------------
# the trainers


class Trainer:
    """One configuration on this rank."""

    name = ""
    layout = ""
    phase_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.key = ""  # the configuration's key in the rows
        self.first_loss: float | None = None
        self.phases: list[dict[str, float]] = []
        self.steps = 0
        self.last_memory: dict[str, int] = {}

    def step(self, ids: torch.Tensor, measure: bool = False) -> float | None:
        """One step on the global batch ``ids``; this rank's loss (or None).

        ``measure``: read the model-state memory after the backward (outside the phases).
        """
        raise NotImplementedError

    def _record(
        self, marks: list[float], comm: float, before: dict[Any, float] | None = None
    ) -> None:
        pairs = zip(self.phase_names, marks[:-1], marks[1:], strict=True)
        durations = {n: b - a for n, a, b in pairs}
        durations["comm"] = comm
        if before is not None:  # ours: communication per kind and axis
            inner = "tp" if self.layout.startswith("TP") else "pp"
            for (kind, ranks), secs in COMM.by_key.items():
                took = secs - before.get((kind, ranks), 0.0)
                if took > 0:
                    name = f"comm {kind} {axis_of(ranks, inner)}"
                    durations[name] = durations.get(name, 0.0) + took
        self.phases.append(durations)
        self.steps += 1


class OursTP(Trainer):
    """``HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1, precision="fp32")``."""

    name = "colossal"
    layout = "TP2xDP2"
    phase_names = ("forward", "backward", "optimizer")

    def __init__(self, size: dict[str, int], **options: Any) -> None:
        super().__init__()
        from colossal.booster import Booster
        from colossal.booster.plugin import HybridParallelPlugin

        plugin = HybridParallelPlugin(
            tp_size=2, pp_size=1, zero_stage=1, precision="fp32", **options
        )
        model = build_model(size)
        self.booster = Booster(plugin=plugin)
        self.model, self.optim, *_ = self.booster.boost(
            model, torch.optim.AdamW(model.parameters(), lr=LR)
        )
        self.dp_rank, self.dp_size = plugin.parallel_dims.coordinate("dp"), plugin.dp_size

    def step(self, ids: torch.Tensor, measure: bool = False) -> float | None:
        mine = dp_rows(ids, self.dp_rank, self.dp_size)
        c0, before = COMM.seconds, COMM.snapshot()
        t0 = time.perf_counter()
        self.optim.zero_grad()
        loss = self.model(input_ids=mine, labels=mine, use_cache=False).loss
        t1 = time.perf_counter()
        self.booster.backward(loss, self.optim)
        t2 = time.perf_counter()
        if measure:
            self.last_memory = self.optim.memory_report().as_dict()
            t2 = time.perf_counter()
        self.optim.step()
        self._record([t0, t1, t2, time.perf_counter()], COMM.seconds - c0, before)
        return float(loss.detach())


class TorchTP(Trainer):
    """DTensor TP over ``tp`` + FSDP2 or DDP over ``dp`` (``_hybrid_peers.torch_tp_dp``)."""

    layout = "TP2xDP2"
    phase_names = ("forward", "backward", "optimizer")

    def __init__(self, size: dict[str, int], dp_kind: str) -> None:
        super().__init__()
        self.name = f"torch DTensor TP + {'FSDP2' if dp_kind == 'fsdp2' else 'DDP'}"
        self.module, mesh = torch_tp_dp(build_model(size), dp_kind)
        self.params = list(self.module.parameters())
        self.optim = torch.optim.AdamW(self.params, lr=LR)
        self.dp_rank = mesh.get_local_rank("dp")

    def step(self, ids: torch.Tensor, measure: bool = False) -> float | None:
        from torch.distributed.tensor.parallel import loss_parallel

        mine = dp_rows(ids, self.dp_rank, 2)
        t0 = time.perf_counter()
        self.optim.zero_grad()
        with loss_parallel():
            loss = self.module(input_ids=mine, labels=mine, use_cache=False).loss
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        if measure:
            self.last_memory = model_state_bytes(self.params, self.optim)
            t2 = time.perf_counter()
        self.optim.step()
        self._record([t0, t1, t2, time.perf_counter()], 0.0)
        return float(local(loss).detach())


class OursPP(Trainer):
    """``HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=1, num_microbatches=M)``."""

    name = "colossal"
    layout = "PP2xDP2"
    phase_names = ("pipeline", "optimizer")

    def __init__(self, size: dict[str, int], microbatches: int, **options: Any) -> None:
        super().__init__()
        from colossal.booster import Booster
        from colossal.booster.plugin import HybridParallelPlugin

        plugin = HybridParallelPlugin(
            tp_size=1, pp_size=2, zero_stage=1, num_microbatches=microbatches, precision="fp32",
            **options,
        )  # fmt: skip
        model = build_model(size)
        self.booster = Booster(plugin=plugin)
        self.model, self.optim, *_ = self.booster.boost(
            model, torch.optim.AdamW(model.parameters(), lr=LR)
        )
        self.dp_rank, self.dp_size = plugin.parallel_dims.coordinate("dp"), plugin.dp_size

    def step(self, ids: torch.Tensor, measure: bool = False) -> float | None:
        mine = dp_rows(ids, self.dp_rank, self.dp_size)
        c0, before = COMM.seconds, COMM.snapshot()
        t0 = time.perf_counter()
        self.optim.zero_grad()
        out = self.booster.execute_pipeline(
            iter([{"input_ids": mine, "labels": mine}]), self.model,
            lambda o, mb: o.loss, self.optim, return_loss=True,
        )  # fmt: skip
        t1 = time.perf_counter()
        if measure:
            self.last_memory = self.optim.memory_report().as_dict()
            t1 = time.perf_counter()
        self.optim.step()
        self._record([t0, t1, time.perf_counter()], COMM.seconds - c0, before)
        loss = out.get("loss")
        return None if loss is None else float(loss.detach())


class TorchPP(Trainer):
    """``torch.distributed.pipelining`` 1F1B over ``pp`` + DDP (or an all-reduce) over ``dp``."""

    layout = "PP2xDP2"
    phase_names = ("pipeline", "optimizer")

    def __init__(self, size: dict[str, int], microbatches: int, dp_kind: str = "ddp") -> None:
        super().__init__()
        dp = "DDP" if dp_kind == "ddp" else "grad all-reduce"
        self.name = f"torch pipelining 1F1B + {dp}"
        self.pipe = TorchPipeline(build_model(size), microbatches, dp_kind)
        self.params = list(self.pipe.module.parameters())
        self.optim = torch.optim.AdamW(self.params, lr=LR)

    def step(self, ids: torch.Tensor, measure: bool = False) -> float | None:
        mine = dp_rows(ids, self.pipe.dp_rank, 2)
        t0 = time.perf_counter()
        self.optim.zero_grad()
        loss = self.pipe.run(mine)
        t1 = time.perf_counter()
        if measure:
            self.last_memory = model_state_bytes(self.params, self.optim)
            t1 = time.perf_counter()
        self.optim.step()
        self._record([t0, t1, time.perf_counter()], 0.0)
        return None if loss is None else float(loss)


# --------------------------------------------------------------------------------------------
# the worker


def _agree(ok: bool, error: str) -> str:
    """'' when every rank succeeded, else the first failing rank's message (on every rank)."""
    from colossal.core.comm import all_gather_object

    errors = all_gather_object("" if ok else error)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    return "" if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def _mean_loss(value: float | None) -> float | None:
    """Mean over the ranks that hold a loss (each data-parallel rank's rows once per tp/pp)."""
    from colossal.core.comm import all_gather_object

    values = [v for v in all_gather_object(value) if v is not None]
    return sum(values) / len(values) if values else None


def span(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """(first rank's start to last rank's end, CPU seconds of all ranks, fn's result).

    A barrier first. The CPU time is this process's (all its threads), summed over ranks.
    """
    from colossal.core.comm import all_gather_object, barrier

    barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    result = fn()
    t1 = time.perf_counter()
    spans = all_gather_object((t0, t1, time.process_time() - c0))
    wall = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
    return wall, sum(c for *_, c in spans), result


def _build(factory: Callable[[], Trainer], size: dict[str, int]) -> tuple[Trainer | None, str]:
    """Build a trainer and run its first step on batch 0 (all ranks agree on failure)."""
    trainer, error = None, ""
    try:
        trainer = factory()
        trainer.first_loss = trainer.step(global_batch(size, 0))
    except Exception as exc:  # noqa: BLE001 - a failed peer is a row, not a crash
        traceback.print_exc()
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    error = _agree(trainer is not None and not error, error)
    if error:
        return None, error
    return trainer, ""


FALLBACK = {"torch_tp_fsdp2": "torch_tp_ddp", "torch_pp_ddp": "torch_pp_allreduce"}
"""The closest working alternative to try when a peer fails."""


def _factories(layout: str, args: Any) -> dict[str, Callable[[], Trainer]]:
    """Every configuration of ``layout`` that may run (the fallbacks last)."""
    size, m = args.size, args.microbatches
    if layout == "TP2xDP2":
        return {
            "colossal": lambda: OursTP(size),
            **{f"torch_tp_{k}": (lambda k=k: TorchTP(size, k)) for k in args.tp_peers},
            "torch_tp_ddp": lambda: TorchTP(size, "ddp"),
        }
    return {
        "colossal": lambda: OursPP(size, m),
        "torch_pp_ddp": lambda: TorchPP(size, m, "ddp"),
        "torch_pp_allreduce": lambda: TorchPP(size, m, "allreduce"),
    }


def _failing(key: str) -> Callable[[], Trainer]:
    def fail() -> Trainer:
        raise RuntimeError(f"{key} made to fail (--fail)")

    return fail


def _wanted(layout: str, args: Any) -> list[str]:
    if layout == "TP2xDP2":
        return ["colossal", *(f"torch_tp_{k}" for k in args.tp_peers)]
    return ["colossal", "torch_pp_ddp"]


def _profile(trainer: Trainer, ids: torch.Tensor, rows: int, rank: int) -> str:
    """torch.profiler's top ``rows`` ops (self CPU time) of one step of ``trainer`` on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    if rank != 0:
        trainer.step(ids)
        return ""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step(ids)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def run_layout(layout: str, args: Any, rank: int) -> list[dict[str, Any]]:
    """Build, warm up and time every configuration of ``layout``; rows (every rank)."""
    from colossal.core.comm import all_gather_object

    size = args.size
    rows: list[dict[str, Any]] = []
    trainers: list[Trainer] = []
    factories = _factories(layout, args)
    todo = _wanted(layout, args)
    built: dict[str, None] = {}  # in build order
    while todo:
        key = todo.pop(0)
        if key in built:
            continue
        built[key] = None
        factory = factories[key]
        if key in getattr(args, "fail", ()):  # testing the failure path: this one raises
            factory = _failing(key)
        trainer, error = _build(factory, size)
        if trainer is None:
            rows.append({"layout": layout, "config": key, "status": f"failed: {error}"})
            if key in FALLBACK and FALLBACK[key] not in built:
                todo.append(FALLBACK[key])  # the closest working alternative
            continue
        trainer.key = key
        trainers.append(trainer)
    firsts = {t.key: _mean_loss(t.first_loss) for t in trainers}
    step = 1
    for _ in range(args.warmup - 1):  # the first step was one warm-up step
        ids = global_batch(size, step)
        for t in trainers:
            t.step(ids, measure=True)  # the last one's memory counts (Adam states exist)
        step += 1
    for t in trainers:
        t.phases.clear()
    times: dict[str, list[float]] = {t.key: [] for t in trainers}
    cpu: dict[str, list[float]] = {t.key: [] for t in trainers}
    last: dict[str, float | None] = {}
    for r in range(args.rounds):
        ids = global_batch(size, step)
        step += 1
        for t in trainers if r % 2 == 0 else trainers[::-1]:
            wall, cpu_s, loss = span(lambda t=t, ids=ids: t.step(ids))
            times[t.key].append(wall)
            cpu[t.key].append(cpu_s)
            last[t.key] = loss
    last_mean = {k: _mean_loss(v) for k, v in last.items()}
    profiles = {}
    if args.profile:
        ids = global_batch(size, step)
        profiles = {t.key: _profile(t, ids, args.profile, rank) for t in trainers}
    for t in trainers:
        phases = all_gather_object(t.phases)  # per rank, per round
        memory = all_gather_object(t.last_memory)
        per_phase = {}
        names = dict.fromkeys(n for rank in phases for rnd in rank for n in rnd)
        for name in names:
            per_round = [max(rank_phases[i].get(name, 0.0) for rank_phases in phases)
                         for i in range(len(phases[0]))]  # fmt: skip
            per_phase[f"{name}_ms"] = statistics.median(per_round) * 1e3
        if not isinstance(t, OursTP | OursPP) or not COMM.active:
            per_phase.pop("comm_ms", None)  # not measured for the peers (see --profile)
        top = max(memory, key=lambda m: m["total"])
        ts = times[t.key]
        rows.append(
            {
                "layout": layout,
                "config": t.key,
                "name": t.name,
                "status": "ok",
                "rounds": len(ts),
                "step_ms": statistics.median(ts) * 1e3,
                "min_ms": min(ts) * 1e3,
                "max_ms": max(ts) * 1e3,
                "steps_ms": [round(x * 1e3, 1) for x in ts],
                "cpu_ms": statistics.median(cpu[t.key]) * 1e3,
                "model_state_MB": top["total"] / 2**20,
                "memory_breakdown_MB": {k: round(v / 2**20, 2) for k, v in top.items()},
                "first_loss": firsts[t.key],
                "last_loss": last_mean.get(t.key),
                **per_phase,
                **({"_profile": profiles[t.key]} if profiles.get(t.key) else {}),
            }
        )
    order = list(built)
    return sorted(rows, key=lambda r: order.index(r["config"]))


def worker(rank: int, world_size: int, args: Any) -> list[dict[str, Any]]:
    """Every layout of the run, one after the other (their models freed in between)."""
    import gc

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    COMM.active = COMM.install()
    if not COMM.active and rank == 0:
        print("hybrid: comm timing unavailable (colossal.core.comm changed)", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for layout in args.layouts:
        rows += run_layout(layout, args, rank)
        gc.collect()
    return rows if rank == 0 else []
