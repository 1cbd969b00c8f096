# ruff: noqa: E501 - SNIPPET is the seed's text, long lines included
"""The seeds' Booster API example (booster_api.md) run as written through ``import colossalai``.

Two edits for a CPU machine without torchvision, and nothing else: ``resnet18`` is a tiny
stand-in with the same call, and ``x = x.to('cuda')`` is dropped. The script runs on 2 ranks
(gloo: the accelerator's backend on CPU, as ``launch`` picks it when none is given); the
test then checks the checkpoint the example saved against the same step in one process.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from rank_procs import run_ranks
from safetensors.torch import load_file
from seed_snippets import code_blocks, seeds_dir

# The seed's block, as booster_api.md has it, but for the two edits marked EDIT.
SNIPPET = """\
import torch
from torch.optim import SGD
from tiny_models import resnet18  # EDIT: was `from torchvision.models import resnet18`

import colossalai
from colossalai.booster import Booster
from colossalai.booster.plugin import TorchDDPPlugin

def train():
    # launch colossalai
    colossalai.launch(rank=rank, world_size=world_size, port=port, host='localhost')

    # create plugin and objects for training
    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    model = resnet18()
    criterion = lambda x: x.mean()
    optimizer = SGD((model.parameters()), lr=0.001)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)

    # use booster.boost to wrap the training objects
    model, optimizer, criterion, _, scheduler = booster.boost(model, optimizer, criterion, lr_scheduler=scheduler)

    # do training as normal, except that the backward should be called by booster
    x = torch.randn(4, 3, 224, 224)
    # EDIT: dropped `x = x.to('cuda')`
    output = model(x)
    loss = criterion(output)
    booster.backward(loss, optimizer)
    optimizer.clip_grad_by_norm(1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()

    # checkpointing using booster api
    save_path = "./model"
    booster.save_model(model, save_path, shard=True, size_per_shard=10, use_safetensors=True)

    new_model = resnet18()
    booster.load_model(new_model, save_path)
"""

EDITS = {
    "from tiny_models import resnet18  # EDIT: was `from torchvision.models import resnet18`": (
        "from torchvision.models import resnet18"
    ),
    "    # EDIT: dropped `x = x.to('cuda')`": "    x = x.to('cuda')",
}

# Run by each rank: the job's coordinates from the environment, then the example's train().
FOOTER = """

if __name__ == "__main__":
    import os

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    port = int(os.environ["MASTER_PORT"])
    train()
    # today's launch (no config) fills gpc too
    from colossalai.context import ParallelMode
    from colossalai.core import global_context as gpc
    assert gpc.get_world_size(ParallelMode.DATA) == world_size
    print("rank", rank, "done")
"""

TINY_MODELS = """
import torch
from torch import nn


def resnet18(num_classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, kernel_size=7, stride=4),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, num_classes),
    )
"""

SEED_LAUNCH_SEED = 1024  # colossalai.launch's default seed, the same on every rank


def _reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The example's one step in one process: same seed, same sample (DDP averages equal grads)."""
    namespace: dict[str, object] = {}
    exec(compile(TINY_MODELS, str(tmp_path / "tiny_models.py"), "exec"), namespace)
    torch.manual_seed(SEED_LAUNCH_SEED)
    model = namespace["resnet18"]()  # type: ignore[operator]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(4, 3, 224, 224)
    model(x).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_snippet_matches_the_seed_but_for_the_edits() -> None:
    directory = seeds_dir()
    if directory is None:
        pytest.skip("../shared/seeds is not there: the embedded copy cannot be compared")
    [seed] = [b.code for b in code_blocks(directory / "booster_api.md") if "Booster" in b.code]
    original = SNIPPET
    for edited, written in EDITS.items():
        assert original.count(edited) == 1, edited
        original = original.replace(edited, written)
    assert original.strip() == seed.strip()


def test_booster_example_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "tiny_models.py").write_text(textwrap.dedent(TINY_MODELS))
    script = tmp_path / "booster_api.py"
    script.write_text(SNIPPET + textwrap.dedent(FOOTER))
    results = run_ranks(script, 2)
    assert all(f"rank {r.rank} done" in r.output for r in results)

    saved: dict[str, torch.Tensor] = {}
    for shard in sorted((tmp_path / "model").glob("*.safetensors")):
        saved.update(load_file(shard))
    expected = _reference(tmp_path)
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(
            saved[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert not re.search(r"Traceback", "".join(r.output for r in results))
