"""``seed_all``: seed Python, NumPy and torch (every device) at once."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_all"]


def seed_all(seed: int, cuda_deterministic: bool = False) -> None:
    """Seed ``random``, NumPy and torch on the host and every CUDA device (ColossalAI's).

    Args:
        seed: The seed.
        cuda_deterministic: Also make cuDNN deterministic (``deterministic=True``,
            ``benchmark=False``): slower, reproducible. False leaves cuDNN's flags as they are.

    Raises:
        TypeError: ``seed`` is not an int.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed_all: seed must be an int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if cuda_deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
