"""HybridParallelPlugin layouts train like one process on the global batch.

Each layout trains a tiny transformers model (GPT-2 with tied embeddings, or Llama) for
3 steps through the Booster and is compared with the unsharded model trained by one process
on the whole batch: the loss of every step (averaged over data-parallel ranks, on the ranks
holding the last stage) and every parameter this rank holds afterwards (tensor-parallel ones
gathered), at a relative error of ``TOL`` in fp32. SGD with momentum keeps a gradient that is
scaled wrongly (a sum over tp counted twice, a mean missing) visible in every step; the
clipping case checks the global norm, which counts every parameter once over tp x pp x dp.

What a wrong composition gives: a tied weight on two stages whose gradients are not summed
(its copies drift apart), layer norms under ``split_gather`` whose partial gradients are not
summed over tp, ZeRO reducing over the wrong group (dp x tp), a norm counting replicated
parameters tp times (the clipped step differs), batches not split by the dp coordinate.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hybrid_testlib import MODELS, full, global_batch, make_optimizer, mean_over, reference, rows

from colossal.booster import Booster
from colossal.booster.plugin.hybrid.config import HybridConfig
from colossal.core.testing import distributed_test, relative_error
from colossal.pipeline import PipelineGraph

STEPS = 3
TOL = 2e-5
CLIP = 0.5  # below the reference's gradient norms (about 1-3): every step is clipped
MIXED_TOL = 2e-2  # bf16/fp16 losses against the fp32 reference
UPDATE_TOL = {"fp32": TOL, "bf16": 0.1, "fp16": 0.05}  # weight updates, all held together
NORM_TOL = 1e-5  # GPT-2's replicated parameters (norms, position embeddings, row biases) hold
# 63% of its squared gradient norm: counted tp times, the norm is 20% off


def _micro_step(booster: Booster, model: Any, optimizer: Any, batch: dict[str, Any],
                scale: float) -> torch.Tensor | None:
    """Forward and backward of ``batch`` with its loss scaled; the unscaled loss (or None)."""
    if booster.plugin.pp_size > 1:
        out = booster.execute_pipeline(
            iter([batch]), model, lambda o, mb: o.loss * scale, optimizer, return_loss=True
        )
        return None if out["loss"] is None else out["loss"] / scale
    loss = model(**batch).loss
    booster.backward(loss * scale, optimizer)
    return loss


def _train(
    model_name: str,
    kind: str,
    max_norm: float = 0.0,
    precision: str = "fp32",
    accumulate: int = 1,
    tol: float = TOL,
    **plugin_kwargs: Any,
) -> None:
    """Train ``STEPS`` steps; each of ``accumulate`` micro-steps (all but the last under
    ``booster.no_sync``) takes an equal part of this rank's rows."""
    from colossal.booster.plugin import HybridParallelPlugin

    build = MODELS[model_name]
    ref_losses, ref_norms, ref = reference(build, kind, STEPS, max_norm)
    if max_norm:
        assert min(ref_norms) > max_norm, ref_norms  # clipping changes every step
    plugin = HybridParallelPlugin(precision=precision, max_norm=max_norm, initial_scale=2**10,
                                  **plugin_kwargs)
    model = build()
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, kind))
    what = f"{model_name} {precision} x{accumulate} {plugin_kwargs}"
    if plugin_kwargs.get("scheduler_nodes"):  # the given ZB-V order runs, not a generated one
        assert getattr(plugin.schedule, "schedule", None) is not None, what
    dp_rank = plugin.parallel_dims.coordinate("dp")
    losses, norms = [], []
    for step in range(STEPS):
        batch = rows(global_batch(step), dp_rank, plugin.dp_size)
        optimizer.zero_grad()
        total = 0.0
        for micro in range(accumulate):
            part = {k: v.chunk(accumulate)[micro] for k, v in batch.items()}
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else booster.no_sync(model, optimizer):
                loss = _micro_step(booster, model, optimizer, part, 1 / accumulate)
            total += 0.0 if loss is None else loss.item() / accumulate
        optimizer.step()
        norms.append(optimizer.get_grad_norm())
        if loss is not None:
            losses.append(mean_over(total, plugin.dp_group))
    if losses:
        err = relative_error(torch.tensor(losses), torch.tensor(ref_losses))
        assert err <= tol, f"{what}: losses {losses} vs {ref_losses}"
    if max_norm:
        err = relative_error(torch.tensor(norms), torch.tensor(ref_norms))
        assert err <= max(NORM_TOL, tol), f"{what}: norms {norms} vs {ref_norms}"
    expected = dict(ref.named_parameters(remove_duplicate=False))
    chunks = list(model.unwrap()) if plugin.pp_size > 1 and plugin.config.num_model_chunks > 1 \
        else [model.unwrap()]
    initial = dict(build().named_parameters(remove_duplicate=False))
    mine, theirs = [], []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            start = initial[name].detach().flatten()
            mine.append(full(p).flatten() - start)
            theirs.append(expected[name].detach().flatten() - start)
            if precision == "fp32":
                err = relative_error(full(p), expected[name].detach())
                assert err <= tol, f"{what}: {name} relative error {err:.2e}"
    assert mine, what
    # Mixed precision: the updates of all held weights together, against the reference's
    # (a missing or doubled step is off by 0.3 or more; a bias starting at zero moves by a
    # few lr and rounding may flip the sign of its tiny AdamW steps, hence not per tensor)
    err = relative_error(torch.cat(mine), torch.cat(theirs))
    assert err <= UPDATE_TOL.get(precision, tol), f"{what}: updates relative error {err:.2e}"


