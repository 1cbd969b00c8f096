r"""One benchmark configuration on every rank; started by torchrun from ``colossal benchmark``.

Usage (internal)::

    python -m torch.distributed.run --nproc_per_node N -m colossal.cli.bench.worker \\
        --config '{"name": ..., "plugin": ...}' --out result.json --steps 5 ...

Rank 0 writes the result JSON to ``--out``; a rank that fails writes ``<out>.rank<r>.err``
(JSON with ``status`` and ``error``) and exits 1, so the parent can say why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from colossal.cli.bench.configs import BenchConfig
from colossal.cli.bench.gpt import gpt_config
from colossal.cli.bench.measure import TorchCommCounter, model_state_bytes
from colossal.cli.bench.workload import build_model, data_replica, make_step, mean_over_holders
from colossal.core import CommTracker, get_accelerator, launch_from_torch

__all__ = ["main", "run_config"]


def _is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(exc, oom_type)) or "out of memory" in str(exc)


def _build_booster(cfg: BenchConfig) -> Any:
    import colossal.booster.plugin as plugins
    from colossal.booster import Booster

    plugin_cls = getattr(plugins, cfg.plugin)
    return Booster(plugin=plugin_cls(**cfg.plugin_kwargs), mixed_precision=cfg.mixed_precision)


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _comm_device() -> torch.device:
    return get_accelerator().get_current_device()


def run_config(cfg: BenchConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` measured steps (after ``args.warmup``) and measure them."""
    accel = get_accelerator()
    device = accel.get_current_device()
    world = dist.get_world_size()
    model_cfg = gpt_config(args.model_size, args.seq_len)
    torch.manual_seed(0)
    model = build_model(cfg, model_cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    booster = _build_booster(cfg)
    counter = TorchCommCounter()
    with counter.patched():
        model, optimizer, *_ = booster.boost(model, optimizer)
        ddp_hooked = counter.watch_ddp(model)
        train_step = make_step(cfg, booster, model, optimizer)
        # The same global batch in every row: each data-parallel replica draws its share.
        replica, replicas = data_replica(booster.plugin)
        gen = torch.Generator().manual_seed(1234 + replica)
        shape = (args.batch_size * world // replicas, args.seq_len + 1)
        times: list[float] = []
        peak_state = 0
        source = "tensors"
        tracker = CommTracker()
        loss_value: float | None = None
        for step in range(args.warmup + args.steps):
            measured = step >= args.warmup
            tokens = torch.randint(0, model_cfg.vocab_size, shape, generator=gen).to(device)
            counter.active = measured
            accel.synchronize()
            start = time.perf_counter()
            with tracker if measured else contextlib.nullcontext():
                loss = train_step(tokens)  # None off a pipeline's last stage
                optimizer.step()
            accel.synchronize()
            elapsed = time.perf_counter() - start
            counter.active = False
            if measured:
                times.append(elapsed)
                state, source = model_state_bytes(model, optimizer)
                peak_state = max(peak_state, state)
            optimizer.zero_grad()
            loss_value = None if loss is None else float(loss.detach().float().item())
    loss_value = mean_over_holders(loss_value, _comm_device())
    if not math.isfinite(loss_value):
        raise FloatingPointError(f"the loss is {loss_value} after {args.steps} steps")
    step_time = _max_over_ranks(statistics.median(times))
    colossal_bytes = tracker.bytes() / args.steps
    torch_bytes = counter.nbytes / args.steps
    if colossal_bytes > 0:
        comm, comm_source = colossal_bytes, "colossal.core.comm"
    elif torch_bytes > 0:
        comm, comm_source = torch_bytes, "torch ddp hook" if ddp_hooked else "torch.distributed"
    else:
        comm, comm_source = None, "not tracked"
    return {
        **cfg.to_dict(),
        "status": "ok",
        "world_size": world,
        "accelerator": accel.name,
        "model_params": model_cfg.num_params(),
        "step_time_s": step_time,
        "tokens_per_s": args.batch_size * args.seq_len * world / step_time,
        "peak_model_state_bytes": int(_max_over_ranks(peak_state)),
        "memory_source": source,
        "comm_bytes_per_step": None if comm is None else int(_max_over_ranks(comm)),
        "comm_source": comm_source,
        "final_loss": loss_value,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="colossal.cli.bench.worker")
    p.add_argument("--config", required=True, help="BenchConfig as JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> NoReturn:
    """Run one configuration under torchrun, then end the process (exit code 0 or 1)."""
    args = _parse(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = BenchConfig.from_dict(json.loads(args.config))
        launch_from_torch(verbose=False)
        result = run_config(cfg, args)
        if rank == 0:
            with open(args.out + ".tmp", "w", encoding="utf-8") as f:
                json.dump(result, f)
            os.replace(args.out + ".tmp", args.out)
        dist.barrier()
        dist.destroy_process_group()
        # The result is on disk: skip interpreter finalization, where gloo threads that still
        # hold tensors can abort a finished process (SIGABRT, "terminate called ...").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a report row
        status = "oom" if _is_oom(exc) else "failed"
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        with open(f"{args.out}.rank{rank}.err", "w", encoding="utf-8") as f:
            json.dump({"status": status, "error": error, "rank": rank}, f)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # do not wait in collectives the failed rank will never join


if __name__ == "__main__":
    main()
