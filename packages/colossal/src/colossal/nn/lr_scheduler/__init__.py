"""Learning-rate schedulers under ColossalAI's names, arguments and defaults.

``from colossalai.nn.lr_scheduler import CosineAnnealingWarmupLR`` becomes
``from colossal.nn.lr_scheduler import CosineAnnealingWarmupLR``. Every scheduler is a
``torch.optim.lr_scheduler.LRScheduler``: call ``step()`` once per training step, pass it to
``booster.boost(..., lr_scheduler=...)`` and save it with ``booster.save_lr_scheduler``.

Each class documents its formula. All but ``LambdaLR``, ``MultiplicativeLR`` and
``OneCycleLR`` (torch's, with ColossalAI's signatures) compute the rate in closed form from the
step, so a resumed schedule continues exactly where it stopped, and they hold their final rate
once ``total_steps`` is reached. Bad arguments (``warmup_steps > total_steps``, negative counts
or rates) raise ``ValueError`` naming them.
"""

from __future__ import annotations

from colossal.nn.lr_scheduler.cosine import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
)
from colossal.nn.lr_scheduler.linear import LinearWarmupLR
from colossal.nn.lr_scheduler.multistep import ExponentialLR, MultiStepLR, MultiStepWarmupLR, StepLR
from colossal.nn.lr_scheduler.poly import PolynomialLR, PolynomialWarmupLR
from colossal.nn.lr_scheduler.wrapped import LambdaLR, MultiplicativeLR, OneCycleLR

__all__ = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LambdaLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "MultiplicativeLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
    "StepLR",
]
