"""The SP section of ``shardformer.py``: ours vs torch ``context_parallel``.

A Llama-style ``LlamaForCausalLM`` made attention-heavy (few layers, one long sequence) is
trained one step at a time on 4 gloo CPU ranks (one thread each), all ranks one sequence-
parallel group, in three configurations built from the same seed and fed the same batch:

* **torch CP**: ``torch.distributed.tensor.experimental.context_parallel`` (ring attention on
  SDPA, its default head-tail load balancing for the causal mask and default ``allgather``
  K/V rotation) on a 1-D ``DeviceMesh("cpu", range(4))``, torchtitan's recipe: the
  ``input_ids``, ``position_ids`` and (pre-shifted) labels are CP buffers sharded along the
  sequence; each rank runs the whole model on its tokens; the loss is
  ``sum(local token losses) / global token count`` (``num_items_in_batch``), so summing
  the gradients over the group gives the global gradient. PyTorch 2.13 ships CP's dispatch
  for the CUDA SDPA kernels only; :mod:`_shardformer_sp_cp` adds the CPU flash kernel to CP's
  own dispatch table (the ring code is PyTorch's, unchanged; see that module).
* **ours Ulysses**: ``ShardFormer(ShardConfig(enable_tensor_parallelism=False,
  enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all",
  sequence_parallel_process_group=group)).optimize(model)``; every rank gets the whole batch
  (the hidden states are split at the layer stack's entry and gathered at its exit).
* **ours ring**: the same with ``sequence_parallelism_mode="ring_attn"`` (zigzag split).

Both sides end the backward with ONE flat all-reduce (sum) of the gradients of the
parameters that saw only a sequence shard: ``SequenceParallelGradSync(model)()`` for ours,
the same flat all-reduce over all parameters for CP (every CP parameter sees a shard). A step
is ``zero_grad`` + forward + backward + gradient sync + ``AdamW.step``.

Reported: median step wall time and CPU time (summed over ranks; the machine may have fewer
cores than ranks) over >= 3 rounds in which the configurations take turns (order rotated every
round), the rounds of ``--sp-runs`` separately spawned runs pooled (see :func:`pool_runs`), the
ratio to torch CP (goal <= 0.95), the first-step loss and gradients of each next
to the unsharded model's on the same batch (fp32 tolerance: relative loss difference <= 1e-5,
every parameter's gradient within 1e-4 relative norm error), and the longest sequence each
trains within
a per-rank memory budget (peak RSS of one training step, max over ranks; goal: ours >= CP's).
Peak RSS is the kernel's ``VmHWM`` reset (``/proc/self/clear_refs``) right before the step,
measured in fresh processes for every length (memory an earlier step touched would count
otherwise) with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed tensors leave the process; the
lengths tried double from ``--sp-seq-grain`` until one does not fit, then bisect to the grain.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
from torch import nn

from colossal.core.testing import spawn

SP_FULL = {
    "hidden": 256,
    "layers": 2,
    "heads": 8,
    "kv_heads": 4,
    "intermediate": 688,
    "vocab": 2048,
    "batch": 1,
    "seq": 2048,
}
SP_QUICK = {
    "hidden": 128,
    "layers": 2,
    "heads": 4,
    "kv_heads": 4,
    "intermediate": 352,
    "vocab": 1024,
    "batch": 1,
    "seq": 512,
}
# defaults of the --sp-* options (full run, --quick)
SP_FULL_ARGS = {
    "sp_world": 4,
    "sp_runs": 3,
    "sp_memory_mb": 700,
    "sp_max_seq": 16384,
    "sp_seq_grain": 1024,
}
SP_QUICK_ARGS = {
    "sp_world": 2,
    "sp_runs": 1,
    "sp_memory_mb": 0,
    "sp_max_seq": 2048,
    "sp_seq_grain": 256,
}
CONFIGS = ("torch CP", "ours Ulysses", "ours ring")
MODES = {"ours Ulysses": "all_to_all", "ours ring": "ring_attn"}
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def build_model(size: dict[str, int], seq: int) -> nn.Module:
    """The Llama model every configuration starts from (same seed, fp32, no dropout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        intermediate_size=size["intermediate"],
        vocab_size=size["vocab"],
        max_position_embeddings=max(4096, seq),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def batch(size: dict[str, int], seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, size["vocab"], (size["batch"], seq), generator=gen)


def span(fn: Any) -> tuple[float, float]:
    """Wall time of ``fn()`` (first rank's start to last rank's end), CPU time of all ranks."""
    from colossal.core.comm import all_gather_object, barrier

    barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    spans = all_gather_object((t0, t1, time.process_time() - c0))
    return max(e for _, e, _ in spans) - min(s for s, _, _ in spans), sum(c for *_, c in spans)


def _flat_all_reduce(grads: list[torch.Tensor]) -> None:
    """Sum ``grads`` over the job in one flat all-reduce (the CP side's gradient sync)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


class _Trainer:
    """One configuration: its model, optimizer and training step."""

    def __init__(self, name: str, model: nn.Module, ids: torch.Tensor) -> None:
        self.name = name
        self.model = model
        self.ids = ids
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward_backward(self) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> float:
        """One training step; returns the global loss (the same value on every rank)."""
        self.optim.zero_grad(set_to_none=True)
        loss = self.forward_backward()
        self.optim.step()
        return float(loss)


class TorchCP(_Trainer):
    """torch ``context_parallel`` (module docstring)."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, world_size: int) -> None:
        from _shardformer_sp_cp import enable_cpu_context_parallel
        from torch.distributed.device_mesh import DeviceMesh

        super().__init__("torch CP", model, ids)
        enable_cpu_context_parallel()
        self.mesh = DeviceMesh("cpu", list(range(world_size)))
        b, s = ids.shape
        self.positions = torch.arange(s).expand(b, s).contiguous()
        self.shift_labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)
        self.num_items = int((self.shift_labels != -100).sum())

    def forward_backward(self) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed.tensor.experimental import context_parallel

        buffers = [self.ids.clone(), self.positions.clone(), self.shift_labels.clone()]
        with context_parallel(
            self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
        ):
            ids, positions, labels = buffers
            out = self.model(
                input_ids=ids,
                # an all-ones padding mask: transformers then leaves the causal mask to SDPA's
                # is_causal (as CP needs) instead of reading the head-tail positions as packed
                # sequences (position_ids with gaps and no mask = packed-sequence mask)
                attention_mask=torch.ones_like(ids),
                position_ids=positions,
                labels=labels,
                shift_labels=labels,
                num_items_in_batch=self.num_items,
                use_cache=False,
            )
            out.loss.backward()
        _flat_all_reduce([p.grad for p in self.model.parameters() if p.grad is not None])
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        return loss


