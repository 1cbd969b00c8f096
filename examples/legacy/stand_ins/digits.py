"""scikit-learn's bundled digits as image datasets, in place of the tutorials' downloads.

1,797 grayscale 8x8 images of the digits 0-9 ship with scikit-learn, so nothing is
downloaded. The file ``sklearn.datasets.load_digits`` reads is read directly when it is where
scikit-learn ships it (importing ``sklearn.datasets`` costs over a second per process, more
than importing colossalai); ``load_digits()`` otherwise. Pixel values (0..16) are scaled to
[-1, 1]; images can be upscaled (bilinear) and repeated over 3 channels where a model expects
CIFAR-like input. The held-out split is fixed (20%, seeded), so every run and every rank sees
the same two sets.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own convention
from torch.utils.data import TensorDataset

__all__ = ["NUM_CLASSES", "digits_datasets"]

NUM_CLASSES = 10
_SPLIT_SEED = 0


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The images ``(1797, 8, 8)`` and labels, as ``sklearn.datasets.load_digits`` gives."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")  # load_digits' own parse of the file
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


def digits_datasets(
    image_size: int = 8, channels: int = 1, test_fraction: float = 0.2
) -> tuple[TensorDataset, TensorDataset]:
    """The digits as ``(image, label)`` training and held-out datasets.

    Args:
        image_size: Height and width of the images (8 is the original; larger sizes are
            bilinear upscales).
        channels: 1 (grayscale) or 3 (the gray value repeated, for RGB models).
        test_fraction: Share of the images held out.

    Returns:
        ``(train, test)``: images ``(channels, image_size, image_size)`` float32, labels long.

    Raises:
        ValueError: ``channels`` is not 1 or 3, ``image_size`` < 8, or ``test_fraction`` is
            not in (0, 1).
    """
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    if image_size < 8:
        raise ValueError(f"image_size must be >= 8 (the digits are 8x8), got {image_size}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    raw_images, raw_labels = _load_digits()
    images = torch.tensor(raw_images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.5) / 0.5
    if image_size != 8:
        images = F.interpolate(
            images, size=(image_size, image_size), mode="bilinear", align_corners=False
        )
    images = images.expand(-1, channels, -1, -1).contiguous()
    labels = torch.tensor(raw_labels, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    held_out = int(round(len(labels) * test_fraction))
    test_idx, train_idx = order[:held_out], order[held_out:]
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[test_idx], labels[test_idx]),
    )
