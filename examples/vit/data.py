"""scikit-learn's bundled digits (1,797 8x8 grayscale images, 10 classes) as torch datasets.

The images ship with scikit-learn, so nothing is downloaded. Pixel values (0..16) are scaled
to [-1, 1], the ``ViTImageProcessor`` convention (mean 0.5, std 0.5 after dividing by the
maximum). The held-out split is fixed: stratified, 20% of the images, seeded by
``SPLIT_SEED`` whatever the training seed, so every run is measured on the same 360 images.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

__all__ = ["IMAGE_SIZE", "NUM_CLASSES", "SPLIT_SEED", "DigitsDataset", "load_digits_split"]

IMAGE_SIZE = 8
"""Height and width of a digit image, in pixels."""
NUM_CLASSES = 10
SPLIT_SEED = 0
"""Seed of the train / held-out split (fixed, independent of the training ``--seed``)."""


class DigitsDataset(Dataset):
    """Images and labels as ``{"pixel_values": (1, 8, 8) float, "labels": long}`` samples.

    The default collate function stacks the samples into the keyword batch that
    ``ViTForImageClassification`` takes (and that a pipeline stage splits into microbatches).

    Args:
        images: ``(N, 1, 8, 8)`` float tensor, already normalized.
        labels: ``(N,)`` long tensor of classes.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[index], "labels": self.labels[index]}


def load_digits_split(test_fraction: float = 0.2) -> tuple[DigitsDataset, DigitsDataset]:
    """The training and held-out datasets (stratified split seeded by ``SPLIT_SEED``).

    Args:
        test_fraction: Share of the images held out.

    Returns:
        ``(train, held_out)``.

    Raises:
        ValueError: ``test_fraction`` is not in (0, 1).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = (images - 0.5) / 0.5
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(),
        test_size=test_fraction,
        stratify=digits.target,
        random_state=SPLIT_SEED,
    )
    train_idx, test_idx = torch.from_numpy(train_idx), torch.from_numpy(test_idx)
    return (
        DigitsDataset(images[train_idx], labels[train_idx]),
        DigitsDataset(images[test_idx], labels[test_idx]),
    )
