"""One device, ours against plain PyTorch: the measurements of ``tools/gpu_check.sh``.

Each row times one piece of Colossal next to the PyTorch peer a user would otherwise call, on
the same device and inputs, and checks that both compute the same thing before the time is
worth reading:

- ``adam``: colossal-kernels' ``FusedAdam`` against ``torch.optim.AdamW(fused=True)`` (one
  step over ``--adam-params`` fp32 parameters); check: largest parameter difference;
- ``rms_norm`` / ``layer_norm``: the fused norms against ``F.rms_norm`` / ``F.layer_norm``,
  forward and backward in bf16 (fp32 on CPU); check: largest output difference;
- ``attention``: colossal-kernels' ``attention(..., "causal")`` against
  ``F.scaled_dot_product_attention(is_causal=True)``; check: largest output difference;
- ``fp8_linear``: colossal-kernels' ``linear_fp8`` (``torch._scaled_mm``, e4m3 forward and
  e5m2 gradients: what ``use_fp8=True`` runs) against a bf16 ``F.linear`` (fp32 on CPU),
  forward and backward; check: the output's largest error relative to its largest value
  (float8 rounding: a few percent);
- ``llama_step``: a Llama training step (forward, backward, AdamW) of the same model and
  batch, as a plain eager loop, the same loop under ``torch.compile``, and through the
  Booster (``HybridParallelPlugin`` at world 1 with bf16, fused norms and colossal-kernels'
  ``FusedAdam``); check: the first step's loss against the peer's.

``diff`` is the check's number (0 up to rounding when both compute the same thing).

Times are medians of ``--reps`` runs after ``--warmup`` (CUDA-synchronised). ``ratio`` is
ours / peer: below 1 is faster. ``--device cpu --tiny`` runs every row at toy sizes on CPU
(what the tests of this script run; its times mean nothing).

    python benchmarks/gpu_check.py [--device cuda] [--tiny] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from bench_common import markdown_table, write_json
from torch.nn import functional as F  # noqa: N812


@dataclass
class Row:
    """One measurement: ours and the peer on the same work."""

    section: str
    ours: str
    peer: str
    ours_ms: float
    peer_ms: float
    diff: float
    check: str

    @property
    def ratio(self) -> float:
        """ours / peer time (below 1 is faster)."""
        return self.ours_ms / self.peer_ms if self.peer_ms > 0 else float("nan")


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run."""

    adam_params: int
    norm_rows: int
    hidden: int
    attn: tuple[int, int, int, int]  # batch, heads, seq, head_dim
    llama_layers: int
    llama_seq: int
    llama_batch: int


FULL = Sizes(50_000_000, 8192, 4096, (8, 16, 2048, 128), 8, 1024, 8)
TINY = Sizes(20_000, 64, 64, (1, 2, 16, 8), 2, 16, 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of ``fn`` in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def adam_row(device: torch.device, sizes: Sizes, warmup: int, reps: int) -> Row:
    """FusedAdam against torch's fused AdamW on the same parameters and gradients."""
    from colossal.kernels import FusedAdam

    g = torch.Generator(device="cpu").manual_seed(0)
    init = torch.randn(sizes.adam_params, generator=g).to(device)
    grad = torch.randn(sizes.adam_params, generator=g).to(device)
    ours_p = torch.nn.Parameter(init.clone())
    peer_p = torch.nn.Parameter(init.clone())
    ours_p.grad, peer_p.grad = grad.clone(), grad.clone()
    ours = FusedAdam([ours_p], lr=1e-3, weight_decay=0.01)
    peer = torch.optim.AdamW([peer_p], lr=1e-3, weight_decay=0.01, fused=True)
    ours.step()
    peer.step()
    diff = (ours_p - peer_p).abs().max().item()
    return Row("adam", "FusedAdam", "torch AdamW(fused=True)",
               timed(ours.step, device, warmup, reps), timed(peer.step, device, warmup, reps),
               diff, "max abs parameter difference after one step")


def _fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
             dy: torch.Tensor) -> Callable[[], object]:
    def run() -> object:
        x.grad = None
        y = fn(x)
        y.backward(dy)
        return y

    return run