@distributed_test(4)
def test_tp2_dp2_zero1_zero2_and_clipping(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    for stage in (1, 2):
        _train("gpt2", "sgd", tp_size=2, pp_size=1, zero_stage=stage)
    _train("gpt2", "sgd", max_norm=CLIP, tp_size=2, pp_size=1, zero_stage=1)


@distributed_test(4)
def test_tp2_pp2_and_pp2_dp2(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    _train("llama", "sgd", tp_size=2, pp_size=2, zero_stage=1, num_microbatches=2)
    _train("gpt2", "sgd", max_norm=CLIP, tp_size=2, pp_size=2, num_microbatches=2)
    _train("gpt2", "sgd", tp_size=1, pp_size=2, zero_stage=1, num_microbatches=4)


@distributed_test(4)
def test_pp2_dp2_interleaved_and_zbv(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    _train("gpt2", "sgd", tp_size=1, pp_size=2, num_microbatches=2, pp_style="interleaved",
           num_model_chunks=2)
    _train("llama", "sgd", tp_size=1, pp_size=2, num_microbatches=2, pp_style="zbv",
           num_model_chunks=2)
    # ColossalAI's scheduler_nodes: the node list PipelineGraph builds (with transfer costs,
    # an order of its own) is what runs, and it trains the same model
    nodes = PipelineGraph(n_stage=2, n_micro=2, c_cost=1.0).get_v_schedule()
    _train("llama", "sgd", tp_size=1, pp_size=2, num_microbatches=2, pp_style="zbv",
           num_model_chunks=2, scheduler_nodes=nodes)


@distributed_test(4)
def test_sequence_parallel_modes_with_dp(rank: int, world_size: int) -> None:
    torch.set_num_threads(1)
    _train("gpt2", "sgd", tp_size=2, pp_size=1, zero_stage=1,
           enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    _train("llama", "sgd", tp_size=1, pp_size=1, sp_size=2, zero_stage=1,
           enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")


@distributed_test(4)
def test_gradient_accumulation_with_and_without_pipeline(rank: int, world_size: int) -> None:
    """Two micro-steps (the first under no_sync) equal one step on their rows.

    Catches a reduction inside no_sync (the first micro-step counted twice, or averaged
    alone) and, with the tied GPT-2 embeddings on two stages, their gradients summed over
    the stages after every call instead of once.
    """
    torch.set_num_threads(1)
    _train("gpt2", "sgd", accumulate=2, tp_size=2, pp_size=1, zero_stage=1)
    _train("gpt2", "sgd", accumulate=2, tp_size=1, pp_size=2, num_microbatches=2)


@distributed_test(4)
def test_bf16_and_fp16(rank: int, world_size: int) -> None:
    """Mixed precision against the fp32 reference (fp32 masters; AdamW)."""
    torch.set_num_threads(1)
    _train("llama", "adamw", precision="bf16", tol=MIXED_TOL, tp_size=2, pp_size=2,
           num_microbatches=2)
    _train("gpt2", "adamw", precision="fp16", tol=MIXED_TOL, tp_size=2, pp_size=1,
           zero_stage=2)


def _config(**kwargs: Any) -> HybridConfig:
    return HybridConfig(**{"tp_size": 1, "pp_size": 1, "world_size": 8, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 3}, r"tp_size=3 x pp_size=1 x sp_size=1 = 3 does not divide the world"),
        ({"tp_size": 0}, r"tp_size=0 must be an int >= 1"),
        ({"pp_size": 2, "zero_stage": 2, "num_microbatches": 2}, r"zero_stage=2 with pp_size=2"),
        ({"pp_size": 2}, r"pp_size=2 needs num_microbatches or microbatch_size"),
        ({"zero_stage": 3}, r"zero_stage=3 must be 0, 1 or 2"),
        ({"pp_size": 2, "num_microbatches": 2, "pp_style": "gpipe"}, r"pp_style='gpipe'"),
        ({"pp_size": 2, "num_microbatches": 2, "pp_style": "interleaved"},
         r"num_model_chunks >= 2"),
        ({"pp_size": 2, "num_microbatches": 2, "pp_style": "zbv", "num_model_chunks": 3},
         r"2 model chunks"),
        ({"pp_size": 2, "num_microbatches": 2, "num_model_chunks": 2}, r"pp_style='1f1b'"),
        ({"pp_size": 2, "num_microbatches": 2, "num_layers_per_stage": (1, 2, 1)},
         r"has 3 entries; give one per stage and chunk \(2 x 1\)"),
        ({"sp_size": 2}, r"sp_size=2 needs enable_sequence_parallelism=True"),
        ({"enable_sequence_parallelism": True}, r"'split_gather' needs tp_size > 1"),
        ({"enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all"},
         r"'all_to_all' needs sp_size > 1"),
        ({"enable_sequence_parallelism": True, "tp_size": 2, "sp_size": 2},
         r"sp_size=2 must be None or 1"),
        ({"enable_sequence_parallelism": True, "sequence_parallelism_mode": "ulysses"},
         r"'ulysses' is not one of"),
        ({"precision": "fp8"}, r"fp8"),
        ({"max_norm": -1.0}, r"max_norm=-1.0 must be >= 0"),
    ],
)
def test_invalid_layouts_fail_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**kwargs)


def test_valid_layout_sizes() -> None:
    cfg = _config(tp_size=2, pp_size=2, num_microbatches=4)
    assert cfg.dp_size == 2
    cfg = _config(sp_size=2, enable_sequence_parallelism=True,
                  sequence_parallelism_mode="ring_attn")
    assert (cfg.dp_size, cfg.sp_group_of_its_own) == (4, True)


@distributed_test(2)
def test_pipeline_model_refuses_a_direct_call(rank: int, world_size: int) -> None:
    from colossal.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32")
    model = MODELS["gpt2"]()
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, "sgd"))
    with pytest.raises(RuntimeError, match="execute_pipeline"):
        model(**global_batch(0))
    assert dist.get_world_size(plugin.pp_group) == 2
