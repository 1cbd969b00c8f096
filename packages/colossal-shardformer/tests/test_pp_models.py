"""Pipeline stages driven by colossal-pipeline's schedules against the unsharded model.

Every family and head of ``_pp_cases.CASES`` (GPT-2, BERT, ViT, OPT, Bloom with written
plans; Llama and tied Qwen2 with plans derived from ``base_model_pp_plan``; causal LM,
sequence and image classification, masked LM) runs 2 SGD steps through a schedule on gloo;
the unsharded model runs the same steps on the whole batch in the same process. Checked at
relative error <= 1e-5 (fp32): the loss (mean of the microbatch losses; equal token counts),
every held parameter's gradient against the same-named reference gradient, and every held
parameter after the steps (tied input/output embeddings on two stages stay equal to the
reference, hence to each other, only if their gradients are summed between the stages).

Spawns (CI budget): one 2-rank run of every case x {1F1B, interleaved (2 chunks), ZB-V} plus
an explicit ``num_layers_per_stage``; one 4-rank run of PP 4 with 1F1B over every case; one
4-rank run of TP 2 x PP 2 (GPT-2, Llama, tied Qwen2, BERT masked LM with 1F1B; GPT-2 ZB-V).
What they catch beyond test_pp_plan (same-process chaining): a parameter held by no rank
or by two (the partition check), a stage output that does not survive the point-to-point
transfer (non-tensor leaves, namedtuples), gradients not flowing back through the received
hidden state, a tied weight whose gradient is not reported as shared (or reported on one
stage under ZB-V), layers placed on the wrong rank for the interleaved/V layouts, and tensor
parallelism applied per chunk that breaks on placeholders (a vocab-parallel head on a last
stage without the embedding must shard its own weight with the same padding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _pp_cases import CASES, PPCase, build_pair, chunk_list, held_parameters

from colossal.core import ProcessGroupMesh, sharded_view
from colossal.core.testing import distributed_test, relative_error

RTOL = 1e-5
STEPS = 2


def _error(actual: torch.Tensor, expected: torch.Tensor, floor: float) -> float:
    """Relative error, normalized by at least ``floor``.

    Key biases get mathematically zero gradients (softmax ignores a per-query constant), so
    theirs are rounding noise that differs with the microbatch split; normalizing by a floor
    (a thousandth of the model's gradient norm) compares such noise absolutely.
    """
    diff = float(torch.linalg.vector_norm((actual.double() - expected.double()).flatten()))
    return diff / max(float(torch.linalg.vector_norm(expected.double().flatten())), floor)


def _full(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    view = sharded_view(t, like=like)
    return t.detach() if view is None else view.gather()


def _run(
    case: PPCase,
    manager: Any,
    make_schedule: Callable[[Any], Any],
    tp_group: Any = None,
) -> None:
    from colossal.shardformer import ShardConfig, ShardFormer

    what = f"{case.name} on {manager!r}" + (" with TP" if tp_group is not None else "")
    ref, model = build_pair(case)
    config = ShardConfig(
        pipeline_stage_manager=manager,
        enable_tensor_parallelism=tp_group is not None,
        tensor_parallel_process_group=tp_group,
    )
    out, shared = ShardFormer(config).optimize(model)
    chunks = chunk_list(out)
    assert len(chunks) == manager.num_model_chunks, what
    schedule = make_schedule(shared)
    params = dict(held_parameters(chunks))
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # lm_head.weight too
    assert set(params) <= set(ref_params), f"{what}: {set(params) - set(ref_params)}"
    if tp_group is None:  # the pipeline is the whole job: check the partition across ranks
        _check_partition(chunks, ref, what)
    last = manager.layout.num_slices - 1
    holds_last = any(c._colossal_pipeline_slice == last for c in chunks)
    opt = torch.optim.SGD(list(params.values()), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    batch = case.batch()
    for step in range(STEPS):
        result = schedule.forward_backward_step(
            out, iter([batch]), criterion=lambda o, mb: o.loss, return_loss=True
        )
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        if holds_last:
            err = relative_error(result["loss"], ref_loss.detach())
            assert err <= RTOL, f"{what} step {step}: loss error {err:.2e}"
        else:
            assert result["loss"] is None, what
        norms = [float(q.grad.norm()) for q in ref_params.values() if q.grad is not None]
        floor = 1e-3 * float(torch.tensor(norms).norm())
        for name, p in params.items():
            assert p.grad is not None, f"{what} step {step}: {name} got no gradient"
            err = _error(_full(p.grad, p), ref_params[name].grad, floor)
            assert err <= RTOL, f"{what} step {step}: grad of {name} error {err:.2e}"
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    floor = 1e-3 * float(torch.tensor([float(q.norm()) for q in ref.parameters()]).norm())
    for name, p in params.items():
        err = _error(_full(p, p), ref_params[name].detach(), floor)
        assert err <= RTOL, f"{what}: {name} after {STEPS} steps, error {err:.2e}"


def _check_partition(chunks: list[Any], ref: Any, what: str) -> None:
    """Every parameter name of the model is held by exactly one rank."""
    import torch.distributed as dist

    mine = sorted({n for c in chunks for n, _ in c.named_parameters(remove_duplicate=False)})
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    holders: dict[str, list[int]] = {}
    for rank, names in enumerate(everyone):
        for n in names:
            holders.setdefault(n, []).append(rank)
    expected = {n for n, _ in ref.named_parameters(remove_duplicate=False)}
    assert set(holders) == expected, f"{what}: {set(holders) ^ expected}"
    repeated = {n: ranks for n, ranks in holders.items() if len(ranks) > 1}
    assert not repeated, f"{what}: held by several ranks: {repeated}"


def _schedules(kind: str, mesh: Any, **manager_kwargs: Any) -> tuple[Any, Callable[[Any], Any]]:
    from colossal.pipeline import (
        InterleavedSchedule,
        OneForwardOneBackwardSchedule,
        PipelineStageManager,
        ZeroBubbleVPipeScheduler,
    )

    if kind == "1f1b":
        sm = PipelineStageManager(mesh, "pp", **manager_kwargs)
        return sm, lambda shared: OneForwardOneBackwardSchedule(
            sm, num_microbatches=2, shared_params=shared
        )
    if kind == "interleaved":
        sm = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2)
        return sm, lambda shared: InterleavedSchedule(
            sm, 2, num_microbatches=2, shared_params=shared
        )
    sm = PipelineStageManager(mesh, "pp", num_model_chunks=2, use_zbv=True)
    return sm, lambda shared: ZeroBubbleVPipeScheduler(
        sm, 2, num_microbatches=2, shared_params=shared
    )


@distributed_test(2)
def test_pp2_every_family_1f1b_interleaved_zbv(rank: int, world_size: int) -> None:
    """PP 2: every case with 1F1B, interleaved (2 chunks) and ZB-V; an explicit split."""
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    for case in CASES.values():
        for kind in ("1f1b", "interleaved", "zbv"):
            sm, make = _schedules(kind, mesh)
            _run(case, sm, make)
    sm, make = _schedules("1f1b", mesh, num_layers_per_stage=[1, 3])
    _run(CASES["llama-lm"], sm, make)


@distributed_test(4)
def test_pp4_every_family_1f1b(rank: int, world_size: int) -> None:
    """PP 4 with 1F1B: one layer per stage, middle stages neither first nor last."""
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    for case in CASES.values():
        sm, make = _schedules("1f1b", mesh)
        _run(case, sm, make)


@distributed_test(4)
def test_tp2_x_pp2(rank: int, world_size: int) -> None:
    """TP 2 x PP 2: tensor parallelism applied to each stage's chunk after the split."""
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "tp"))
    tp_group = mesh.get_group_along_axis("tp")
    for name in ("gpt2-lm", "llama-lm", "qwen2-lm-tied", "bert-mlm"):
        sm, make = _schedules("1f1b", mesh)
        _run(CASES[name], sm, make, tp_group=tp_group)
    # ZB-V: embedding and tied head on stage 0 in two chunks share one sharded Parameter
    sm, make = _schedules("zbv", mesh)
    _run(CASES["gpt2-lm"], sm, make, tp_group=tp_group)
