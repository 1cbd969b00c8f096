"""The seeds' "NVMe offload" page: GPT-2 trained with HybridAdam's ``nvme_offload_fraction``.

The page trains GPT-2 (124M parameters) for three steps on the CPU and then under Gemini,
each without and with the Adam states on disk, and compares the time and the process's
memory. This script runs the same four trainings, each in a fresh process so that one's
memory does not stay in another's numbers, and prints one table:

- ``cpu``: the page's ``train_cpu``: a plain loop, ``HybridAdam(model.parameters(),
  nvme_offload_fraction=f)`` (the CPU Adam kernel; the offloaded part of the states is read
  from and written back to ``--offload-dir`` around each parameter's update);
- ``gemini``: the page's ``train_gemini_cpu``, written with today's API: one process,
  ``Booster(plugin=GeminiPlugin(placement_policy="static", offload_optim_frac=1.0,
  offload_param_frac=1.0))`` and the same ``HybridAdam``.

Per run: the losses, the time of the steps, the bytes of Adam's states held in memory, the
process's resident memory at the end (as the page's ``get_mem_usage``), and the memory saved
against the same mode without offload next to what the page expects it to save: the
offloaded share of Adam's two fp32 states,
``8 bytes x parameters x fraction``. Offloading changes where the states live, not the
arithmetic, so the losses with and without offload must be equal: the table says whether
they are. Two changes from the page: every step trains on the same random batch (the page
draws a new one per step, so its loss cannot fall in three steps), and the model's sizes are
flags (``--n-layer 2 --n-embd 128`` runs in seconds).

    python examples/nvme_offload/nvme_offload.py [--modes cpu gemini] [--fractions 0 1]
        [--steps 3] [--n-layer 12] [--n-embd 768] [--offload-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT = "RESULT "


def rss_bytes() -> int:
    """This process's resident memory (the page's ``psutil.Process().memory_info().rss``)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak instead
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train(mode: str, fraction: float, args: argparse.Namespace) -> dict[str, object]:
    """One of the page's trainings, in this process; returns what the table shows."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from colossal.kernels import HybridAdam

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head,
                        n_positions=max(args.seq_len, 16))
    model = GPT2LMHeadModel(config)
    numel = sum(p.numel() for p in model.parameters())
    adam = optimizer = HybridAdam(model.parameters(), lr=args.lr,
                                  nvme_offload_fraction=fraction, nvme_offload_dir=args.offload_dir)
    ids = torch.randint(config.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(1))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    backward = torch.Tensor.backward
    if mode == "gemini":
        from colossal.booster import Booster
        from colossal.booster.plugin import GeminiPlugin
        from colossal.core import launch

        launch(rank=0, world_size=1, host="127.0.0.1", port=args.port, backend="gloo",
               verbose=False)
        plugin = GeminiPlugin(placement_policy="static", offload_optim_frac=1.0,
                              offload_param_frac=1.0, precision="fp32")
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(model, optimizer)

        def backward(loss: torch.Tensor) -> None:
            booster.backward(loss, optimizer)

    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        loss = model(**data).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"[{mode} {fraction:g}] [{step}] loss: {losses[-1]:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    in_memory = sum(t.nbytes for st in adam.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"mode": mode, "fraction": fraction, "numel": numel, "losses": losses,
            "time_s": elapsed, "rss": rss_bytes(), "states_in_memory": in_memory}


def run_child(mode: str, fraction: float, argv: list[str]) -> dict[str, object]:
    """Run one training in a fresh interpreter and read its result line."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child", mode, str(fraction)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        raise SystemExit(f"{mode} with nvme_offload_fraction={fraction} failed:\n{done.stderr}")
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def table(results: list[dict]) -> str:
    """The page's comparison as one markdown table."""
    mib = 2**20
    base = {r["mode"]: r for r in results if r["fraction"] == 0.0}
    lines = ["| mode | nvme_offload_fraction | parameters (M) | steps time (s) "
             "| Adam states in memory (MiB) | process memory (MiB) | saved (MiB) "
             "| expected saving (MiB) | losses as without offload |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = base.get(r["mode"])
        saved = f"{(b['rss'] - r['rss']) / mib:.0f}" if b is not None and b is not r else "-"
        same = "-" if b is None or b is r else ("yes" if r["losses"] == b["losses"] else "NO")
        expected = 8 * r["numel"] * r["fraction"] / mib
        lines.append(f"| {r['mode']} | {r['fraction']:g} | {r['numel'] / 1e6:.1f} "
                     f"| {r['time_s']:.2f} | {r['states_in_memory'] / mib:.0f} "
                     f"| {r['rss'] / mib:.0f} | {saved} | {expected:.0f} "
                     f"| {same} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["cpu", "gemini"], choices=["cpu", "gemini"])
    p.add_argument("--fractions", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n-layer", type=int, default=12, help="GPT-2 small: 12")
    p.add_argument("--n-embd", type=int, default=768, help="GPT-2 small: 768")
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 1)))
    p.add_argument("--offload-dir", default=None, help="where the states go (default: a temp dir)")
    p.add_argument("--port", type=int, default=29561, help="Gemini's one-process group")
    p.add_argument("--child", nargs=2, metavar=("MODE", "FRACTION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for f in args.fractions:
        if not 0.0 <= f <= 1.0:
            p.error(f"--fractions: {f} is not in [0, 1] (the share of the states on disk)")
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Run every (mode, fraction) in its own process and print the table."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.child:
        result = train(args.child[0], float(args.child[1]), args)
        print(RESULT + json.dumps(result), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="nvme_offload_") as tmp:
        child_argv = list(argv)
        if args.offload_dir is None:
            child_argv += ["--offload-dir", tmp]
        results = [run_child(m, f, child_argv) for m in args.modes for f in args.fractions]
    print(table(results))


if __name__ == "__main__":
    main()
