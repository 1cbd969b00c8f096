"""Shared model, data, plugin factory and single-process reference for the booster tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from colossal.booster import Booster

GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 6, 16, 3


class Net(nn.Module):
    """A small MLP with a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, OUT)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x))) + self.offset


def make_model(seed: int = 1234) -> Net:
    torch.manual_seed(seed)
    return Net()


class Blocks(nn.Module):
    """An embedding, an ``nn.ModuleList`` of ``depth`` residual blocks (FSDP units) and a head."""

    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, 12)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(depth)
        )
        self.head = nn.Linear(12, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make_blocks(seed: int = 1234, depth: int = 3) -> Blocks:
    torch.manual_seed(seed)
    return Blocks(depth)


def make_optimizer(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
    )


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def make_booster(plugin: str, precision: str = "fp32", **kwargs: Any) -> Booster:
    """``plugin`` in none|ddp|zero1|zero2|fsdp|gemini."""
    from colossal.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin

    if plugin == "none":
        return Booster(mixed_precision=None if precision == "fp32" else precision)
    if plugin == "ddp":
        return Booster(
            plugin=TorchDDPPlugin(**kwargs),
            mixed_precision=None if precision == "fp32" else precision,
        )
    if plugin in ("zero1", "zero2"):
        return Booster(
            plugin=LowLevelZeroPlugin(stage=int(plugin[-1]), precision=precision, **kwargs)
        )
    if plugin == "fsdp":
        from colossal.booster.plugin import TorchFSDPPlugin

        return Booster(plugin=TorchFSDPPlugin(precision=precision, **kwargs))
    if plugin == "gemini":
        from colossal.booster.plugin import GeminiPlugin

        return Booster(plugin=GeminiPlugin(precision=precision, **kwargs))
    raise ValueError(plugin)


def global_loss(loss: torch.Tensor) -> float:
    value = loss.detach().float().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def train_steps(
    model: Any, optimizer: Any, booster: Booster, steps: range, rank: int, world: int
) -> list[float]:
    losses = []
    for step in steps:
        x, y = local_batch(step, rank, world)
        loss = nn.functional.mse_loss(model(x).float(), y)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_loss(loss))
    return losses


def reference(
    steps: int, make: Callable[[], nn.Module] | None = None, lr: float = 1e-2
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 training of ``make()`` (default: ``make_model``) on the global batch."""
    model = (make or make_model)()
    optimizer = make_optimizer(model, lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(model: Any, booster: Booster) -> dict[str, torch.Tensor]:
    """Full fp32 tensors of a boosted model (collective for FSDP)."""
    io = booster.checkpoint_io
    state = io.model_state(model)
    return {k: io.to_full(v).detach().float().cpu() for k, v in state.items()}


def tiny_gpt2_config() -> Any:
    """A 2-layer, 32-wide GPT-2 config (needs transformers)."""
    import transformers

    return transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
