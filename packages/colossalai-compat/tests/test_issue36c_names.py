"""ColossalAI's checkpoint, ZB-V, grad-accum and d_tensor names, used as ColossalAI's tests do."""

from __future__ import annotations

import tempfile

import torch
from colossalai.checkpoint_io import GeneralCheckpointIO
from colossalai.pipeline.schedule.v_schedule import PipelineGraph
from colossalai.pipeline.weight_grad_store import WeightGradStore
from colossalai.shardformer.layer import LinearWithGradAccum
from colossalai.tensor.d_tensor import get_global_shape, is_distributed_tensor
from torch import nn

import colossal.checkpoint_io
import colossal.pipeline
from colossal.shardformer import d_tensor


def test_names_are_ours() -> None:
    """Catches: a name served from another module than ours (a copy, or a stale path)."""
    assert GeneralCheckpointIO is colossal.checkpoint_io.GeneralCheckpointIO
    assert PipelineGraph is colossal.pipeline.PipelineGraph
    assert WeightGradStore is colossal.pipeline.WeightGradStore
    assert LinearWithGradAccum is colossal.pipeline.LinearWithGradAccum
    assert is_distributed_tensor is d_tensor.is_distributed_tensor


def test_general_checkpoint_io_as_colossalai_tests_use_it() -> None:
    """ColossalAI's test_general_checkpoint_io: save to NamedTemporaryFile names, load back.

    Catches: an unsharded save that refuses an existing file path, a load that leaves the
    model or the optimizer unchanged.
    """
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    io = GeneralCheckpointIO()
    with tempfile.NamedTemporaryFile() as model_file, tempfile.NamedTemporaryFile() as opt_file:
        io.save_model(model, model_file.name, use_safetensors=True)
        io.save_optimizer(optimizer, opt_file.name)
        fresh = nn.Linear(4, 3)
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
        io.load_model(fresh, model_file.name)
        io.load_optimizer(fresh_optimizer, opt_file.name)
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)
    moments = [s["exp_avg"] for s in fresh_optimizer.state_dict()["state"].values()]
    want = [s["exp_avg"] for s in optimizer.state_dict()["state"].values()]
    for got, expected in zip(moments, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_zbv_graph_as_colossalai_builds_it() -> None:
    """ColossalAI's test_zerobubble_pp builds the graph from a memory model, all positional.

    Catches: the positional order of ColossalAI's arguments changed, a stage list that is
    not 2 x 3 x n_micro compute nodes long.
    """
    h, a, s = 4096, 32, 1024
    mem_f = 34 * h + 5 * a * s
    mem_w = -32 * h
    mem_b = -mem_w - mem_f
    graph = PipelineGraph(4, 8, 1, 1, 1, 1, mem_f, mem_b, mem_w, max_mem=None)
    nodes = graph.get_v_schedule()
    assert isinstance(nodes, list)
    for row in nodes:
        assert sum(n.type in ("F", "B", "W") for n in row) == 2 * 3 * 8
    assert get_global_shape(torch.ones(2, 3)) == torch.Size([2, 3])
