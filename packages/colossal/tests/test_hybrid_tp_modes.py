"""HybridParallelPlugin(tensor_parallel_mode="2d"): training, clipping and checkpoints.

Llama (grouped-query attention, RMSNorm) trained 3 AdamW steps with every step clipped
(``max_norm`` below the gradient norms), in 2D on a 2 x 2 grid at world 4 and as data parallel
2 x that grid with ZeRO-1 at world 8, against the single-process model on the global batch:
losses, the global gradient norms (colossal.core's over the layers' marks: a grid part counts
once, a replicated embedding once per grid) and every parameter afterwards. At world 4 the
model saved through the Booster loads with ``from_pretrained`` (one process) and back into a
fresh 2D model, both holding exactly the trained weights.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hybrid_testlib import full, global_batch, llama, make_optimizer, mean_over, reference, rows

from colossal.booster import Booster
from colossal.booster.plugin.hybrid.config import HybridConfig
from colossal.core.comm import all_gather_object
from colossal.core.testing import distributed_test, relative_error

STEPS = 3
TOL = 2e-5
CLIP = 0.5


def _train(**plugin_kwargs: Any) -> tuple[Booster, Any]:
    """3 clipped AdamW steps of Llama in the plugin's layout, checked against the reference."""
    from colossal.booster.plugin import HybridParallelPlugin

    ref_losses, ref_norms, ref = reference(llama, "adamw", STEPS, CLIP)
    assert min(ref_norms) > CLIP, ref_norms
    plugin = HybridParallelPlugin(precision="fp32", max_norm=CLIP, **plugin_kwargs)
    booster = Booster(plugin=plugin)
    model = llama()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, "adamw"))
    dp_rank = plugin.parallel_dims.coordinate("dp")
    losses, norms = [], []
    for step in range(STEPS):
        batch = rows(global_batch(step), dp_rank, plugin.dp_size)
        optimizer.zero_grad()
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        norms.append(optimizer.get_grad_norm())
        losses.append(mean_over(loss.item(), plugin.dp_group))
    what = str(plugin_kwargs)
    assert relative_error(torch.tensor(losses), torch.tensor(ref_losses)) <= TOL, what
    assert relative_error(torch.tensor(norms), torch.tensor(ref_norms)) <= TOL, what
    expected = dict(ref.named_parameters())
    sharded = 0
    for name, p in model.unwrap().named_parameters():
        err = relative_error(full(p), expected[name].detach())
        assert err <= TOL, f"{what}: {name} relative error {err:.2e}"
        sharded += full(p).shape != p.shape
    assert sharded == 4 * 9, f"{what}: {sharded} grid parameters"  # 7 linears + 2 norms a layer
    return booster, model


@distributed_test(4, timeout=600.0)
def test_hybrid_2d_trains_clips_and_saves_like_the_plain_model(rank: int, world_size: int) -> None:
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    booster, model = _train(tp_size=4, pp_size=1, tensor_parallel_mode="2d")
    held = {n: full(p) for n, p in model.unwrap().named_parameters()}
    root = all_gather_object(tempfile.mkdtemp() if rank == 0 else None)[0]
    try:
        booster.save_model(model, f"{root}/grid", shard=True, size_per_shard=1)
        plain = dict(LlamaForCausalLM.from_pretrained(f"{root}/grid").named_parameters())
        assert set(plain) == set(held)
        for name, value in held.items():
            assert torch.equal(plain[name].detach(), value), name
        from colossal.booster.plugin import HybridParallelPlugin

        fresh_booster = Booster(
            plugin=HybridParallelPlugin(tp_size=4, pp_size=1, precision="fp32",
                                        tensor_parallel_mode="2d")
        )  # fmt: skip
        fresh = llama()
        fresh, *_ = fresh_booster.boost(fresh, make_optimizer(fresh, "adamw"))
        fresh_booster.load_model(fresh, f"{root}/grid")
        for name, p in fresh.unwrap().named_parameters():
            assert torch.equal(full(p), held[name]), name
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


@distributed_test(8, timeout=900.0)
def test_hybrid_dp2_x_2d_zero1_matches_the_plain_model(rank: int, world_size: int) -> None:
    """Each data-parallel replica's SUMMA stays in its own grid; ZeRO-1 shards the grid parts
    over dp and the one norm counts every element once."""
    torch.set_num_threads(1)
    _train(tp_size=4, pp_size=1, zero_stage=1, tensor_parallel_mode="2d")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_mode": "4d"}, r"tensor_parallel_mode='4d' must be one of"),
        ({"tensor_parallel_mode": "2d", "tp_depth": 2}, r"tp_depth=2 applies to .*'2.5d' only"),
        ({"tensor_parallel_mode": "2d", "pp_size": 2, "num_microbatches": 2},
         r"tensor_parallel_mode='2d' does not support pp_size=2"),
    ],
)  # fmt: skip
def test_grid_mode_options_are_validated(kwargs: dict[str, Any], match: str) -> None:
    layout = {"tp_size": 4, "pp_size": 1, "world_size": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        HybridConfig(**layout)
