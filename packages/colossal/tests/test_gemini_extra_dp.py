"""GeminiPlugin(extra_dp_size=2): chunks sharded over a zero group, replicated across extra dp.

At world 4 the data-parallel ranks are extra_dp 2 x zero 2: every chunk is sharded over 2
ranks (not 4), the gradient shards are reduce-scattered over the zero group and averaged
over the extra-dp group. Every check compares against one fp32 process running AdamW on the
global batch (``booster_testlib``), per tensor relative to the reference's norm: fp32 at
``TOL`` (5e-5: the gradients are summed in two stages, zero then extra dp, and Adam's first
steps amplify that rounding of near-zero elements to ~1.2e-5, as ``test_gemini_plugin``'s
``TOL``), bf16 at ``TOL_BF16`` (4e-2); the losses at ``LOSS_TOL`` (1e-5).

What a wrong composition gives: shards of the whole world (shard size a quarter of the
chunk, not a half), gradients not averaged over the replicas (each replica steps on half
of the batch: parameters differ by > 1e-2), averaged twice or summed (the step doubles), a
norm summed over the replicas too (clipping off by sqrt(2)), accumulated gradients left
unaveraged, a checkpoint written by both replicas (the same bytes twice, at once) or missing
tensors, a load that fills only replica 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from booster_testlib import (
    GLOBAL_BATCH,
    full_state,
    local_batch,
    make_booster,
    make_model,
    make_optimizer,
    reference,
    train_steps,
)
from torch import nn

from colossal.core.testing import distributed_test, relative_error

STEPS = 3
LR = 3e-2
TOL = 5e-5
LOSS_TOL = 1e-5
TOL_BF16 = 4e-2
CLIP = 0.5
#: Small chunks: the 435-parameter MLP spans several chunks, each sharded over the zero group.
CHUNK = {"chunk_size": 128}


def _clipped_reference(steps: int) -> dict[str, torch.Tensor]:
    """The reference with ``clip_grad_norm_(CLIP)`` at every step (fp32, global batch)."""
    from booster_testlib import batch

    model = make_model()
    optimizer = make_optimizer(model, lr=LR)
    for step in range(steps):
        x, y = batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_state(what: str, state: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                 tol: float) -> None:
    assert state.keys() == want.keys(), what
    for name, ref in want.items():
        err = relative_error(state[name].float(), ref)
        assert err <= tol, f"{what}: {name} differs from the reference by {err:.2e} > {tol}"


def _boost(precision: str = "fp32", **kwargs: Any) -> tuple[Any, Any, Any]:
    booster = make_booster("gemini", precision, chunk_config_dict=CHUNK, extra_dp_size=2,
                           **kwargs)  # fmt: skip
    model = make_model()
    model, optimizer, *_ = booster.boost(model, make_optimizer(model, lr=LR))
    return booster, model, optimizer


@distributed_test(4)
def test_extra_dp_matches_single_process(rank: int, world_size: int, tmp_path: Path) -> None:
    """Layout, fp32/bf16 training, clipping, accumulation and a checkpoint roundtrip.

    One spawn of 4 ranks checks: the zero group {0,1}/{2,3} and extra-dp group {0,2}/{1,3}
    (from ``ParallelDims(dp=4, dp_shard=2)``), each chunk's shard is half of it; 3 AdamW
    steps in fp32 and bf16 equal the reference (losses and parameters); fp32 with
    ``max_norm`` equals ``clip_grad_norm_`` (the norm counts each shard once); two
    micro-batches under ``no_sync`` equal the large batch; a checkpoint saved under
    extra_dp_size=2 loads into plain Gemini over all 4 ranks and back into extra_dp_size=2,
    and the next step trains alike (model and optimizer state restored on every replica).
    """
    ref_losses, ref_state = reference(STEPS, lr=LR)
    booster, model, optimizer = _boost()
    plugin = booster.plugin
    assert (plugin.zero_size, plugin.extra_dp_size, plugin.dp_size) == (2, 2, 4)
    assert dist.get_process_group_ranks(plugin.zero_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(plugin.extra_dp_group) == [rank % 2, rank % 2 + 2]
    chunks = model.chunk_manager.chunks
    assert len(chunks) > 1
    for chunk in chunks:
        assert chunk.world_size == 2 and chunk.shard.numel() * 2 == chunk.chunk_size

    losses = train_steps(model, optimizer, booster, range(STEPS), rank, world_size)
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= LOSS_TOL * abs(want), f"fp32: loss {got} != {want}"
    _check_state("fp32", model.state_dict(), ref_state, TOL)

    _, bf16, bf16_opt = _boost("bf16")
    losses = train_steps(bf16, bf16_opt, booster, range(STEPS), rank, world_size)
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= TOL_BF16 * abs(want), f"bf16: loss {got} != {want}"
    _check_state("bf16", bf16.state_dict(), ref_state, TOL_BF16)

    clipped = _clipped_reference(STEPS)
    assert relative_error(clipped["head.weight"], ref_state["head.weight"]) > 1e-2
    _, model_c, opt_c = _boost(max_norm=CLIP)
    train_steps(model_c, opt_c, booster, range(STEPS), rank, world_size)
    _check_state("clip", model_c.state_dict(), clipped, TOL)

    acc_booster, model_a, opt_a = _boost(enable_gradient_accumulation=True)
    half = GLOBAL_BATCH // world_size // 2
    for step in range(STEPS):
        x, y = local_batch(step, rank, world_size)
        with acc_booster.no_sync(model_a, opt_a):
            first = nn.functional.mse_loss(model_a(x[:half]), y[:half]) / 2
            acc_booster.backward(first, opt_a)
        second = nn.functional.mse_loss(model_a(x[half:]), y[half:]) / 2
        acc_booster.backward(second, opt_a)
        opt_a.step()
        opt_a.zero_grad()
    _check_state("accumulation", model_a.state_dict(), ref_state, TOL)

    # Checkpoint: save under extra_dp_size=2, load under plain Gemini (zero over 4 ranks)
    # and under extra_dp_size=2 again; one more step trains each of them alike.
    root = str(tmp_path / "ckpt")
    booster.save_model(model, root, shard=True, size_per_shard=1)
    booster.save_optimizer(optimizer, root, shard=True, size_per_shard=1)
    plain = make_booster("gemini", "fp32", chunk_config_dict=CHUNK)
    assert plain.plugin.zero_size == 4
    model_p = make_model(seed=7)
    model_p, opt_p, *_ = plain.boost(model_p, make_optimizer(model_p, lr=LR))
    plain.load_model(model_p, root)
    plain.load_optimizer(opt_p, root)
    again, model_r, opt_r = _boost()
    again.load_model(model_r, root)
    again.load_optimizer(opt_r, root)
    saved = model.state_dict()
    _check_state("plain load", model_p.state_dict(), saved, 0.0)
    _check_state("extra-dp load", model_r.state_dict(), saved, 0.0)
    for b, m, o in ((booster, model, optimizer), (plain, model_p, opt_p),
                    (again, model_r, opt_r)):  # fmt: skip
        train_steps(m, o, b, range(STEPS, STEPS + 1), rank, world_size)
    after = model.state_dict()
    _check_state("plain resumed", model_p.state_dict(), after, TOL)
    _check_state("extra-dp resumed", model_r.state_dict(), after, TOL)
    assert full_state(model_r, again).keys() == after.keys()


def test_extra_dp_checkpoint_loads_in_one_process(tmp_path: Path) -> None:
    """The world-4 extra-dp checkpoint holds every tensor once, full: one process loads it.

    Runs the save in a spawn of 4 ranks (extra_dp 2 x zero 2), then loads the directory
    with ``safetensors`` and with a plain single-process model here and compares with the
    boosted model's state (gathered in the spawn).
    """
    from safetensors.torch import load_file

    from colossal.core.testing import spawn

    root = str(tmp_path / "ckpt")
    results = spawn(_train_and_save, 4, args=(root,))
    assert [wrote for _, wrote in results] == [True, True, False, False]  # extra-dp rank 0
    state = results[0][0]
    assert all(s.keys() == state.keys() for s, _ in results)
    files = sorted(Path(root).glob("model*.safetensors"))
    assert files, f"no model files in {root}"
    saved: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file))
        assert not saved.keys() & part.keys(), "a tensor written twice"
        saved.update(part)
    _check_state("files", saved, state, 0.0)
    model = make_model(seed=7)
    model.load_state_dict(saved)
    _check_state("one process", model.state_dict(), state, 0.0)


def _train_and_save(
    rank: int, world_size: int, root: str
) -> tuple[dict[str, torch.Tensor], bool]:
    """Train 2 steps under extra_dp_size=2, save; the state and whether this rank wrote."""
    booster, model, optimizer = _boost()
    train_steps(model, optimizer, booster, range(2), rank, world_size)
    io = booster.checkpoint_io
    wrote = []
    save = io._save_model
    io._save_model = lambda *a, **k: (wrote.append(True), save(*a, **k))  # type: ignore
    booster.save_model(model, root, shard=True, size_per_shard=1)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, bool(wrote)


@distributed_test(4)
def test_extra_dp_sizes_that_do_not_divide_the_world(rank: int, world_size: int) -> None:
    """``tp_size * extra_dp_size`` not dividing the world, or a dp_group, is a clear error."""
    from colossal.booster.plugin import GeminiPlugin

    cases = [
        ({"extra_dp_size": 3}, r"tp_size=1 x extra_dp_size=3 = 3 does not divide the world "
                               r"size 4"),
        ({"extra_dp_size": 4, "tp_size": 2}, r"tp_size=2 x extra_dp_size=4 = 8 does not "
                                             r"divide the world size 4"),
        ({"extra_dp_size": 2, "dp_group": dist.group.WORLD}, r"extra_dp_size=2, dp_group"),
        ({"extra_dp_size": 0}, r"extra_dp_size=0 must be an int >= 1"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            GeminiPlugin(**kwargs)
    plugin = GeminiPlugin(extra_dp_size=4)  # zero group of one rank: pure replication
    assert (plugin.zero_size, plugin.extra_dp_size) == (1, 4)
