"""Compute specs: how a ``ColoTensor`` parameter is used (the seeds' ``ComputePattern``)."""

from __future__ import annotations

from enum import Enum

__all__ = ["ComputePattern", "ComputeSpec"]


class ComputePattern(Enum):
    """The tensor-parallel pattern a parameter takes part in."""

    TP1D = 0
    TP2D = 1
    TP2P5D = 2
    TP3D = 3


class ComputeSpec:
    """A parameter's compute pattern, and whether its op's output is made whole.

    Args:
        compute_pattern: The :class:`ComputePattern`.

    Raises:
        TypeError: ``compute_pattern`` is not a ``ComputePattern``.
    """

    def __init__(self, compute_pattern: ComputePattern) -> None:
        if not isinstance(compute_pattern, ComputePattern):
            raise TypeError(
                f"ComputeSpec takes a ComputePattern (e.g. ComputePattern.TP1D), "
                f"got {compute_pattern!r}"
            )
        self.compute_pattern = compute_pattern
        self.output_replicate = True

    def set_output_replicate(self, flag: bool = True) -> None:
        """Whether the output of the op using this parameter is gathered (seeds' default)."""
        self.output_replicate = flag

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ComputeSpec):
            return NotImplemented
        return (self.compute_pattern, self.output_replicate) == (
            other.compute_pattern,
            other.output_replicate,
        )

    def __hash__(self) -> int:
        return hash((self.compute_pattern, self.output_replicate))

    def __repr__(self) -> str:
        return (
            f"ComputeSpec(pattern={self.compute_pattern}, replicate_output={self.output_replicate})"
        )