def norm_rows(device: torch.device, sizes: Sizes, warmup: int, reps: int) -> list[Row]:
    """The fused RMSNorm and LayerNorm against torch's, forward and backward."""
    from colossal.kernels import fused_layer_norm, fused_rms_norm

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = sizes.hidden
    x = torch.randn(sizes.norm_rows, h, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    w = torch.randn(h, device=device, dtype=dtype)
    b = torch.randn(h, device=device, dtype=dtype)
    pairs = {
        "rms_norm": (lambda t: fused_rms_norm(t, h, w), lambda t: F.rms_norm(t, (h,), w, 1e-6),
                     "fused_rms_norm", "F.rms_norm"),
        "layer_norm": (lambda t: fused_layer_norm(t, h, w, b),
                       lambda t: F.layer_norm(t, (h,), w, b), "fused_layer_norm", "F.layer_norm"),
    }
    rows = []
    for section, (ours, peer, ours_name, peer_name) in pairs.items():
        diff = (ours(x).float() - peer(x).float()).abs().max().item()
        rows.append(Row(section, ours_name, peer_name,
                        timed(_fwd_bwd(ours, x, dy), device, warmup, reps),
                        timed(_fwd_bwd(peer, x, dy), device, warmup, reps),
                        diff, "max abs output difference"))
    return rows


def attention_row(device: torch.device, sizes: Sizes, warmup: int, reps: int) -> Row:
    """colossal-kernels' causal attention against torch's SDPA, forward and backward."""
    from colossal.kernels import attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(*sizes.attn, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    dy = torch.randn_like(q)

    def ours(t: torch.Tensor) -> torch.Tensor:
        return attention(t, k, v, "causal")

    def peer(t: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(t, k, v, is_causal=True)

    diff = (ours(q).float() - peer(q).float()).abs().max().item()
    return Row("attention", "colossal attention", "F.scaled_dot_product_attention",
               timed(_fwd_bwd(ours, q, dy), device, warmup, reps),
               timed(_fwd_bwd(peer, q, dy), device, warmup, reps),
               diff, "max abs output difference")


def fp8_linear_row(device: torch.device, sizes: Sizes, warmup: int, reps: int) -> Row:
    """``linear_fp8`` against the half-precision linear it replaces, forward and backward."""
    from colossal.kernels.fp8 import fp8_matmul_missing, linear_fp8

    missing = fp8_matmul_missing(device)
    if missing is not None:
        raise RuntimeError(f"fp8_linear: {missing}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    h = sizes.hidden
    x = torch.randn(sizes.norm_rows, h, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(4 * h, h, device=device, dtype=dtype)
    dy = torch.randn(sizes.norm_rows, 4 * h, device=device, dtype=dtype)
    ref = F.linear(x, w).float()
    err = ((linear_fp8(x, w).float() - ref).abs().max() / ref.abs().max()).item()
    return Row("fp8_linear", "linear_fp8", "F.linear",
               timed(_fwd_bwd(lambda t: linear_fp8(t, w), x, dy), device, warmup, reps),
               timed(_fwd_bwd(lambda t: F.linear(t, w), x, dy), device, warmup, reps),
               err, "max abs output error / max abs output")


def _llama(sizes: Sizes, tiny: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    width = 64 if tiny else 1024
    cfg = LlamaConfig(vocab_size=256 if tiny else 32000, hidden_size=width,
                      intermediate_size=4 * width, num_hidden_layers=sizes.llama_layers,
                      num_attention_heads=4 if tiny else 16,
                      num_key_value_heads=4 if tiny else 16,
                      max_position_embeddings=sizes.llama_seq)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor,
                dtype: torch.dtype) -> Callable[[], float]:
    def step() -> float:
        with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def llama_rows(device: torch.device, sizes: Sizes, warmup: int, reps: int, tiny: bool,
               with_compile: bool = True) -> list[Row]:
    """One Llama training step: eager, ``torch.compile`` and through the Booster."""
    from colossal.booster import Booster
    from colossal.booster.plugin import HybridParallelPlugin
    from colossal.kernels import FusedAdam

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(1)
    vocab = 256 if tiny else 32000
    ids = torch.randint(0, vocab, (sizes.llama_batch, sizes.llama_seq), generator=g).to(device)
    tokens = ids.numel()

    eager = _llama(sizes, tiny).to(device)
    eager_step = _plain_step(eager, torch.optim.AdamW(eager.parameters(), lr=1e-4), ids, dtype)
    eager_loss = eager_step()
    eager_ms = timed(eager_step, device, warmup, reps)
    del eager

    compiled_ms = compiled_loss = None
    if with_compile:
        compiled = _llama(sizes, tiny).to(device)
        compiled_step = _plain_step(torch.compile(compiled),
                                    torch.optim.AdamW(compiled.parameters(), lr=1e-4), ids, dtype)
        compiled_loss = compiled_step()
        compiled_ms = timed(compiled_step, device, warmup, reps)
        del compiled

    plugin = HybridParallelPlugin(tp_size=1, pp_size=1,
                                  precision="bf16" if dtype == torch.bfloat16 else "fp32",
                                  enable_fused_normalization=True)
    model = _llama(sizes, tiny)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, FusedAdam(model.parameters(), lr=1e-4))

    def ours_step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        return loss.item()

    ours_loss = ours_step()
    ours_ms = timed(ours_step, device, warmup, reps)
    check = f"first-step loss difference; {tokens} tokens/step"
    ours_name = "Booster(HybridParallelPlugin)"
    rows = [Row("llama_step", ours_name, "eager loop", ours_ms, eager_ms,
                abs(ours_loss - eager_loss), check)]
    if compiled_ms is not None and compiled_loss is not None:
        rows.append(Row("llama_step", ours_name, "torch.compile loop", ours_ms, compiled_ms,
                        abs(ours_loss - compiled_loss), check))
    return rows


def _launch_single(device: torch.device) -> None:
    """A one-rank default process group (the Booster's plugins need one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def run(device: torch.device, sizes: Sizes, warmup: int, reps: int, tiny: bool,
        sections: list[str], with_compile: bool = True) -> list[Row]:
    """Every requested section's rows."""
    rows: list[Row] = []
    if "adam" in sections:
        rows.append(adam_row(device, sizes, warmup, reps))
    if "norms" in sections:
        rows.extend(norm_rows(device, sizes, warmup, reps))
    if "attention" in sections:
        rows.append(attention_row(device, sizes, warmup, reps))
    if "fp8" in sections:
        rows.append(fp8_linear_row(device, sizes, warmup, reps))
    if "llama" in sections:
        _launch_single(device)
        rows.extend(llama_rows(device, sizes, warmup, reps, tiny, with_compile))
    return rows


SECTIONS = ["adam", "norms", "attention", "fp8", "llama"]
COLUMNS = ["section", "ours", "peer", "ours_ms", "peer_ms", "ratio", "diff", "check"]


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the sections, print a markdown table (and write JSON)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--tiny", action="store_true", help="toy sizes (tests; times mean nothing)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5, tiny 1)")
    p.add_argument("--reps", type=int, default=None, help="timed calls (default 20, tiny 2)")
    p.add_argument("--sections", nargs="+", default=SECTIONS, choices=SECTIONS)
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="leave out the torch.compile peer (its compilation takes a minute on CPU)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False here; use --device cpu --tiny")
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    reps = args.reps if args.reps is not None else (2 if args.tiny else 20)
    rows = run(device, TINY if args.tiny else FULL, warmup, reps, args.tiny, args.sections,
               args.compile)
    records = [asdict(r) | {"ratio": r.ratio} for r in rows]
    print(markdown_table(records, COLUMNS))
    write_json(args.json, "gpu_check", records, [])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
