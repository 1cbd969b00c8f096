"""Stage manager on a 2-D mesh, and the errors users get for bad settings or batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import (
    RTOL,
    Block,
    compare_grads,
    make_stage_manager,
    mse_to_flipped,
    reference,
    split_model,
)
from torch import nn

from colossal.core import ProcessGroupMesh
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.pipeline import (
    GPipeSchedule,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
)
from colossal.pipeline.microbatch import merge_outputs, resolve_num_microbatches, split_batch


@distributed_test(4)
def test_stage_manager_on_pp_by_dp_mesh(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("pp", "dp"))  # rank r sits at (r // 2, r % 2)
    sm = PipelineStageManager(mesh, "pp")
    assert sm.num_stages == 2 and sm.stage == rank // 2
    assert sm.stage_ranks == [rank % 2, rank % 2 + 2]
    assert sm.next_rank == sm.prev_rank == (rank + 2) % 4
    assert sm.is_first_stage() == (rank < 2) and sm.is_last_stage() == (rank >= 2)
    assert dist.get_process_group_ranks(sm.pp_group) == sm.stage_ranks
    group = sm.init_process_group_by_stages([0, 1])
    assert dist.get_process_group_ranks(group) == sm.stage_ranks
    assert sm.distribute_layers(5) == [2, 3]
    assert sm.get_stage_index([2, 3]) == ((0, 2) if sm.stage == 0 else (2, 5))

    # a pipeline on the mesh's first axis still matches the reference (peers are global ranks)
    torch.manual_seed(rank % 2)
    layers = nn.ModuleList(Block(8) for _ in range(4))
    batch = torch.randn(4, 8)
    ref_loss, ref = reference(layers, batch, mse_to_flipped)
    model = split_model(layers, sm)
    out = OneForwardOneBackwardSchedule(sm, num_microbatches=4).forward_backward_step(
        model[0], iter([batch]), mse_to_flipped, return_loss=True
    )
    compare_grads(layers, ref, model, f"pp x dp rank {rank}")
    if sm.is_last_stage():
        assert_rel_close(out["loss"], ref_loss, RTOL, "loss")

    v = PipelineStageManager(mesh, "pp", num_model_chunks=2, use_zbv=True)
    assert v.get_stage_index([1, 1, 1, 1]) == (
        [(0, 1), (3, 4)] if v.stage == 0 else [(1, 2), (2, 3)]
    )
    with v.switch_model_chunk_id(1):
        assert v.is_last_stage() == (v.stage == 0)
    assert v.is_first_stage(model_chunk_id=0) == (v.stage == 0)
    assert v.is_last_stage(ignore_chunk=True) == (v.stage == 1)
    with pytest.raises(ValueError, match="no model chunk is current"):
        v.is_last_stage()


@distributed_test(2)
def test_clear_errors(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, axis_names=("pp",))
    with pytest.raises(ValueError, match="needs enable_interleave=True"):
        PipelineStageManager(mesh, "pp", num_model_chunks=2)
    with pytest.raises(ValueError, match="use_zbv=True needs num_model_chunks=2"):
        PipelineStageManager(mesh, "pp", num_model_chunks=3, use_zbv=True)
    with pytest.raises(ValueError, match="num_layers_per_stage needs 2"):
        PipelineStageManager(mesh, "pp", num_layers_per_stage=[1, 2, 3])
    explicit = PipelineStageManager(mesh, "pp", num_layers_per_stage=[1, 4])
    assert explicit.distribute_layers(5) == [1, 4]
    with pytest.raises(ValueError, match="sums to 5, but the model has 6"):
        explicit.distribute_layers(6)

    sm = make_stage_manager(2)
    sm2 = make_stage_manager(2, chunks=2)
    with pytest.raises(ValueError, match="needs num_microbatches or microbatch_size"):
        OneForwardOneBackwardSchedule(sm)
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        OneForwardOneBackwardSchedule(sm, num_microbatches=0)
    with pytest.raises(ValueError, match="use InterleavedSchedule"):
        OneForwardOneBackwardSchedule(sm2, num_microbatches=2)
    with pytest.raises(ValueError, match="multiple of the 2 stages"):
        InterleavedSchedule(sm2, 2, num_microbatches=3)
    with pytest.raises(ValueError, match="num_model_chunks=2"):
        InterleavedSchedule(sm, 2, num_microbatches=2)
    with pytest.raises(ValueError, match="use_zbv=True"):
        ZeroBubbleVPipeScheduler(sm2, num_microbatches=2)
    with pytest.raises(TypeError, match="PipelineStageManager"):
        GPipeSchedule(object(), num_microbatches=2)

    model = split_model(nn.ModuleList(Block(4) for _ in range(2)), sm)
    schedule = OneForwardOneBackwardSchedule(sm, num_microbatches=4)
    with pytest.raises(
        ValueError, match="batch of 6 samples does not split into num_microbatches=4"
    ):
        schedule.forward_backward_step(model[0], iter([torch.randn(6, 4)]), mse_to_flipped)
    with pytest.raises(ValueError, match="needs 1 model chunk"):
        schedule.forward_backward_step(model * 2, iter([torch.randn(4, 4)]), mse_to_flipped)
    with pytest.raises(TypeError, match="backward_by_grad"):
        schedule.forward_backward_step(
            model[0],
            iter([torch.randn(4, 4)]),
            mse_to_flipped,
            optimizer=torch.optim.SGD(model[0].parameters(), lr=1),
        )


def test_microbatch_helpers() -> None:
    with pytest.raises(ValueError, match="microbatch_size=3"):
        resolve_num_microbatches(8, None, 3)
    with pytest.raises(ValueError, match="does not match the batch size 8"):
        resolve_num_microbatches(8, 2, 2)
    assert resolve_num_microbatches(8, None, 2) == 4
    batch = {"x": torch.arange(8).reshape(4, 2), "y": torch.arange(4), "note": "kept"}
    parts = split_batch(batch, 2)
    assert parts[1]["note"] == "kept" and torch.equal(parts[1]["y"], torch.tensor([2, 3]))
    merged = merge_outputs([{"a": torch.ones(2, 1), "b": (torch.tensor(1.0),)}] * 3)
    assert merged["a"].shape == (6, 1) and merged["b"][0].shape == (3,)
    with pytest.raises(ValueError, match="disagree on the batch dimension"):
        split_batch({"x": torch.ones(4), "y": torch.ones(3)}, 2)
    with pytest.raises(TypeError, match="tensor or a dict"):
        split_batch([torch.ones(4)], 2)
