"""Losses that save less for the backward than their ``torch.nn.functional`` peers."""

from colossal.kernels.loss.cross_entropy import cross_entropy

__all__ = ["cross_entropy"]
