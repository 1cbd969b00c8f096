"""The training configurations ``benchmarks/gemini.py`` compares, and one step of each.

Every configuration is built from a fresh copy of the same GPT (same seed) and exposes one
training step that returns the model-state bytes this rank holds after backward (parameters,
gradients, master weights, optimizer states): the moment they are all alive at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from bench_gpt import GPT, GPTConfig, lm_loss
from torch import nn

logger = logging.getLogger(__name__)

CONFIGS = (
    "ddp",
    "ddp_bf16",
    "fsdp2",
    "fsdp2_bf16",
    "gemini_static_bf16",
    "gemini_static_fp16",
    "gemini_auto_bf16",
)
ADAM = {"lr": 1e-4, "weight_decay": 0.01}
AUTO_RESERVE = 0.25  # auto: device share reserved for non-model data (forces eviction)


def tensor_bytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t`` held on this rank (a DTensor's local shard only)."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def optimizer_state_bytes(optim: Any) -> int:
    """Bytes of every tensor in the optimizer's state (through wrappers' ``.optim``)."""
    inner = getattr(optim, "optim", optim)
    return sum(
        tensor_bytes(v)
        for state in inner.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )


def torch_model_state(model: nn.Module, optim: Any) -> int:
    """Parameters + gradients + optimizer states of a torch (DDP/FSDP2) model on this rank."""
    params = list({id(p): p for p in model.parameters()}.values())
    return sum(tensor_bytes(p) + tensor_bytes(p.grad) for p in params) + optimizer_state_bytes(
        optim
    )


def gemini_model_state(model: Any, optim: Any) -> tuple[int, dict[str, int]]:
    """(total bytes, bytes by kind) of a GeminiDDP model's state on this rank.

    Uses the package's own per-kind report when GeminiDDP has one (``memory_report()``),
    else the chunks' ``memory()`` (shards, masters, gradient shards, gathered payloads,
    gradient buffers) plus the optimizer's state tensors.
    """
    report = getattr(model, "memory_report", None)
    if callable(report):
        got = report()
        by_kind = dict(got) if isinstance(got, dict) else dict(vars(got))
        by_kind = {k: int(v) for k, v in by_kind.items() if isinstance(v, int | float)}
        total = by_kind.pop("total", None)
        if "optimizer_states" not in by_kind and "optim_states" not in by_kind:
            by_kind["optimizer_states"] = optimizer_state_bytes(optim)
        return int(total if total is not None else sum(by_kind.values())), by_kind
    chunks = model.chunk_manager.memory()
    by_kind = {f"chunks_{loc}": int(n) for loc, n in chunks.items()}
    by_kind["optimizer_states"] = optimizer_state_bytes(optim)
    return sum(by_kind.values()), by_kind


@dataclass
class Run:
    """One built configuration: the forward module, the optimizer, how to step it."""

    name: str
    model: nn.Module
    module: Any
    optim: Any
    gemini: bool
    info: dict[str, Any] = field(default_factory=dict)

    def step(self, data: torch.Tensor) -> int:
        """One training step; returns the model-state bytes held after backward."""
        self.optim.zero_grad()
        loss = lm_loss(self.module, data)
        if self.gemini:
            self.optim.backward(loss)
            memory, by_kind = gemini_model_state(self.module, self.optim)
            self.info["memory_by_kind"] = by_kind
        else:
            loss.backward()
            memory = torch_model_state(self.model, self.optim)
        self.optim.step()
        return memory


def gemini_kwargs(
    config: str, chunk_size: int, device_limit: int | None, reserve: float = AUTO_RESERVE
) -> dict[str, Any]:
    """GeminiDDP arguments of a ``gemini_*`` configuration (``device_limit``, ``reserve``:
    auto only)."""
    precision = config.rsplit("_", 1)[1]
    kwargs: dict[str, Any] = {
        "precision": precision,
        "chunk_config_dict": {"chunk_size": chunk_size},
    }
    if "_static_" in config:
        kwargs.update(placement_policy="static", shard_param_frac=1.0, offload_optim_frac=1.0)
    elif "_auto_" in config:
        kwargs.update(
            placement_policy="auto",
            warmup_non_model_data_ratio=reserve,
            device_memory_limit=device_limit,
        )
    else:
        raise ValueError(f"unknown gemini configuration {config!r}; choose one of {CONFIGS}")
    return kwargs


def _gemini(
    config: str,
    cfg: GPTConfig,
    chunk_size: int,
    device_limit: int | None,
    reserve: float = AUTO_RESERVE,
) -> Run:
    from colossal.gemini import GeminiDDP, GeminiOptimizer
    from colossal.kernels import HybridAdam

    torch.manual_seed(0)
    model = GPT(cfg)
    optim = HybridAdam(model.parameters(), **ADAM)
    gemini = GeminiDDP(model, **gemini_kwargs(config, chunk_size, device_limit, reserve))
    return Run(config, model, gemini, GeminiOptimizer(optim, gemini), True)


def _auto(config: str, cfg: GPTConfig, chunk_size: int, data: torch.Tensor, reserve: float) -> Run:
    """The auto configuration under a device memory limit that makes it evict shards.

    One probe step without a limit measures the peak device model data ``P``; the run then
    gets the device limited to ``P`` with a share ``reserve`` of it kept for non-model data,
    so model data must stay within ``(1 - reserve) * P`` at every gather: parameter shards
    have to be evicted to the host at the busiest moments (the ``shards_on_host`` column
    shows whether they were), and ``P`` itself is never exceeded. Eviction happens only
    before gathers while gradient buffers cannot be evicted, so a share that is too large
    for the model's chunk layout raises ``DeviceMemoryExceeded`` in the first step: the
    share is then lowered (every rank alike) until a step completes. A limited step that
    completes without evicting (its peak can stay below ``P``) sets the next limit to its
    own peak, up to :data:`TIGHTEN_TRIES` times.
    """
    probe = _gemini(config, cfg, chunk_size, None)
    probe.step(data)
    limit = probe.module.budget.peak("device")
    del probe
    for _ in range(TIGHTEN_TRIES):
        run, share = _fitting_auto(config, cfg, chunk_size, data, reserve, limit)
        if _agreed_max(gemini_facts(run)["shards_on_host"]) > 0:
            run.info["auto_reserve"] = share
            return run
        # The limited step peaked below the unlimited one without moving anything (it did
        # at world 2, 154 against 211 MiB, while colossal-core's two-rank reduce-scatter never
        # reported completion and unlimited runs kept every gradient buffer to the end of
        # backward; now the probe peaks at 152 MiB and the first limit evicts). Tighten the
        # limit to that peak.
        limit = int(_agreed_max(run.module.budget.peak("device")))
        logger.info("auto fitted without evicting; limit tightened to %d B", limit)
    run.info["auto_reserve"] = share
    return run


TIGHTEN_TRIES = 3  # auto: limits tried, each the previous limited step's peak


def _agreed_max(value: float) -> float:
    """The largest ``value`` over the ranks."""
    flag = torch.tensor([float(value)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item()


def _fitting_auto(
    config: str, cfg: GPTConfig, chunk_size: int, data: torch.Tensor, reserve: float, limit: int
) -> tuple[Run, float]:
    """The first auto run (and its reserve share) whose first step fits under ``limit``."""
    from colossal.gemini import DeviceMemoryExceeded

    for share in (reserve, reserve / 2, reserve / 4, 0.0):
        run = _gemini(config, cfg, chunk_size, limit, share)
        try:
            run.step(data)
            failed = 0.0
        except DeviceMemoryExceeded as exc:
            logger.info("auto under %d B with reserve %.3f: %s", limit, share, exc)
            failed = 1.0
        if not _agreed_max(failed):
            return run, share
    raise RuntimeError(f"{config}: no step fits under the limit {limit} B")


def build(
    config: str,
    cfg: GPTConfig,
    chunk_size: int,
    data: torch.Tensor,
    reserve: float = AUTO_RESERVE,
) -> Run:
    """A fresh model (seed 0) wrapped as ``config`` (``data``: a batch for auto's probe;
    ``reserve``: auto's device share kept from model data).

    Raises:
        ValueError: ``config`` is not one of :data:`CONFIGS`.
    """
    torch.manual_seed(0)
    model = GPT(cfg)
    if config in ("ddp", "ddp_bf16"):  # ddp_bf16: the same bf16 compute as Gemini, no master
        if config == "ddp_bf16":
            model = model.to(torch.bfloat16)
        ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        return Run(config, model, ddp, torch.optim.AdamW(model.parameters(), **ADAM), False)
    if config.startswith("fsdp2"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            if config.endswith("bf16")
            else MixedPrecisionPolicy()
        )
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=True, mp_policy=policy)
        fully_shard(model, reshard_after_forward=True, mp_policy=policy)
        return Run(config, model, model, torch.optim.AdamW(model.parameters(), **ADAM), False)
    if config.startswith("gemini"):
        if "_auto_" in config:
            return _auto(config, cfg, chunk_size, data, reserve)
        return _gemini(config, cfg, chunk_size, None)
    raise ValueError(f"unknown configuration {config!r}; choose from {CONFIGS}")


def gemini_facts(run: Run) -> dict[str, Any]:
    """Chunk count, device-memory peak and evicted shards of a Gemini run (for the table)."""
    if not run.gemini:
        return {}
    manager = run.module.chunk_manager
    budget = run.module.budget
    on_host = sum(1 for c in manager.chunks if getattr(c, "shard_location", None) == "host")
    return {
        "auto_reserve": run.info.get("auto_reserve"),
        "chunks": len(manager.chunks),
        "device_peak": budget.peak("device"),
        "device_limit": budget.capacity,
        "shards_on_host": on_host,
    }