class Ours(_Trainer):
    """colossal.shardformer sequence parallelism in ``mode`` (module docstring)."""

    def __init__(self, name: str, model: nn.Module, ids: torch.Tensor) -> None:
        import torch.distributed as dist

        from colossal.shardformer import SequenceParallelGradSync, ShardConfig, ShardFormer

        config = ShardConfig(
            enable_tensor_parallelism=False,
            enable_sequence_parallelism=True,
            sequence_parallelism_mode=MODES[name],
            sequence_parallel_process_group=dist.group.WORLD,
        )
        model = ShardFormer(config).optimize(model)[0]
        super().__init__(name, model, ids)
        self.sync = SequenceParallelGradSync(model)

    def forward_backward(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, labels=self.ids, use_cache=False)
        out.loss.backward()
        self.sync()
        return out.loss.detach()


def make_trainer(name: str, size: dict[str, int], seq: int, world_size: int) -> _Trainer:
    ids = batch(size, seq)
    model = build_model(size, seq)
    if name == "torch CP":
        return TorchCP(model, ids, world_size)
    return Ours(name, model, ids)


def reference(size: dict[str, int], seq: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The unsharded model's loss and gradients on the same batch (one process)."""
    ids = batch(size, seq)
    model = build_model(size, seq)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def grad_error(model: nn.Module, grads: dict[str, torch.Tensor]) -> float:
    """Largest ``|g - g_ref| / |g_ref|`` (norms) over the parameters, by Hugging Face name."""
    worst = 0.0
    for name, p in model.named_parameters():
        ref = grads[name]
        worst = max(worst, float((p.grad - ref).norm() / ref.norm().clamp_min(1e-30)))
    return worst


# --------------------------------------------------------------------------------------------
# step time


def time_worker(rank: int, world_size: int, args: Any) -> list[dict[str, Any]]:
    """Build, check, warm up and time the three configurations (one spawned run)."""
    size, seq = args.sp_size, args.sp_size["seq"]
    trainers, errors = [], {}
    for name in CONFIGS:
        try:
            trainers.append(make_trainer(name, size, seq, world_size))
        except (ImportError, NotImplementedError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    ref_loss, ref_grads = reference(size, seq) if rank == 0 else (0.0, {})
    grad_err = {}
    for t in trainers:  # same weights, same batch: the same gradients (after the SP sync)
        t.forward_backward()
        if rank == 0:
            grad_err[t.name] = grad_error(t.model, ref_grads)
    first_loss = {t.name: t.step() for t in trainers}  # ... and the same loss
    for _ in range(args.warmup - 1):
        for t in trainers:
            t.step()
    times: dict[str, list[float]] = {t.name: [] for t in trainers}
    cpu: dict[str, list[float]] = {t.name: [] for t in trainers}
    for r in range(args.rounds):
        shift = r % len(trainers) if trainers else 0
        order = trainers[shift:] + trainers[:shift]
        for t in order if r % 2 == 0 else order[::-1]:
            wall, cpu_s = span(t.step)
            times[t.name].append(wall)
            cpu[t.name].append(cpu_s)
    if rank != 0:
        return []
    rows = []
    for name in CONFIGS:
        row: dict[str, Any] = {"section": "sp", "world": world_size, "config": name, "seq": seq}
        if name in errors:
            rows.append({**row, "error": errors[name]})
            continue
        rows.append(
            {
                **row,
                "steps_ms": [round(x * 1e3, 1) for x in times[name]],
                "cpus_ms": [round(x * 1e3, 1) for x in cpu[name]],  # summed over ranks
                "first_loss": first_loss[name],
                "reference_loss": ref_loss,
                "grad_rel_error": grad_err[name],
            }
        )
    return rows


def pool_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per configuration from several spawned runs: the steps of all runs pooled.

    A run's processes share the machine's cores in their own way for the whole run (which
    ranks share a core, where their memory lies), which moves a run's times by a few percent
    as a block; pooling the rounds of separately spawned runs takes that out of the median.
    The correctness columns are the first run's (every run checks the same thing).
    """
    rows = []
    for per_run in zip(*runs, strict=True):
        row = dict(per_run[0])
        if "error" not in row:
            steps = [x for r in per_run for x in r["steps_ms"]]
            cpus = [x for r in per_run for x in r["cpus_ms"]]
            row.update(
                step_ms=statistics.median(steps),
                cpu_ms=statistics.median(cpus),
                steps_ms=steps,
                cpus_ms=cpus,
                run_medians_ms=[round(statistics.median(r["steps_ms"]), 1) for r in per_run],
            )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# longest sequence within a memory budget


def _peak_rss_of(fn: Any) -> int:
    """Peak resident set size (bytes) of this process while ``fn()`` runs."""
    with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak (VmHWM) to now
        fh.write("5")
    fn()
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _next_probe(fits: int, fails: int, grain: int, max_seq: int) -> int | None:
    """The next length to try: doubling until a length fails, then bisection to the grain."""
    if not fails:
        nxt = 2 * fits if fits else grain
        return nxt if nxt <= max_seq else None
    if fails - fits <= grain:
        return None
    return max((fits + fails) // 2 // grain * grain, fits + grain)


def memory_worker(rank: int, world_size: int, name: str, seq: int, args: Any) -> int:
    """Peak RSS (bytes, max over ranks) of one training step of ``name`` at length ``seq``.

    Each length runs in fresh processes: memory an earlier step touched (freed tensors the
    allocator kept, caches) would otherwise count in this step's peak.
    """
    from colossal.core.comm import all_gather_object

    trainer = make_trainer(name, args.sp_size, seq, world_size)
    return max(all_gather_object(_peak_rss_of(trainer.step)))


def run_memory(args: Any, world_size: int) -> dict[str, dict[str, Any]]:
    """Longest trainable sequence of each configuration: doubling, then bisection to the grain."""
    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # fixed: freed tensors leave the process
    try:
        results = {}
        for name in CONFIGS:
            fits, fails, measured = 0, 0, {}
            budget = args.sp_memory_mb * 2**20
            try:
                while (
                    seq := _next_probe(fits, fails, args.sp_seq_grain, args.sp_max_seq)
                ) is not None:
                    measured[seq] = spawn(
                        memory_worker, world_size, args=(name, seq, args), timeout=3600
                    )[0]
                    fits, fails = (fits, seq) if measured[seq] > budget else (seq, fails)
            except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
                results[name] = {"memory_error": f"{type(exc).__name__}: {exc}"[:300]}
                continue
            results[name] = {
                "longest_seq": fits,
                "capped": not fails,  # fit up to --sp-max-seq: the budget was not reached
                "peak_rss_mb": {s: round(b / 2**20, 1) for s, b in sorted(measured.items())},
            }
        return results
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


# --------------------------------------------------------------------------------------------
# the section


def run_section(args: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Run the SP section; returns (rows, goals, markdown text to print)."""
    from bench_common import goal, markdown_table

    world, size = args.sp_world, args.sp_size
    rows = pool_runs(
        [spawn(time_worker, world, args=(args,), timeout=3600)[0] for _ in range(args.sp_runs)]
    )
    memory = run_memory(args, world) if args.sp_memory_mb else {}
    by_name = {r["config"]: r for r in rows}
    peer = by_name["torch CP"]
    goals = []
    for r in rows:
        r.update({k: v for k, v in memory.get(r["config"], {}).items() if k != "config"})
        if "error" in r:
            continue
        r["loss_vs_unsharded"] = abs(r["first_loss"] - r["reference_loss"]) / abs(
            r["reference_loss"]
        )
        if r is not peer and "step_ms" in peer:
            r["vs_torch_cp"] = r["step_ms"] / peer["step_ms"]
            r["cpu_vs_torch_cp"] = r["cpu_ms"] / peer["cpu_ms"]
    for name in CONFIGS:
        r = by_name[name]
        if name != "torch CP":
            ratio = r.get("vs_torch_cp")
            goals.append(
                goal(
                    f"SP={world} seq {r['seq']}: step time {name} / torch CP",
                    round(ratio, 3) if ratio is not None else r.get("error", "no value"),
                    "<= 0.95",
                    ratio is not None and ratio <= 0.95,
                )
            )
            ours_len, cp_len = r.get("longest_seq"), peer.get("longest_seq")
            if args.sp_memory_mb:
                goals.append(
                    goal(
                        f"SP={world}: longest seq at {args.sp_memory_mb} MB/rank, {name} vs "
                        f"torch CP ({cp_len})",
                        ours_len if ours_len is not None else r.get("error", "no value"),
                        f">= {cp_len}",
                        ours_len is not None and cp_len is not None and ours_len >= cp_len > 0,
                    )
                )
        for key, what, tol in (
            ("loss_vs_unsharded", "first-step loss", LOSS_RTOL),
            ("grad_rel_error", "gradients (max relative error of a parameter's)", GRAD_RTOL),
        ):
            diff = r.get(key)
            goals.append(
                goal(
                    f"SP={world}: {what}, {name} vs unsharded",
                    diff if diff is not None else r.get("error", "no value"),
                    f"<= {tol:g}",
                    diff is not None and diff <= tol,
                )
            )

    def cell(r: dict[str, Any], key: str, digits: int = 3) -> Any:
        v = r.get(key)
        return "" if v is None else round(v, digits) if isinstance(v, float) else v

    table = []
    for r in rows:
        peaks = r.get("peak_rss_mb", {})
        table.append(
            {
                "config": r["config"],
                "seq": r["seq"],
                "step (ms)": cell(r, "step_ms", 1),
                "vs torch CP": cell(r, "vs_torch_cp"),
                "CPU ms/step (all ranks)": cell(r, "cpu_ms", 0),
                "CPU vs torch CP": cell(r, "cpu_vs_torch_cp"),
                "first loss": cell(r, "first_loss", 6),
                "loss rel. diff vs unsharded": cell(r, "loss_vs_unsharded", 9),
                "max grad rel. error vs unsharded": cell(r, "grad_rel_error", 9),
                f"longest seq @ {args.sp_memory_mb} MB/rank": (
                    f"{r['longest_seq']}{'+' if r.get('capped') else ''}"
                    if "longest_seq" in r
                    else ""
                ),
                "peak RSS MB/rank by seq": ", ".join(f"{s}: {m}" for s, m in peaks.items()),
                "error": r.get("error", r.get("memory_error", "")),
            }
        )
    columns = [c for c in table[0] if any(t[c] != "" for t in table)]
    s = size
    text = (
        f"\nsequence parallelism: LlamaForCausalLM (hidden {s['hidden']}, {s['layers']} layers, "
        f"{s['heads']}/{s['kv_heads']} heads, MLP {s['intermediate']}, vocab {s['vocab']}), "
        f"batch {s['batch']} x {s['seq']}, AdamW, {world} gloo CPU ranks x 1 thread, "
        f"{args.sp_runs} spawned runs x {args.rounds} timed steps per config (pooled median); "
        f"longest seq: one training step's peak RSS "
        f"(max over ranks) <= {args.sp_memory_mb} MB, searched in steps of {args.sp_seq_grain} "
        f"up to {args.sp_max_seq} ('+': the cap fit)\n\n" + markdown_table(table, columns)
    )
    return rows, goals, text
