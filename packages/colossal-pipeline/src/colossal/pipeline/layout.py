"""Where model slices live: layer counts per slice and the slice each (stage, chunk) holds.

A model of ``L`` layers is cut into ``V = S * C`` consecutive *slices* (virtual stages) for
``S`` pipeline stages with ``C`` model chunks each. Two placements are supported:

* ``"loop"`` (1F1B, GPipe, interleaved): chunk ``c`` of stage ``s`` holds slice ``s + c * S``.
* ``"v"`` (zero-bubble V, ``C == 2``): stage ``s`` holds slices ``s`` and ``2 * S - s - 1``, so
  the first and the last slice both sit on stage 0.

These are pure functions, usable without any process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LAYOUTS = ("loop", "v")


def distribute_layers(num_layers: int, num_stages: int, num_model_chunks: int = 1) -> list[int]:
    """Number of layers in each slice, the remainder going to the middle slices.

    Args:
        num_layers: Layers of the whole model.
        num_stages: Pipeline stages.
        num_model_chunks: Model chunks per stage.

    Returns:
        ``num_stages * num_model_chunks`` counts in slice order (they sum to ``num_layers``).

    Raises:
        ValueError: Non-positive sizes, or fewer layers than slices.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("num_stages", num_stages),
        ("num_model_chunks", num_model_chunks),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    slices = num_stages * num_model_chunks
    if num_layers < slices:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages x {num_model_chunks} "
            f"chunks = {slices} slices; use fewer stages or chunks, or a deeper model"
        )
    quotient, remainder = divmod(num_layers, slices)
    counts = [quotient] * slices
    start = slices // 2 - remainder // 2
    for i in range(start, start + remainder):
        counts[i] += 1
    return counts


@dataclass(frozen=True)
class StageLayout:
    """The placement of ``num_stages * num_chunks`` model slices on pipeline stages.

    Attributes:
        num_stages: Pipeline stages ``S``.
        num_chunks: Model chunks per stage ``C``.
        kind: ``"loop"`` or ``"v"`` (see the module docstring); ``"v"`` needs ``C == 2``.
    """

    num_stages: int
    num_chunks: int = 1
    kind: str = "loop"

    def __post_init__(self) -> None:
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"num_stages must be a positive int, got {self.num_stages!r}")
        if not isinstance(self.num_chunks, int) or self.num_chunks < 1:
            raise ValueError(f"num_chunks must be a positive int, got {self.num_chunks!r}")
        if self.kind not in LAYOUTS:
            raise ValueError(f"layout kind must be one of {LAYOUTS}, got {self.kind!r}")
        if self.kind == "v" and self.num_chunks != 2:
            raise ValueError(
                f"the V layout holds exactly 2 chunks per stage, got {self.num_chunks}"
            )

    @property
    def num_slices(self) -> int:
        """Total number of model slices ``S * C``."""
        return self.num_stages * self.num_chunks

    def slice_of(self, stage: int, chunk: int) -> int:
        """The model slice held by ``chunk`` of ``stage``."""
        if not 0 <= stage < self.num_stages or not 0 <= chunk < self.num_chunks:
            raise ValueError(
                f"(stage, chunk) = ({stage}, {chunk}) is outside {self.num_stages} stages x "
                f"{self.num_chunks} chunks"
            )
        if self.kind == "v" and chunk == 1:
            return 2 * self.num_stages - stage - 1
        return stage + chunk * self.num_stages

    def locate(self, slice_index: int) -> tuple[int, int]:
        """The ``(stage, chunk)`` holding model slice ``slice_index``."""
        s = self.num_stages
        if not 0 <= slice_index < self.num_slices:
            raise ValueError(f"slice {slice_index} is outside [0, {self.num_slices})")
        if self.kind == "v" and slice_index >= s:
            return 2 * s - slice_index - 1, 1
        return slice_index % s, slice_index // s

    def is_first(self, stage: int, chunk: int) -> bool:
        """Whether ``(stage, chunk)`` holds the model's first slice (it reads the batch)."""
        return self.slice_of(stage, chunk) == 0

    def is_last(self, stage: int, chunk: int) -> bool:
        """Whether ``(stage, chunk)`` holds the model's last slice (it computes the loss)."""
        return self.slice_of(stage, chunk) == self.num_slices - 1

    def loss_stage(self) -> int:
        """The stage that computes the loss."""
        return self.locate(self.num_slices - 1)[0]


def stage_index(
    layers_per_slice: Sequence[int], stage: int, layout: StageLayout
) -> list[tuple[int, int]]:
    """Layer ranges ``[start, end)`` of each chunk of ``stage``, in chunk order.

    Args:
        layers_per_slice: Layer count of every slice, in slice order (see
            :func:`distribute_layers`).
        stage: The pipeline stage.
        layout: The slice placement.

    Raises:
        ValueError: ``layers_per_slice`` does not have one entry per slice.
    """
    counts = list(layers_per_slice)
    if len(counts) != layout.num_slices or any(c < 0 for c in counts):
        raise ValueError(
            f"layers_per_slice needs {layout.num_slices} non-negative counts (stages x chunks), "
            f"got {counts}"
        )
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    ranges = []
    for chunk in range(layout.num_chunks):
        v = layout.slice_of(stage, chunk)
        ranges.append((starts[v], starts[v + 1]))
    return ranges
