"""The pipeline stage manager as Shardformer uses it (colossal-pipeline is never imported).

``colossal.pipeline.PipelineStageManager`` implements :class:`StageManagerLike`; Shardformer
reads the stage coordinates, the stage layout and the layer split from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["StageLayoutLike", "StageManagerLike"]


class StageLayoutLike(Protocol):
    """Which model slice each (stage, chunk) holds."""

    @property
    def num_slices(self) -> int:
        """Model slices in all (stages x chunks)."""
        ...

    def slice_of(self, stage: int, chunk: int) -> int:
        """The model slice held by ``chunk`` of ``stage``."""
        ...

    def locate(self, slice_index: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding ``slice_index``."""
        ...


class StageManagerLike(Protocol):
    """This rank's place in the pipeline."""

    @property
    def stage(self) -> int:
        """This rank's stage."""
        ...

    @property
    def num_stages(self) -> int:
        """Stages of the pipeline."""
        ...

    @property
    def num_model_chunks(self) -> int:
        """Model chunks per stage (more than one: interleaved)."""
        ...

    @property
    def layout(self) -> StageLayoutLike:
        """The stage layout."""
        ...

    def distribute_layers(self, num_layers: int) -> list[int]:
        """Layer count of every model slice."""
        ...

    def get_stage_index(
        self, layers_per_stage: Sequence[int]
    ) -> tuple[int, int] | list[tuple[int, int]]:
        """Layer range of this stage, or one range per chunk when interleaved."""
        ...
