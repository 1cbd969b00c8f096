"""MoeHybridParallelPlugin with tensor or pipeline parallelism next to expert parallelism.

World 4, a tiny Mixtral from a config, fp32, AdamW with clipping active on every step,
dropless routing: tp 2 x ep 2 (dp 2, moe_dp 1) and pp 2 x ep 2 (1F1B, 2 microbatches).
Each is compared with one process training the whole model on the whole global batch: the
losses, the clipped gradient norms, every parameter this rank holds (tensor-parallel parts
gathered, experts as this rank's ep block) and the checkpoint ``booster.save_model`` writes,
read back by ``from_pretrained``.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from moe_hybrid_testlib import (
    MAX_NORM,
    RTOL,
    adamw,
    batch,
    expected_part,
    held_whole,
    mean_over,
    mixtral,
    reference,
    rows,
)

from colossal.booster import Booster
from colossal.core import shard_spec
from colossal.core.comm import all_gather_object
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.zero import is_expert_param

STEPS = 2


def _train_and_check(rank: int, **plugin_kwargs: Any) -> Booster:
    """Train ``STEPS`` clipped steps under the plugin; check losses, norms, parameters."""
    from transformers import MixtralForCausalLM

    from colossal.booster.plugin import MoeHybridParallelPlugin

    torch.set_num_threads(1)
    ref_losses, ref_norms, ref = reference(mixtral, STEPS, adamw)
    assert min(ref_norms) > 2 * MAX_NORM, ref_norms  # clipping is active
    plugin = MoeHybridParallelPlugin(precision="fp32", max_norm=MAX_NORM, **plugin_kwargs)
    booster = Booster(plugin=plugin)
    model = mixtral()
    boosted, optimizer, *_ = booster.boost(model, adamw(model))
    dp_rank = plugin.parallel_dims.coordinate("dp")
    losses, norms = [], []
    for step in range(STEPS):
        mine = rows(batch(step), dp_rank, plugin.dp_size)
        optimizer.zero_grad()
        if plugin.pp_size > 1:
            out = booster.execute_pipeline(iter([mine]), boosted, lambda o, mb: o.loss, optimizer)
            loss = out["loss"]
        else:
            loss = boosted(**mine).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        norms.append(optimizer.get_grad_norm())
        if loss is not None:
            losses.append(mean_over(loss.item(), plugin.dp_group))
    what = f"{plugin_kwargs}"
    if losses:  # ranks holding the last stage
        assert_rel_close(torch.tensor(losses), torch.tensor(ref_losses), RTOL, f"{what} losses")
    assert_rel_close(torch.tensor(norms), torch.tensor(ref_norms), RTOL, f"{what} norms")
    optimizer.wait_params()
    whole = dict(ref.named_parameters())
    held = list(boosted.unwrap().named_parameters())
    assert held, what
    experts = 0
    for name, p in held:
        experts += ".experts." in name
        assert is_expert_param(p) == (".experts." in name and plugin.ep_size > 1), name
        want = expected_part(p, whole[name].detach(), plugin.ep_group)
        assert_rel_close(held_whole(p), want, RTOL, f"{what} {name}")
        if is_expert_param(p) and plugin.tp_size > 1:
            spec = shard_spec(p)
            assert spec is not None and spec.axis("tp") is not None, name  # replicated over tp
    # pp: one layer per stage (gate_up_proj, down_proj); tp: both layers' on every rank
    assert experts == (2 if plugin.pp_size > 1 else 4), (what, experts)
    _check_checkpoint(rank, booster, boosted, optimizer, whole, MixtralForCausalLM)
    return booster


def _check_checkpoint(
    rank: int,
    booster: Booster,
    boosted: Any,
    optimizer: Any,
    whole: dict[str, torch.Tensor],
    cls: Any,
) -> None:
    """The saved model (every expert of every stage, tp parts joined) loads with
    from_pretrained, and model plus optimizer loaded at ep 2 x moe_dp 2 (no tp, no pp)
    continue the one-process run for one more step."""
    from colossal.booster.plugin import MoeHybridParallelPlugin

    root = all_gather_object(tempfile.mkdtemp(prefix="moe_tp_pp_") if rank == 0 else None)[0]
    assert root is not None
    try:
        booster.save_model(boosted, f"{root}/model", shard=True)
        booster.save_optimizer(optimizer, f"{root}/optim", shard=True, size_per_shard=1)
        dist.barrier()
        loaded = dict(cls.from_pretrained(f"{root}/model").named_parameters())
        assert sorted(loaded) == sorted(whole)
        for name, q in whole.items():
            assert_rel_close(loaded[name].detach(), q.detach(), RTOL, f"from_pretrained {name}")
        *_, ref = reference(mixtral, STEPS + 1, adamw)
        plugin = MoeHybridParallelPlugin(ep_size=2, precision="fp32", max_norm=MAX_NORM)
        other = Booster(plugin=plugin)
        fresh = mixtral()
        model, opt, *_ = other.boost(fresh, adamw(fresh))
        other.load_model(model, f"{root}/model")
        other.load_optimizer(opt, f"{root}/optim")
        opt.zero_grad()
        other.backward(model(**rows(batch(STEPS), rank, 4)).loss, opt)
        opt.step()
        opt.wait_params()
        after = dict(ref.named_parameters())
        for name, p in model.unwrap().named_parameters():
            want = expected_part(p, after[name].detach(), plugin.ep_group)
            assert_rel_close(p.detach(), want, RTOL, f"continued at ep 2 {name}")
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


@distributed_test(4, timeout=150, comm_timeout=60)
def test_tp2_ep2_matches_single_process_and_from_pretrained(rank: int, world_size: int) -> None:
    """Catches: experts tensor-split by the model's TP plan (``moe_tp_experts`` refused, or
    half the experts' features per rank), experts not expert-parallel inside dp, expert
    gradients not divided by ep or averaged over tp, experts counted tp times in the clipped
    norm (no tp record), the dense layers not split or their gradients wrong, a checkpoint
    missing an ep rank's experts or a tp part, and optimizer states saved under tp x ep
    that do not continue the run at ep 2 x moe_dp 2 (an expert's or a tp part's states
    missing: Adam restarts, a first-step update of ``lr``)."""
    _train_and_check(rank, tp_size=2, ep_size=2, zero_stage=1)


@distributed_test(4, timeout=150, comm_timeout=60)
def test_tp2_ep1_zero2_and_tp_not_dividing_heads(rank: int, world_size: int) -> None:
    """Catches: at ep 1 the model's TP plan reaching the experts (``moe_tp_experts`` refused)
    or experts counted twice over tp in the norm, ZeRO-2 over dp with tp wrong, and a tp size
    not dividing the KV heads accepted (it must name the count and the size)."""
    from colossal.booster.plugin import MoeHybridParallelPlugin

    _train_and_check(rank, tp_size=2, ep_size=1, zero_stage=2)
    booster = Booster(plugin=MoeHybridParallelPlugin(tp_size=4, precision="fp32"))
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 is not divisible by .* 4"):
        booster.boost(mixtral())


@distributed_test(4, timeout=150, comm_timeout=60)
def test_pp2_ep2_matches_single_process_and_from_pretrained(rank: int, world_size: int) -> None:
    """Catches: a stage's experts not expert-parallel (all-to-all over the wrong ranks, or
    over other stages' ranks), microbatch gradients reduced per microbatch instead of once
    (experts or dense), a stage's norm counted on both stages or missed, the loss not the
    mean over microbatches, and a checkpoint missing a stage's experts."""
    _train_and_check(rank, pp_size=2, ep_size=2, zero_stage=1, num_microbatches=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sp_size": 2}, r"sp_size=2"),
        ({"enable_sequence_parallelism": True}, r"enable_sequence_parallelism=True"),
        ({"tensor_parallel_mode": "2d"}, r"tensor_parallel_mode='2d'.*'1d'"),
        ({"pp_style": "interleaved"}, r"pp_style='interleaved'.*'1f1b'"),
        ({"num_model_chunks": 2}, r"num_model_chunks=2"),
    ],
)
def test_unsupported_combinations_are_refused(kwargs: dict[str, Any], match: str) -> None:
    """Catches: sequence parallelism, grid tensor parallelism or interleaved/ZB-V pipelines
    accepted with experts (they would split tokens or layers the experts do not follow)."""
    from colossal.booster.plugin import MoeHybridParallelPlugin

    with pytest.raises(NotImplementedError, match=match):
        MoeHybridParallelPlugin(ep_size=2, **kwargs)
