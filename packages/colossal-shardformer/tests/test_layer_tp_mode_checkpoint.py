"""A checkpoint saved in one tensor-parallel mode loads in every other and in the plain model.

The same small model (Linear, LayerNorm, Linear, classifier) is built plain and from each
mode's layers (``from_native_module`` of a plain model with its own seed, so every source holds
different values). Each is saved the way a user of these layers saves one: whole tensors under
the plain model's names from ``enable_full_state_dict``'s ``state_dict()``, written by one rank
with ``colossal.core.io.save_safetensors`` (the Booster's checkpoint IO, in the meta-package
this package's tests may not import, gathers the same marked parts into the same files).
Every file is loaded (``load_safetensors`` + ``load_state_dict``) into every mode and into the
plain model, and then

* the file holds exactly the source plain model's tensors (a part gathered from the wrong
  ranks or axis differs);
* every loaded model's whole state dict equals the source's exactly (a part read into the
  wrong place, or left unloaded, differs);
* every loaded model's gathered output equals the source plain model's (a parameter whose
  marks disagree with what its layer computes would load "exactly" and still compute wrong).

World 8 (one function, as world 8 is slow on two cores): 2.5D (depth 2, q 2), 3D (q 2) and
data parallel 2 x 2D (q 2). World 4: 1D (Megatron column/row) and 2D.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - the usual alias
from torch import nn

from colossal.core import ParallelDims
from colossal.core.io import load_safetensors, save_safetensors
from colossal.core.testing import assert_rel_close, distributed_test
from colossal.shardformer.layer import (
    Classifier2D,
    Classifier2p5D,
    Classifier3D,
    LayerNorm2D,
    LayerNorm2p5D,
    LayerNorm3D,
    Linear1D_Col,
    Linear1D_Row,
    Linear2D,
    Linear2p5D,
    Linear3D,
    enable_full_state_dict,
    gather_batch_2d,
    gather_batch_2p5d,
    gather_batch_3d,
    split_input_2d,
    split_input_2p5d,
    split_input_3d,
)

RTOL = 2e-5
DIM, HIDDEN, CLASSES = 8, 16, 8


class Plain(nn.Module):
    """Linear, LayerNorm, GELU, Linear, classifier."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, CLASSES)
        with torch.no_grad():  # not the default ones and zeros: a lost norm load shows
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.gelu(self.norm(self.fc1(x)))))


def _build(mode: str, plain: Plain, dims: ParallelDims) -> nn.Module:
    """``plain`` in ``mode``'s layers (same names and forward), with whole-tensor state dicts."""
    model = copy.deepcopy(plain)
    if mode == "1d":
        group = dims.group("tp")
        model.fc1 = Linear1D_Col.from_native_module(plain.fc1, group, gather_output=True)
        model.fc2 = Linear1D_Row.from_native_module(plain.fc2, group, parallel_input=False)
        model.head = Linear1D_Col.from_native_module(plain.head, group, gather_output=True)
    elif mode == "3d":
        model.fc1 = Linear3D.from_native_module(plain.fc1, dims)
        swapped = model.fc1.output_swapped
        model.norm = LayerNorm3D.from_native_module(plain.norm, dims, swapped=swapped)
        model.fc2 = Linear3D.from_native_module(plain.fc2, dims, swapped=swapped)
        model.head = Classifier3D.from_native_module(plain.head, dims)
    else:
        linear, norm, head = {
            "2d": (Linear2D, LayerNorm2D, Classifier2D),
            "2.5d": (Linear2p5D, LayerNorm2p5D, Classifier2p5D),
        }[mode]
        model.fc1 = linear.from_native_module(plain.fc1, dims)
        model.norm = norm.from_native_module(plain.norm, dims)
        model.fc2 = linear.from_native_module(plain.fc2, dims)
        model.head = head.from_native_module(plain.head, dims)
    return enable_full_state_dict(model)


def _whole_output(mode: str, model: nn.Module, dims: ParallelDims, x: torch.Tensor) -> torch.Tensor:
    """The whole logits of ``model`` for the whole batch ``x`` (collective)."""
    if mode == "1d":
        return model(x)
    split, gather = {
        "2d": (split_input_2d, gather_batch_2d),
        "2.5d": (split_input_2p5d, gather_batch_2p5d),
        "3d": (split_input_3d, gather_batch_3d),
    }[mode]
    return gather(model(split(x, dims)), dims)


def _round_trips(modes: dict[str, ParallelDims], directory: Path) -> None:
    """Save the plain model and every mode's copy; load each file into all; compare."""
    x = torch.randn(8, 3, DIM, generator=torch.Generator().manual_seed(7))
    sources = {"plain": Plain(seed=0)}
    sources.update({mode: Plain(seed=i + 1) for i, mode in enumerate(modes)})
    models: dict[str, nn.Module] = {"plain": Plain(seed=100)}
    # a copy: a 1D row-parallel layer keeps its native module's (replicated) bias parameter
    models.update(
        {mode: _build(mode, copy.deepcopy(sources[mode]), dims) for mode, dims in modes.items()}
    )
    expected = {
        name: {k: v.clone() for k, v in plain.state_dict().items()}
        for name, plain in sources.items()
    }
    files = {}
    for name in sources:  # every rank gathers, the first one writes
        state = (sources[name] if name == "plain" else models[name]).state_dict()
        assert state.keys() == expected[name].keys(), name
        path = directory / f"{name.replace('.', 'p')}.safetensors"
        if dist.get_rank() == 0:
            save_safetensors({k: v.contiguous() for k, v in state.items()}, path)
        files[name] = path
    dist.barrier()
    for name, path in files.items():
        saved = load_safetensors(path)
        assert saved.keys() == expected[name].keys(), name
        for key, value in expected[name].items():
            assert torch.equal(saved[key], value), f"{name} saved {key}"
        with torch.no_grad():
            reference = sources[name](x)
        for target, model in models.items():
            model.load_state_dict(saved)
            loaded = model.state_dict()  # whole tensors (gathered for the modes)
            for key, value in expected[name].items():
                assert torch.equal(loaded[key], value), f"{name} -> {target}: {key}"
            with torch.no_grad():
                if target == "plain":
                    out = model(x)
                else:
                    out = _whole_output(target, model, modes[target], x)
            assert_rel_close(out, reference, RTOL, f"{name} -> {target}: output")


@distributed_test(8, timeout=600.0)
def test_checkpoints_move_between_2p5d_3d_2d_and_plain(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    """2.5D (d=2, q=2), 3D (q=2) and dp 2 x 2D (q=2) at world 8, and the plain model."""
    modes = {
        "2.5d": ParallelDims(tp=8, tp_mode="2.5d", tp_depth=2),
        "3d": ParallelDims(tp=8, tp_mode="3d"),
        "2d": ParallelDims(dp=2, tp=4, tp_mode="2d"),
    }
    _round_trips(modes, tmp_path)


@distributed_test(4, timeout=300.0)
def test_checkpoints_move_between_1d_2d_and_plain(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    """1D (column/row parallel over 4 ranks) and 2D (q=2) at world 4, and the plain model."""
    modes = {"1d": ParallelDims(tp=4), "2d": ParallelDims(tp=4, tp_mode="2d")}
    _round_trips(modes, tmp_path)
