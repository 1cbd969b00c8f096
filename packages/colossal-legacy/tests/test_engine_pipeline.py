"""Pipeline through the config: the Engine's pipeline schedules equal the unpipelined model.

World 2, ``parallel=dict(pipeline=2)``: each rank trains its slice (from
``build_pipeline_model``) with SGD; every parameter and the last stage's loss are compared
with one process training the whole model on the same batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from colossal.core.testing import distributed_test
from colossal.legacy import init_context, initialize
from colossal.legacy.amp import AMP_TYPE, NaiveAMPModel
from colossal.legacy.builder import build_pipeline_model
from colossal.legacy.core import gpc
from colossal.legacy.engine import InterleavedPipelineSchedule, PipelineSchedule

LR = 0.5
STEPS = 3
BATCH = 8
CLIP = 0.05


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Linear(8, 3),
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 6, generator=g), torch.randint(
        0, 3, (STEPS, BATCH), generator=g
    )


def _reference(clip: float, accumulation: int, rounded: bool) -> tuple[dict, list[float]]:
    model = _layers()
    if rounded:
        model = model.half().float()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, y in zip(*_data(), strict=True):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > 4 * clip
        opt.step()
        losses.append(loss.item())
    return dict(model.named_parameters()), losses


def _run(config: dict) -> None:
    init_context(dict(parallel=dict(pipeline=2), **config), verbose=False)
    chunks = config.get("model", {}).get("num_chunks", 1)
    accumulation = config.get("gradient_accumulation", 1)
    naive = "fp16" in config
    layers = _layers()
    names = {id(p): n for n, p in layers.named_parameters()}
    stage = build_pipeline_model(layers, num_chunks=chunks)
    optimizer = torch.optim.SGD(stage.parameters(), lr=LR)
    engine, *_ = initialize(stage, optimizer, nn.CrossEntropyLoss(), verbose=False)
    assert engine.uses_pipeline
    kind = InterleavedPipelineSchedule if chunks > 1 else PipelineSchedule
    assert type(engine.schedule) is kind
    if naive:
        models = engine.model if isinstance(engine.model, nn.ModuleList) else [engine.model]
        assert all(isinstance(m, NaiveAMPModel) for m in models)
    last = gpc.is_pipeline_last_stage(ignore_virtual=True)
    losses = []
    for x, y in zip(*_data(), strict=True):
        size = BATCH // accumulation
        total = 0.0
        for k in range(accumulation):
            part = slice(k * size, (k + 1) * size)
            engine.zero_grad()
            output, label, loss = engine.execute_schedule(iter([(x[part], y[part])]))
            engine.step()
            if last:
                assert loss is not None and output.shape == (size, 3)
                assert torch.equal(label, y[part])
                total += loss.item() / accumulation
            else:
                assert (output, label, loss) == (None, None, None)
        losses.append(total)
    want, want_losses = _reference(config.get("clip_grad_norm", 0.0), accumulation, naive)
    params = engine.optimizer.master_params if naive else list(stage.parameters())
    fp16_params = list(stage.parameters())
    tol = 2e-3 if naive else 1e-6
    for param, original in zip(params, fp16_params, strict=True):
        name = names[id(original)]
        err = (param.detach().float() - want[name].detach()).abs().max().item()
        assert err < tol, f"{config}: {name} differs by {err}"
    if last:
        assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) < tol * 10
    dist.barrier()
    gpc.destroy()


@distributed_test(2)
def test_pipeline_schedules_equal_the_whole_model(rank: int, world_size: int) -> None:
    """Catches microbatch losses not averaged, a stage's gradient missing from the one
    global norm (clipping would differ), interleaved chunks run in the wrong order, an
    accumulation that scales pipeline gradients twice, and naive AMP under a pipeline
    (fp16 activations sent between stages, loss scale carried by the sent gradients)."""
    torch.set_num_threads(1)
    _run(dict(NUM_MICRO_BATCHES=2, clip_grad_norm=CLIP))
    _run(dict(NUM_MICRO_BATCHES=2, model=dict(num_chunks=2), gradient_accumulation=2))
    _run(dict(NUM_MICRO_BATCHES=4, fp16=dict(mode=AMP_TYPE.NAIVE, initial_scale=2**8)))


class _Masked(nn.Module):
    """The seeds' GPT convention: ``forward(hidden_states=None, x=None, mask=None)``; the
    first stage embeds ``x``, every stage multiplies by the batch's mask."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first = first
        self.embed = nn.Linear(4, 4) if first else None
        self.body = nn.Linear(4, 4)

    def forward(self, hidden_states=None, x=None, mask=None):  # noqa: ANN001, ANN201
        if self.embed is not None:
            hidden_states = self.embed(x)
        return self.body(hidden_states) * mask


@distributed_test(2)
def test_dict_batches_reach_every_stage(rank: int, world_size: int) -> None:
    """Catches later stages called without the batch's keys (a padded batch would lose its
    attention mask after the first stage): the loss must equal the whole model's."""
    torch.set_num_threads(1)
    init_context(dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2), verbose=False)
    torch.manual_seed(0)
    whole = [_Masked(True), _Masked(False)]
    x, mask, y = torch.randn(4, 4), (torch.rand(4, 4) > 0.3).float(), torch.randn(4, 4)
    expected = nn.functional.mse_loss(whole[1](whole[0](x=x, mask=mask), mask=mask), y).item()
    stage = whole[rank]
    engine, *_ = initialize(
        stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.MSELoss(), verbose=False
    )
    _, _, loss = engine.execute_schedule(iter([(dict(x=x, mask=mask), y)]))
    if rank == 1:
        assert loss is not None and abs(loss.item() - expected) < 1e-6
    gpc.destroy()
