"""Shared model, data and single-process reference for the ZeRO tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 8
IN, HIDDEN, OUT = 6, 10, 3


class Net(nn.Module):
    """A small MLP with an optional frozen layer and an optional side branch."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.body = nn.Sequential(nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, OUT)
        self.branch = nn.Linear(HIDDEN, OUT)
        if frozen:
            self.body[1].requires_grad_(False)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.body(self.embed(x))
        out = self.head(h)
        return out + self.branch(h) if use_branch else out


def make_model(dtype: torch.dtype = torch.float32, frozen: bool = False) -> Net:
    """The same initial weights in every process."""
    torch.manual_seed(1234)
    return Net(frozen).to(dtype)


def make_optimizer(
    model: nn.Module, lr: float = 1e-2, kind: str = "adamw"
) -> torch.optim.Optimizer:
    """Two groups of different hyper-parameters (no decay on biases).

    ``kind``:

    - ``"adamw"``: AdamW, nearly blind to the gradients' scale.
    - ``"sgd"``: SGD with momentum, sensitive to the gradients' scale.
    - ``"sgd_plain"``: SGD without momentum: each step moves by exactly ``lr * grad``, so a
      wrongly scaled gradient (e.g. an fp16 loss scale left in) shows in every step.
    - ``"adamw_eps"``: AdamW with ``eps=1e-3``, of the order of the clipped gradients, so
      that their scale (not only their direction) changes the update.
    """
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr * 10, momentum=0.9)
    if kind == "sgd_plain":
        return torch.optim.SGD(groups, lr=lr * 10)
    if kind == "adamw_eps":
        return torch.optim.AdamW(groups, lr=lr, eps=1e-3)
    if kind != "adamw":
        raise ValueError(f"kind={kind!r}: use 'adamw', 'sgd', 'sgd_plain' or 'adamw_eps'")
    return torch.optim.AdamW(groups, lr=lr)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def local(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a global batch."""
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw: bool) -> torch.Tensor:
    """Mean squared error in fp32."""
    return (model(x.to(next(model.parameters()).dtype), **kw).float() - y).pow(2).mean()


def reference(
    steps: int,
    clip: float = 0.0,
    kind: str = "adamw",
    norms: list[float] | None = None,
    lr: float = 1e-2,
) -> tuple[list[float], nn.Module]:
    """Single process, fp32, the whole global batch: losses and the final model.

    The gradient norm of each step is appended to ``norms`` when given.
    """
    model = make_model()
    opt = make_optimizer(model, lr=lr, kind=kind)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
        if norms is not None:
            norms.append(float(norm))
        opt.step()
        losses.append(loss.item())
    return losses, model


def global_loss(local_loss: torch.Tensor) -> float:
    """Mean of every rank's local loss (equal local batches)."""
    t = local_loss.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()
