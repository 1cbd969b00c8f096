"""ColossalAI's ``colossalai.nn.lr_scheduler``: the meta-package's schedulers, re-exported."""

from colossal.nn.lr_scheduler import (
    CosineAnnealingLR,
    CosineAnnealingWarmupLR,
    ExponentialLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
    LambdaLR,
    LinearWarmupLR,
    MultiplicativeLR,
    MultiStepLR,
    MultiStepWarmupLR,
    OneCycleLR,
    PolynomialLR,
    PolynomialWarmupLR,
    StepLR,
)

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
