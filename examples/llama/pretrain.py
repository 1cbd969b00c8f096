"""LLaMA pretraining with Colossal's plugins, at a scale a laptop runs.

The seeds' LLaMA story (ColossalAI's ``examples/language/llama``) pretrains Llama with
``--plugin gemini``, ``hybrid`` (tensor, pipeline and sequence parallelism, ZeRO) or
``moe`` (expert parallelism for the MoE variants). This script is that job on a tiny model
built from a config: a ``LlamaForCausalLM`` (or, with ``--plugin moe``, a
``MixtralForCausalLM``, the Llama layout with expert MLPs), character-level on
``../shared/data/tinyshakespeare.txt`` when present (``--data FILE`` for any text; the
repository's own sources otherwise). Every ``--log-interval`` iterations it prints the
training loss (mean over the ranks that hold one) and the throughput in tokens per second;
``--save-interval N`` checkpoints (one format: resume under any plugin and layout) and
``--resume`` continues from the latest checkpoint with the same data order.

    torchrun --nproc_per_node 2 examples/llama/pretrain.py --plugin gemini
    torchrun --nproc_per_node 4 examples/llama/pretrain.py --plugin hybrid --tp 2 --pp 2
    torchrun --nproc_per_node 2 examples/llama/pretrain.py --plugin hybrid --tp 2 \
        --sp-mode split_gather
    torchrun --nproc_per_node 4 examples/llama/pretrain.py --plugin moe --ep 2 --zero-stage 1

See ``examples/llama/README.md`` for the flags a real cluster would use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from train_gpt import (  # noqa: E402  (the GPT main job's data and checkpoint helpers)
    SP_MODES,
    get_batch,
    hf_batch,
    hf_loss,
    latest_checkpoint,
    load_data,
    mean_over_holders,
    read_latest,
    write_atomic,
)

from colossal.booster import Booster  # noqa: E402
from colossal.booster.plugin import (  # noqa: E402
    GeminiPlugin,
    HybridParallelPlugin,
    MoeHybridParallelPlugin,
)
from colossal.core import destroy, launch_from_torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plugin", choices=["gemini", "hybrid", "moe"], default="hybrid")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--data", default=None, help="text file (default: tinyshakespeare if present)")
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="grouped-query attention")
    p.add_argument("--experts", type=int, default=4, help="--plugin moe: experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="--plugin moe: experts per token")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "colossal_llama"))
    p.add_argument("--save-interval", type=int, default=0, help="checkpoint every N iters")
    p.add_argument("--resume", action="store_true", help="continue from --out/checkpoint")
    p.add_argument("--stop-after", type=int, default=0, help="stop after N iterations")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    par = p.add_argument_group("parallelism (--plugin hybrid / moe)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    par.add_argument("--pp", type=int, default=1, help="pipeline stages")
    par.add_argument("--sp", type=int, default=None, help="sequence-parallel size of its own")
    par.add_argument("--sp-mode", choices=SP_MODES, default=None, help="sequence parallelism")
    par.add_argument("--ep", type=int, default=1, help="--plugin moe: expert-parallel size")
    par.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=0)
    par.add_argument("--num-microbatches", type=int, default=None, help="with --pp (default pp)")
    args = p.parse_args(argv)
    layout = {"--tp": args.tp != 1, "--pp": args.pp != 1, "--sp": args.sp is not None,
              "--sp-mode": args.sp_mode is not None, "--zero-stage": args.zero_stage != 0}
    if args.plugin == "gemini" and any(layout.values()):
        p.error(f"{', '.join(k for k, v in layout.items() if v)}: not with --plugin gemini "
                "(Gemini is data parallel with sharded chunks; use --plugin hybrid)")
    if args.ep != 1 and args.plugin != "moe":
        p.error(f"--ep {args.ep} needs --plugin moe (experts exist only in the MoE model)")
    if args.plugin == "moe" and (args.sp is not None or args.sp_mode is not None):
        p.error("--plugin moe does not take sequence parallelism; drop --sp/--sp-mode")
    for name in ("iters", "batch_size", "seq_len", "log_interval", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return args


def build_model(args: argparse.Namespace, vocab: int) -> torch.nn.Module:
    """The tiny Llama (or Mixtral, for ``--plugin moe``) the arguments describe."""
    common = {"vocab_size": vocab, "hidden_size": args.hidden,
              "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
              "max_position_embeddings": args.seq_len, "tie_word_embeddings": False}
    torch.manual_seed(args.seed)
    if args.plugin == "moe":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**common, num_local_experts=args.experts,
                            num_experts_per_tok=args.top_k)
        return MixtralForCausalLM(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**common))


def make_booster(args: argparse.Namespace) -> Booster:
    """The plugin of ``--plugin`` with the layout flags."""
    if args.plugin == "gemini":
        return Booster(plugin=GeminiPlugin(precision=args.precision, max_norm=args.grad_clip))
    micro = (args.num_microbatches or args.pp) if args.pp > 1 else None
    if args.plugin == "moe":
        return Booster(plugin=MoeHybridParallelPlugin(
            tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, precision=args.precision,
            zero_stage=args.zero_stage, num_microbatches=micro, max_norm=args.grad_clip))
    return Booster(plugin=HybridParallelPlugin(
        tp_size=args.tp, pp_size=args.pp, sp_size=args.sp, precision=args.precision,
        zero_stage=args.zero_stage, enable_sequence_parallelism=args.sp_mode is not None,
        sequence_parallelism_mode=args.sp_mode, num_microbatches=micro,
        max_norm=args.grad_clip))


def data_parallel_coordinates(booster: Booster) -> tuple[int, int]:
    """This rank's data-parallel replica and the number of replicas."""
    plugin = booster.plugin
    if isinstance(plugin, HybridParallelPlugin):
        return plugin.parallel_dims.coordinate("dp"), plugin.dp_size
    return dist.get_rank(), dist.get_world_size()


