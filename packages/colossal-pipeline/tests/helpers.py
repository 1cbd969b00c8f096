"""Small models and the single-process reference the distributed tests compare against."""

from __future__ import annotations

import copy

import torch
from torch import nn

from colossal.core import ProcessGroupMesh
from colossal.core.testing import assert_rel_close
from colossal.pipeline import PipelineStageManager

RTOL = 1e-6


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    """Layers in sequence; the first one takes whatever the chunk is called with."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, *args, **kwargs):
        out = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            out = layer(out)
        return out


def mse_to_flipped(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return ((out - batch.flip(-1)) ** 2).mean()


def make_stage_manager(world_size: int, chunks: int = 1, zbv: bool = False) -> PipelineStageManager:
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    return PipelineStageManager(
        mesh, "pp", enable_interleave=chunks > 1, num_model_chunks=chunks, use_zbv=zbv
    )


def split_model(layers: nn.ModuleList, sm: PipelineStageManager) -> list[nn.Module]:
    counts = sm.distribute_layers(len(layers))
    ranges = sm.get_stage_index(counts)
    ranges = [ranges] if isinstance(ranges, tuple) else ranges
    return [Stack(list(layers[a:b])) for a, b in ranges]


def reference(
    layers: nn.ModuleList, batch: torch.Tensor, criterion
) -> tuple[torch.Tensor, nn.ModuleList]:
    ref = copy.deepcopy(layers)
    out = batch
    for layer in ref:
        out = layer(out)
    loss = criterion(out, batch)
    loss.backward()
    return loss.detach(), ref


def compare_grads(
    layers: nn.ModuleList, ref: nn.ModuleList, chunks: list[nn.Module], what: str
) -> int:
    mine = {id(p) for c in chunks for p in c.parameters()}
    checked = 0
    for (name, p), (_, q) in zip(layers.named_parameters(), ref.named_parameters(), strict=True):
        if id(p) in mine:
            assert p.grad is not None, f"{what}: {name} got no gradient"
            assert_rel_close(p.grad, q.grad, RTOL, f"{what}: grad of {name}")
            checked += 1
    return checked
