"""Tensor and sequence parallelism for Llama: colossal.shardformer vs PyTorch-native peers.

Tensor parallelism: colossal.shardformer vs torch's ``parallelize_module``.

A Llama-style ``transformers.LlamaForCausalLM`` of ~50M parameters (hidden 768, 6 layers,
12 query heads and 4 key/value heads of 64, MLP 2048, vocabulary 8192, untied embeddings) is
trained on gloo CPU processes (one thread each) at world sizes 2 and 4. In ONE spawned run per
world size W, built from the same seed and fed the same batch (4 x 128 tokens, labels = inputs),
two tensor-parallel configurations at TP = W take turns (the order flips every round, >= 3
rounds, median step time):

* **colossal**: ``ShardFormer(ShardConfig(tensor_parallel_process_group=WORLD)).optimize(model)``
  -- the policy derived from ``config.base_model_tp_plan``: q/k/v/gate/up column-parallel,
  o/down row-parallel, vocab-parallel embedding, vocab-parallel LM head with sharded logits and
  the vocab-parallel cross entropy installed as ``model.loss_function``.
* **torch (DTensor)**: ``torch.distributed.tensor.parallel.parallelize_module`` on a 1-D
  ``DeviceMesh("cpu", range(W))`` with a plan built FROM THE SAME ``base_model_tp_plan``
  ("colwise" -> ``ColwiseParallel()``, "rowwise" -> ``RowwiseParallel()``), made as close to
  Megatron (and to ours) as torch allows: ``embed_tokens`` -> ``RowwiseParallel(input_layouts=
  Replicate())`` (torch's vocab-parallel embedding: masked lookup + one all-reduce);
  ``lm_head`` -> ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` with the
  loss computed by transformers' own ``ForCausalLMLoss`` inside ``loss_parallel()`` (sharded
  logits, vocab-parallel cross entropy); and ``PrepareModuleInput`` on every ``self_attn`` and
  ``mlp`` turning their input into a replicated DTensor once, so the backward all-reduces the
  input gradient ONCE per block (torchtitan's recipe) instead of once per q/k/v/gate/up
  projection (what a plain plan does: 5 instead of 2 backward all-reduces per layer).

The unsharded model on one process (world 1) is timed in a separate run for reference. A
training step is ``zero_grad`` + forward with ``labels`` (Hugging Face's loss path) + backward
+ ``AdamW.step``, after 2 warm-up steps. Before any step both TP models must produce the same
loss as each other (checked, reported).

Reported per world size:

* median step time (first rank's start to last rank's end) of each configuration and the ratio
  colossal / torch (goal <= 0.95), next to the unsharded model's step time;
* per-rank model memory: bytes of the parameters a rank holds (``numel * element_size`` of each
  distinct local parameter; a DTensor's local shard), against the expected value
  ``sum(sharded numel) / TP + sum(replicated numel)`` (x 4 bytes), where the sharded parameters
  are those the tp plan names plus the embedding and LM head, whose vocabulary is first padded
  to a multiple of ``make_vocab_size_divisible_by (64) * TP`` (goal: within 5 %);
* communication bytes of one step counted by ``colossal.core.CommTracker`` against the Megatron
  formula (goal: equal). With ``B`` batch, ``S`` sequence, ``H`` hidden, ``L`` layers and 4-byte
  floats, the tensor-parallel step moves (all logical all-reduce sizes, the same on every rank):

  - per decoder layer: forward 2 all-reduces of ``B*S*H`` (after ``o_proj`` and ``down_proj``),
    backward 2 of ``B*S*H`` (the input gradient of the q/k/v block and of the gate/up block);
  - vocab-parallel embedding: forward 1 all-reduce of ``B*S*H``; no backward communication;
  - LM head (column-parallel over the vocabulary, output left sharded): backward 1 all-reduce of
    ``B*S*H`` (its input gradient);
  - vocab-parallel cross entropy over the ``B*S`` positions transformers scores (labels shifted
    by padding with -100): ``B*S`` floats for the row max, ``B*S`` for the sum of exponentials
    and ``B*S`` for the target logit (Megatron: 3 all-reduces; ours packs the last two into one,
    the same bytes); backward purely local.

  Total: ``(4*L + 2) * B*S*H*4 + 3 * B*S*4`` bytes in ``4*L + 4`` all-reduces. The DTensor
  peer's collectives do not pass through Colossal's helpers; their count per kind comes from
  torch's ``CommDebugMode`` (reported, not a goal).

Reading the numbers: the step time is wall time, so on a machine whose cores are shared (or
with fewer cores than ranks, e.g. world 4 on 2 cores) it includes waiting for the CPU; every
round alternates the two TP configurations so both see the same load, and the "CPU ms/step"
column (process CPU time summed over ranks) is the load-insensitive view of the same ratio.
``--profile N`` prints torch.profiler's top ``N`` ops of one step per configuration on rank 0
(a blocking gloo all-reduce shows up as the self time of the op that waits for it:
``_ReduceFromRegion``/``_CopyToRegionBackward`` for ours, ``wait_tensor`` for DTensor).

Sequence parallelism (``--sections sp``, on by default): an attention-heavy Llama step (few
layers, one sequence of 2048 tokens) on 4 ranks with our Ulysses (``all_to_all``) and ring
attention (``ring_attn``) against PyTorch's ``context_parallel`` (ring attention on SDPA, made
to run on CPU by adding the CPU flash kernel to CP's own dispatch table): step time, loss
agreement and the longest sequence each trains within a per-rank memory budget. See
``_shardformer_sp.py`` (the section) and ``_shardformer_sp_cp.py`` (CP on CPU).

Usage::

    python3 benchmarks/shardformer.py [--quick] [--sections tp sp] [--worlds 2 4] [--rounds N]
        [--profile N] [--sp-world 4] [--sp-seq S] [--sp-runs 3] [--sp-memory-mb MB] [--sp-max-seq S]
        [--sp-seq-grain S] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from _shardformer_sp import SP_FULL, SP_FULL_ARGS, SP_QUICK, SP_QUICK_ARGS, span
from _shardformer_sp import run_section as sp_section
from bench_common import goal, machine, markdown_table, write_json
from torch import nn

from colossal.core.testing import spawn

FULL = {
    "hidden": 768,
    "layers": 6,
    "heads": 12,
    "kv_heads": 4,
    "intermediate": 2048,
    "vocab": 8192,
    "batch": 4,
    "seq": 128,
}
QUICK = {
    "hidden": 256,
    "layers": 2,
    "heads": 4,
    "kv_heads": 4,
    "intermediate": 704,
    "vocab": 2048,
    "batch": 2,
    "seq": 64,
}
VOCAB_MULTIPLE = 64  # ShardConfig's make_vocab_size_divisible_by default


def build_model(size: dict[str, int]) -> nn.Module:
    """The Llama model every configuration starts from (same seed, fp32, no dropout)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        intermediate_size=size["intermediate"],
        vocab_size=size["vocab"],
        max_position_embeddings=max(512, size["seq"]),
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def batch(size: dict[str, int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def param_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (each distinct parameter once; DTensor: local)."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(_local(p).numel() * _local(p).element_size() for p in params)


def _padded(vocab: int, tp: int) -> int:
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab // multiple) * multiple


def expected_param_bytes(model: nn.Module, tp: int) -> int:
    """``sum(sharded numel) / TP (+ vocab padding) + sum(replicated numel)``, in bytes.

    Sharded: the weights the tp plan names, the input embedding and the LM head.
    """
    import fnmatch

    prefix = model.base_model_prefix + "."
    plan = [prefix + k for k in model.config.base_model_tp_plan]
    vocab = model.config.vocab_size
    total = 0.0
    for name, p in model.named_parameters():
        if name.startswith(prefix + "embed_tokens.") or name.startswith("lm_head."):
            total += _padded(vocab, tp) * p.shape[1] / tp
        elif any(fnmatch.fnmatch(name.rsplit(".", 1)[0], pat) for pat in plan):
            total += p.numel() / tp
        else:
            total += p.numel()
    return int(total * 4)


def megatron_comm_bytes(size: dict[str, int]) -> tuple[int, int]:
    """(all-reduce calls, bytes) of one tensor-parallel training step (module docstring)."""
    tokens = size["batch"] * size["seq"]
    act = tokens * size["hidden"] * 4
    calls = 4 * size["layers"] + 2 + 2
    return calls, (4 * size["layers"] + 2) * act + 3 * tokens * 4


# --------------------------------------------------------------------------------------------
# the configurations


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """The DTensor plan (torchtitan's Llama recipe, the layout of colossal's policy).

    q/k/v/gate/up ``ColwiseParallel``, o/down ``RowwiseParallel`` (from the model's
    ``base_model_tp_plan``); one replicated DTensor input per attention and MLP block
    (``PrepareModuleInput``: one backward all-reduce per block, not one per projection);
    vocab-parallel embedding (``RowwiseParallel(input_layouts=Replicate())``) and LM head
    (``ColwiseParallel(output_layouts=Shard(-1))``) with the loss under ``loss_parallel()``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    prefix = model.base_model_prefix + "."
    plan: dict[str, Any] = {}
    for pattern, style in model.config.base_model_tp_plan.items():
        if style not in styles:
            raise ValueError(f"benchmark peer: tp style {style!r} of {pattern!r} not mapped")
        plan[prefix + pattern] = styles[style]()
    plan[prefix + "layers.*.self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Replicate()},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=False,
    )
    plan[prefix + "layers.*.mlp"] = PrepareModuleInput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
    )
    plan[prefix + "embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return plan


def torch_tp(model: nn.Module, world_size: int) -> nn.Module:
    """``parallelize_module`` with :func:`tp_plan` over all ranks."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = DeviceMesh("cpu", list(range(world_size)))
    return parallelize_module(model, mesh, tp_plan(model))


def colossal_tp(model: nn.Module) -> nn.Module:
    import torch.distributed as dist

    try:
        from colossal.shardformer import ShardConfig, ShardFormer
    except ImportError:  # before the package root re-exports them
        from colossal.shardformer.shard import ShardConfig, ShardFormer

    config = ShardConfig(tensor_parallel_process_group=dist.group.WORLD)
    return ShardFormer(config).optimize(model)[0]


class Trainer:
    """One configuration: its model, optimizer and training step."""

    def __init__(self, name: str, model: nn.Module, ids: torch.Tensor) -> None:
        self.name = name
        self.model = model
        self.ids = ids
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.dtensor = name == "torch"
        self.phases: list[tuple[float, float, float]] = []

    def loss(self) -> torch.Tensor:
        out = self.model(input_ids=self.ids, labels=self.ids, use_cache=False)
        return out.loss

    def step(self) -> float:
        """One training step; records this rank's forward/backward/optimizer seconds."""
        t0 = time.perf_counter()
        self.optim.zero_grad(set_to_none=True)
        if self.dtensor:
            from torch.distributed.tensor.parallel import loss_parallel

            with loss_parallel():
                loss = self.loss()
                t1 = time.perf_counter()
                loss.backward()
        else:
            loss = self.loss()
            t1 = time.perf_counter()
            loss.backward()
        t2 = time.perf_counter()
        self.optim.step()
        self.phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        return float(_local(loss).detach())


# --------------------------------------------------------------------------------------------
# the measurement


def _comm(trainer: Trainer) -> dict[str, Any]:
    """Collectives of one step: CommTracker for ours, CommDebugMode for the DTensor peer."""
    from colossal.core import CommTracker

    if trainer.dtensor:
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as mode:
            trainer.step()
        counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
        return {"comm_calls": counts}
    with CommTracker() as tracker:
        trainer.step()
    return {
        "comm_calls": {k: sum(s.calls for s in g.values()) for k, g in tracker.summary().items()},
        "comm_bytes": tracker.bytes(),
        "all_reduce_bytes": tracker.bytes("all_reduce"),
    }


def _profile(trainer: Trainer, rows: int) -> str:
    """torch.profiler's table (top ``rows`` ops by self CPU time) of one step of this rank."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def worker(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Build, warm up, count and time every configuration of one world size."""
    from colossal.core.comm import all_gather_object

    # CommDebugMode's module tracker warns about Hugging Face's dataclass outputs
    warnings.filterwarnings("ignore", message=".*backward hook", category=UserWarning)
    size = args.size
    ids = batch(size)
    if world_size == 1:
        trainers = [Trainer("unsharded", build_model(size), ids)]
    else:
        trainers = [
            Trainer("colossal", colossal_tp(build_model(size)), ids),
            Trainer("torch", torch_tp(build_model(size), world_size), ids),
        ]
    memory = {t.name: max(all_gather_object(param_bytes(t.model))) for t in trainers}
    first_loss = {t.name: t.step() for t in trainers}  # same weights, same batch: same loss
    for _ in range(args.warmup - 1):
        for t in trainers:
            t.step()
    comm = {t.name: _comm(t) for t in trainers} if world_size > 1 else {}
    times: dict[str, list[float]] = {t.name: [] for t in trainers}
    cpu: dict[str, list[float]] = {t.name: [] for t in trainers}
    for t in trainers:
        t.phases.clear()
    for r in range(args.rounds):
        for t in trainers if r % 2 == 0 else trainers[::-1]:
            wall, cpu_s = span(t.step)
            times[t.name].append(wall)
            cpu[t.name].append(cpu_s)
    profiles = {t.name: _profile(t, args.profile) for t in trainers} if args.profile else {}
    if rank != 0:
        return []
    with torch.device("meta"):
        expected = expected_param_bytes(build_model(size), world_size)
    rows = []
    for t in trainers:
        rows.append(
            {
                "world": world_size,
                "config": t.name,
                "step_ms": statistics.median(times[t.name]) * 1e3,
                "steps_ms": [round(x * 1e3, 1) for x in times[t.name]],
                "cpu_ms": statistics.median(cpu[t.name]) * 1e3,  # summed over ranks
                "param_bytes": memory[t.name],
                "expected_param_bytes": expected,
                "first_loss": first_loss[t.name],
                # rank 0's own time in each phase (medians over the timed steps)
                "forward_ms": statistics.median(p[0] for p in t.phases) * 1e3,
                "backward_ms": statistics.median(p[1] for p in t.phases) * 1e3,
                "optimizer_ms": statistics.median(p[2] for p in t.phases) * 1e3,
                **comm.get(t.name, {}),
                **({"_profile": profiles[t.name]} if profiles else {}),
            }
        )
    return rows


def tp_section(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the tensor-parallel section (prints its tables); returns (rows, goals)."""
    start = time.time()
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(args.size).parameters())
    reference = spawn(worker, 1, args=(args,), timeout=3600)[0][0]
    rows, goals = [reference], []
    calls, formula = megatron_comm_bytes(args.size)
    for world in args.worlds:
        ours, theirs = spawn(worker, world, args=(args,), timeout=3600)[0]
        ours["vs_torch"] = ours["step_ms"] / theirs["step_ms"]
        ours["cpu_vs_torch"] = ours["cpu_ms"] / theirs["cpu_ms"]
        for r in (ours, theirs):
            r["vs_unsharded"] = r["step_ms"] / reference["step_ms"]
            r["memory_vs_expected"] = r["param_bytes"] / r["expected_param_bytes"]
        ours["formula_bytes"] = formula
        rows += [ours, theirs]
        loss_diff = abs(ours["first_loss"] - theirs["first_loss"]) / abs(theirs["first_loss"])
        goals += [
            goal(
                f"TP={world}: step time colossal / torch",
                round(ours["vs_torch"], 3),
                "<= 0.95",
                ours["vs_torch"] <= 0.95,
            ),
            goal(
                f"TP={world}: param bytes per rank / expected",
                round(ours["memory_vs_expected"], 4),
                "within 5 %",
                abs(ours["memory_vs_expected"] - 1) <= 0.05,
            ),
            goal(
                f"TP={world}: comm bytes per step (formula {formula})",
                ours["comm_bytes"],
                f"== {formula}",
                ours["comm_bytes"] == formula,
            ),
            goal(
                f"TP={world}: first-step loss, colossal vs torch (relative)",
                loss_diff,
                "<= 1e-5",
                loss_diff <= 1e-5,
            ),
        ]
    elapsed = time.time() - start

    s = args.size
    print(
        f"\nshardformer benchmark: LlamaForCausalLM {n_params / 1e6:.1f}M parameters (hidden "
        f"{s['hidden']}, {s['layers']} layers, {s['heads']}/{s['kv_heads']} heads, MLP "
        f"{s['intermediate']}, vocab {s['vocab']}), batch {s['batch']} x {s['seq']}, AdamW, "
        f"gloo CPU, 1 thread/rank, {args.rounds} timed steps per config, {elapsed:.0f} s\n"
    )
    table = []
    for r in rows:
        table.append(
            {
                "world": r["world"],
                "config": r["config"],
                "step (ms)": round(r["step_ms"], 1),
                "colossal/torch": round(r["vs_torch"], 3) if "vs_torch" in r else "",
                "vs unsharded": round(r.get("vs_unsharded", 1.0), 3),
                "CPU ms/step (all ranks)": round(r["cpu_ms"]),
                "CPU colossal/torch": round(r["cpu_vs_torch"], 3) if "cpu_vs_torch" in r else "",
                "param MB/rank": round(r["param_bytes"] / 2**20, 2),
                "expected MB": round(r["expected_param_bytes"] / 2**20, 2),
                "comm bytes/step": r.get("comm_bytes", ""),
                "formula bytes": r.get("formula_bytes", ""),
                "collectives/step": ", ".join(
                    f"{k} {v}" for k, v in sorted(r.get("comm_calls", {}).items())
                ),
                "fwd/bwd/opt ms (rank 0)": f"{r['forward_ms']:.0f}/{r['backward_ms']:.0f}/"
                f"{r['optimizer_ms']:.0f}",
                "first loss": round(r["first_loss"], 6),
            }
        )
    print(markdown_table(table, list(table[0])))
    print(f"\nMegatron formula: {calls} all-reduces, {formula} bytes per step\n")
    for r in rows:
        if "_profile" in r:
            print(f"\nprofile of one step, world {r['world']}, {r['config']} (rank 0):")
            print(r.pop("_profile"))
    for r in rows:
        r["section"] = "tp"
    return rows, goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models (under two minutes)")
    parser.add_argument("--json", help="write results as JSON to this path")
    parser.add_argument(
        "--sections", nargs="+", choices=["tp", "sp"], default=["tp", "sp"], help="what to run"
    )
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="TP sizes")
    parser.add_argument("--rounds", type=int, default=None, help="timed steps per config")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="print the top N ops (self CPU time) of one extra step per TP config on rank 0",
    )
    parser.add_argument("--sp-world", type=int, default=None, help="SP size (4; quick 2)")
    parser.add_argument("--sp-seq", type=int, default=None, help="SP timed sequence length")
    parser.add_argument(
        "--sp-runs",
        type=int,
        default=None,
        help="separately spawned SP timing runs whose rounds are pooled (3; quick 1)",
    )
    parser.add_argument(
        "--sp-memory-mb",
        type=int,
        default=None,
        help="per-rank peak-RSS budget of the longest-sequence search (0: skip the search)",
    )
    parser.add_argument("--sp-max-seq", type=int, default=None, help="search cap")
    parser.add_argument("--sp-seq-grain", type=int, default=None, help="search step")
    args = parser.parse_args()
    args.size = QUICK if args.quick else FULL
    args.rounds = args.rounds or (3 if args.quick else 9)
    if args.rounds < 3 or args.warmup < 1:
        raise ValueError(
            f"--rounds must be >= 3 and --warmup >= 1, got {args.rounds}, {args.warmup}"
        )
    sp_defaults = SP_QUICK_ARGS if args.quick else SP_FULL_ARGS
    args.sp_size = dict(SP_QUICK if args.quick else SP_FULL)
    if args.sp_seq:
        args.sp_size["seq"] = args.sp_seq
    for key, value in sp_defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    multiple = 2 * args.sp_world  # the zigzag layouts cut the sequence in 2 * SP chunks
    if args.sp_size["seq"] % multiple or args.sp_seq_grain % multiple:
        raise ValueError(
            f"--sp-seq ({args.sp_size['seq']}) and --sp-seq-grain ({args.sp_seq_grain}) must be "
            f"multiples of 2 * --sp-world = {multiple}; pick multiples of {multiple}"
        )

    rows: list[dict[str, Any]] = []
    goals: list[dict[str, Any]] = []
    if "tp" in args.sections:
        tp_rows, tp_goals = tp_section(args)
        rows, goals = rows + tp_rows, goals + tp_goals
    if "sp" in args.sections:
        start = time.time()
        sp_rows, sp_goals, text = sp_section(args)
        rows, goals = rows + sp_rows, goals + sp_goals
        print(text + f"\n\n(sequence-parallel section: {time.time() - start:.0f} s)")
    print("\n| goal | value | target | met |\n|---|---:|---|---|")
    for g in goals:
        print(f"| {g['name']} | {g['value']} | {g['target']} | {'yes' if g['met'] else 'NO'} |")
    info = machine()
    print(f"\nmachine: {info}")
    write_json(args.json, "shardformer", rows, goals)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