def main(argv: list[str] | None = None) -> float:
    """Pretrain; returns the last logged training loss."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    launch_from_torch(backend="gloo", verbose=False)
    rank = dist.get_rank()
    vocab, train_data, _ = load_data(args.data)
    model = build_model(args, vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.iters, args.lr / 10)
    booster = make_booster(args)
    dp_rank, dp = data_parallel_coordinates(booster)
    if args.batch_size % dp:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {dp} "
                         "data-parallel replicas")
    pipelined = args.pp > 1
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    ckpt = os.path.join(args.out, "checkpoint")
    start = 0
    if args.resume:
        where = latest_checkpoint(ckpt)
        booster.load_model(model, os.path.join(where, "model"))
        booster.load_optimizer(optimizer, os.path.join(where, "optimizer"))
        booster.load_lr_scheduler(scheduler, os.path.join(where, "lr_scheduler.json"))
        with open(os.path.join(where, "train_state.json"), encoding="utf-8") as fh:
            start = json.load(fh)["iter"]
        if rank == 0:
            print(f"resumed from {where} at iteration {start}", flush=True)

    def save(it: int) -> None:  # a directory per checkpoint; "latest" moves once it is whole
        where = os.path.join(ckpt, f"iter-{it:07d}")
        booster.save_model(model, os.path.join(where, "model"), shard=True)
        booster.save_optimizer(optimizer, os.path.join(where, "optimizer"), shard=True)
        booster.save_lr_scheduler(scheduler, os.path.join(where, "lr_scheduler.json"))
        dist.barrier()
        if rank == 0:
            write_atomic(os.path.join(where, "train_state.json"), json.dumps({"iter": it}))
            previous = read_latest(ckpt)
            write_atomic(os.path.join(ckpt, "latest"), os.path.basename(where))
            if previous is not None and previous != os.path.basename(where):
                import shutil

                shutil.rmtree(os.path.join(ckpt, previous), ignore_errors=True)
        dist.barrier()

    per_rank = args.batch_size // dp
    gen = torch.Generator().manual_seed(args.seed * 1000 + dp_rank)
    for _ in range(start):  # the data order of an uninterrupted run
        get_batch(train_data, per_rank, args.seq_len, gen)
    losses: list[float] = []
    last = float("nan")
    window_start, window_iters = time.perf_counter(), 0
    for it in range(start, args.iters):
        x, y = get_batch(train_data, per_rank, args.seq_len, gen)
        if pipelined:  # the loss is on the last stage only (None elsewhere)
            loss = booster.execute_pipeline(iter([hf_batch(x, y)]), model, hf_loss, optimizer,
                                            return_loss=True)["loss"]
        else:
            loss = model(**hf_batch(x, y)).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        if loss is not None:
            losses.append(loss.item())
        window_iters += 1
        if (it + 1) % args.log_interval == 0 or it == args.iters - 1:
            last = mean_over_holders([sum(losses) / len(losses)] if losses else None)[0]
            tokens = window_iters * args.batch_size * args.seq_len
            rate = tokens / (time.perf_counter() - window_start)
            if rank == 0:
                print(f"iter {it + 1}: loss {last:.4f}, {rate:.0f} tokens/s", flush=True)
            losses.clear()
            window_start, window_iters = time.perf_counter(), 0
        if args.save_interval and (it + 1) % args.save_interval == 0:
            save(it + 1)
        if args.stop_after and it + 1 - start >= args.stop_after:
            if rank == 0:
                print(f"stopping after iteration {it + 1} (--stop-after)", flush=True)
            break
    dist.barrier()
    destroy()
    return last


if __name__ == "__main__":
    main()
