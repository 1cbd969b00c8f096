"""Shared test helpers: tiny model configs and the sharded-vs-unsharded reference check.

``reference_check`` runs inside a spawned rank: it builds the model twice from one seed,
shards one copy with :class:`ShardFormer`, and compares logits, loss and every gradient
(gathered through ``sharded_view(p.grad, like=p).gather()``) with the unsharded copy, then
takes a few SGD steps on both (SGD, not Adam: Adam's normalization hides a gradient that is
off by a constant factor) and compares the gathered parameters and their updates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.core import sharded_view
from colossal.core.testing import relative_error

__all__ = [
    "CheckReport",
    "causal_lm_batch",
    "gather_last_dim",
    "reference_check",
    "tiny_llama_config",
    "tiny_mistral_config",
    "tiny_qwen2_config",
]


# ---------------------------------------------------------------------------------------------
# Tiny configs (fp32-friendly, every dim divisible by 4 so TP 2 and 4 both work).


_TINY_DECODER: dict[str, Any] = dict(
    vocab_size=250,  # not a multiple of 64 * tp: exercises the vocab padding
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=4,  # grouped-query attention
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def _tiny(config_cls: type, num_hidden_layers: int, **overrides: Any) -> Any:
    return config_cls(**{**_TINY_DECODER, "num_hidden_layers": num_hidden_layers, **overrides})


def tiny_llama_config(num_hidden_layers: int = 2, **overrides: Any) -> Any:
    """A tiny Llama config with grouped-query attention (8 heads, 4 key/value heads)."""
    from transformers import LlamaConfig

    return _tiny(LlamaConfig, num_hidden_layers, **overrides)


def tiny_mistral_config(num_hidden_layers: int = 2, **overrides: Any) -> Any:
    """A tiny Mistral config (grouped-query attention, sliding window longer than the batch)."""
    from transformers import MistralConfig

    return _tiny(MistralConfig, num_hidden_layers, **{"sliding_window": 32, **overrides})


def tiny_qwen2_config(num_hidden_layers: int = 2, **overrides: Any) -> Any:
    """A tiny Qwen2 config (q/k/v with bias, tied embeddings)."""
    from transformers import Qwen2Config

    return _tiny(Qwen2Config, num_hidden_layers, **{"tie_word_embeddings": True, **overrides})


def causal_lm_batch(
    vocab_size: int,
    batch_size: int = 2,
    seq_len: int = 8,
    pad: bool = True,
    seed: int = 1234,
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (left part of row 1 padded when ``pad``) and ``labels``.

    Padded positions get label ``-100`` so the loss ignores them.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=gen)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if pad and batch_size > 1:
        mask[1, : seq_len // 4] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


# ---------------------------------------------------------------------------------------------
# Gathering helpers.


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim; backward keeps this rank's slice (the objective is
    replicated, so every rank already holds the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        pieces = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def gather_last_dim(x: torch.Tensor, width: int, group: Any = None) -> torch.Tensor:
    """``x`` split along its last dim over ``group`` as the whole tensor, cut to ``width``.

    Differentiable; a tensor that already has ``width`` columns is returned as it is. The
    columns past ``width`` (vocabulary padding) are dropped.
    """
    if x.shape[-1] == width:
        return x
    full = _GatherLastDim.apply(x, group)
    if full.shape[-1] < width:
        raise AssertionError(
            f"gathered last dim {full.shape[-1]} is smaller than the expected {width}"
        )
    return full[..., :width]


def _gather_param(p: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    view = sharded_view(p, like=like)
    if view is None:
        return p.detach(), False
    return view.gather(), True


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict):
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return out[0]


# ---------------------------------------------------------------------------------------------
# The reference check.


@dataclass
class CheckReport:
    """Relative errors found by :func:`reference_check` (``<= rtol``; updates ``<= update_rtol``).

    Attributes:
        output: Relative error of the gathered logits (or first output).
        loss: Relative error of the loss (0.0 when the model returns none).
        grads: Parameter name -> relative error of its gathered gradient.
        params: Parameter name -> relative error of the gathered parameter after the steps.
        updates: Parameter name -> relative error of the gathered parameter's total change.
        replicated_spread: Replicated parameter name -> largest relative difference of its
            gradient between TP ranks.
        sharded: Names of the parameters that are sharded.
        failures: Human-readable failure lines (empty when everything passed).
    """

    output: float = 0.0
    loss: float = 0.0
    grads: dict[str, float] = field(default_factory=dict)
    params: dict[str, float] = field(default_factory=dict)
    updates: dict[str, float] = field(default_factory=dict)
    replicated_spread: dict[str, float] = field(default_factory=dict)
    sharded: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def worst(self) -> float:
        """The largest relative error of all checks."""
        values = [self.output, self.loss]
        for d in (self.grads, self.params, self.updates, self.replicated_spread):
            values.extend(d.values())
        return max(values)


def _objective(out: Any, width: int, group: Any) -> Any:
    """The scalar to backpropagate and the (gathered) first output."""
    first = _first_tensor(out)
    full = gather_last_dim(first, width, group)
    loss = getattr(out, "loss", None)
    if loss is None:
        gen = torch.Generator().manual_seed(99)
        weight = torch.randn(full.shape, generator=gen).to(full.dtype)
        loss = (full.float() * weight.float()).sum() / full.numel()
    return loss, full


def _spread(grad: torch.Tensor, group: Any) -> float:
    pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, grad.contiguous(), group=group)
    return max(relative_error(p, pieces[0]) for p in pieces)


def reference_check(
    build: Callable[[], nn.Module],
    batch: dict[str, torch.Tensor],
    shard_config_kwargs: dict[str, Any] | None = None,
    steps: int = 5,
    rtol: float = 1e-5,
    dtype: torch.dtype = torch.float32,
    policy: Any = None,
    seed: int = 0,
    lr: float = 0.1,
    train: bool = False,
    check: bool = True,
    check_updates: bool | None = None,
    update_rtol: float | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
) -> CheckReport:
    """Compare a sharded model with the unsharded one built from the same seed.

    Run inside a spawned rank. ``build()`` is called twice under ``torch.manual_seed(seed)``;
    the second copy is sharded with ``ShardFormer(ShardConfig(**shard_config_kwargs))
    .optimize(model, policy)``. Checked (relative error ``<= rtol``): the first output
    (logits, gathered over the TP group and cut to the unpadded width when the model keeps
    them sharded), the loss, every parameter's gradient (gathered through
    ``sharded_view(p.grad, like=p).gather()``), that every replicated gradient is equal on
    all TP ranks, that both models have the same parameter names, and after ``steps`` SGD
    steps every gathered parameter and its total change.

    Args:
        build: Makes the model (called twice with the same seed).
        batch: Keyword arguments of the forward (the loss comes from ``labels`` when given;
            otherwise a fixed random projection of the first output is the objective).
        shard_config_kwargs: ``ShardConfig`` arguments (default: TP over the whole job).
        steps: SGD steps before comparing parameters (0 skips them).
        rtol: Largest relative error allowed.
        dtype: Dtype of both models (``torch.bfloat16`` needs a looser ``rtol``).
        policy: A policy instance for ``optimize`` (None: the auto policy).
        seed: Seed both models are built from.
        lr: SGD learning rate.
        train: Run in train mode (use configs without dropout) instead of eval mode.
        check: Raise ``AssertionError`` listing the failures (else only report them).
        check_updates: Compare each parameter's total change too (default: in fp32/fp64
            only; a bf16 parameter rounds away most of a small SGD update).
        update_rtol: Largest relative error of a total change (default ``10 * rtol``: a
            change is a difference of nearby numbers, so its relative error is larger; a
            gradient off by a factor still shows as an error near 1).
        after_backward: Called with the sharded model after each backward (e.g.
            ``lambda m: SequenceParallelGradSync(m)()``).

    Returns:
        A :class:`CheckReport` with every relative error.
    """
    from colossal.shardformer.shard import ShardConfig, ShardFormer

    kwargs = dict(shard_config_kwargs or {})
    torch.manual_seed(seed)
    ref = build().to(dtype)
    torch.manual_seed(seed)
    model = build().to(dtype)
    ref.train(train)
    model.train(train)
    config = ShardConfig(**kwargs)
    group = config.tensor_parallel_process_group
    model, _shared = ShardFormer(config).optimize(model, policy)
    model.train(train)

    report = CheckReport()
    ref_params = dict(ref.named_parameters())
    params = dict(model.named_parameters())
    if set(ref_params) != set(params):
        report.failures.append(
            f"parameter names differ: only unsharded {sorted(set(ref_params) - set(params))}, "
            f"only sharded {sorted(set(params) - set(ref_params))}"
        )
        raise AssertionError("\n".join(report.failures))
    initial = {n: _gather_param(p, p)[0].clone() for n, p in params.items()}
    ref_initial = {n: p.detach().clone() for n, p in ref_params.items()}
    for n in params:
        if relative_error(initial[n].float(), ref_initial[n].float()) > 0:
            report.failures.append(f"{n}: the sharded copy does not hold the unsharded values")

    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(max(steps, 1)):
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        ref_out = ref(**batch)
        out = model(**batch)
        width = _first_tensor(ref_out).shape[-1]
        ref_loss, ref_full = _objective(ref_out, width, group)
        loss, full = _objective(out, width, group)
        ref_loss.backward()
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        if step == 0:
            report.output = relative_error(full.float(), ref_full.float())
            report.loss = relative_error(loss.float(), ref_loss.float())
            for n, p in params.items():
                rp = ref_params[n]
                if (p.grad is None) != (rp.grad is None):
                    report.failures.append(
                        f"{n}: gradient is {'missing' if p.grad is None else 'unexpected'}"
                    )
                    continue
                if p.grad is None:
                    continue
                g, sharded = _gather_param(p.grad, p)
                report.grads[n] = relative_error(g.float(), rp.grad.float())
                if sharded:
                    report.sharded.append(n)
                elif dist.is_initialized():
                    report.replicated_spread[n] = _spread(p.grad, group)
        if steps == 0:
            break
        ref_opt.step()
        opt.step()

    if check_updates is None:
        check_updates = dtype in (torch.float32, torch.float64)
    if steps:
        for n, p in params.items():
            now = _gather_param(p, p)[0]
            rp = ref_params[n].detach()
            report.params[n] = relative_error(now.float(), rp.float())
            ref_delta = (rp - ref_initial[n]).float()
            if check_updates and float(ref_delta.abs().max()) > 0:
                report.updates[n] = relative_error((now - initial[n]).float(), ref_delta)

    for label, value in (("output", report.output), ("loss", report.loss)):
        if not value <= rtol:
            report.failures.append(f"{label}: relative error {value:.3e} > {rtol:.1e}")
    for label, errs in (
        ("grad", report.grads),
        ("param", report.params),
        ("replicated grad spread", report.replicated_spread),
    ):
        for n, e in errs.items():
            if not e <= rtol:
                report.failures.append(f"{label} {n}: relative error {e:.3e} > {rtol:.1e}")
    update_rtol = 10 * rtol if update_rtol is None else update_rtol
    for n, e in report.updates.items():
        if not e <= update_rtol:
            report.failures.append(f"update {n}: relative error {e:.3e} > {update_rtol:.1e}")
    if check and report.failures:
        raise AssertionError(
            f"sharded model differs from the unsharded one ({len(report.failures)} failures):\n"
            + "\n".join(report.failures[:40])
        )
    return report
