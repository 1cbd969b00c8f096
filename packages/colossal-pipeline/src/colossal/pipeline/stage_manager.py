"""This rank's place in the pipeline: stage, neighbours, chunks and layer ranges."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch.distributed import ProcessGroup

from colossal.core import ProcessGroupMesh
from colossal.pipeline.layout import StageLayout, distribute_layers, stage_index


class PipelineStageManager:
    """Knows which pipeline stage this rank is and who its neighbours are.

    Args:
        pg_mesh: The process-group mesh.
        pipeline_axis: Name or index of the mesh axis along which the pipeline runs.
        enable_interleave: Whether each stage holds several model chunks.
        num_model_chunks: Model chunks per stage (``> 1`` needs ``enable_interleave``).
        use_zbv: Place the two chunks in a V (stage ``s`` holds slices ``s`` and ``2S-s-1``)
            for the zero-bubble V schedule; needs ``num_model_chunks == 2``.
        num_layers_per_stage: Optional explicit layer count of every model slice (length
            ``num_stages * num_model_chunks``) that :meth:`distribute_layers` then returns.

    Raises:
        ValueError: Inconsistent chunk settings or a bad ``num_layers_per_stage``.
    """

    def __init__(
        self,
        pg_mesh: ProcessGroupMesh,
        pipeline_axis: int | str,
        enable_interleave: bool = False,
        num_model_chunks: int = 1,
        use_zbv: bool = False,
        num_layers_per_stage: Sequence[int] | None = None,
    ) -> None:
        if not isinstance(num_model_chunks, int) or num_model_chunks < 1:
            raise ValueError(f"num_model_chunks must be a positive int, got {num_model_chunks!r}")
        if num_model_chunks > 1 and not (enable_interleave or use_zbv):
            raise ValueError(
                f"num_model_chunks={num_model_chunks} needs enable_interleave=True "
                "(or use_zbv=True)"
            )
        if use_zbv and num_model_chunks != 2:
            raise ValueError(f"use_zbv=True needs num_model_chunks=2, got {num_model_chunks}")
        self.pg_mesh = pg_mesh
        self.pipeline_axis = pipeline_axis
        self.is_interleave = bool(enable_interleave or use_zbv)
        self.use_zbv = bool(use_zbv)
        self.num_model_chunks = num_model_chunks
        self.num_stages = int(pg_mesh.size(pipeline_axis))
        self.stage = int(pg_mesh.coordinate(pipeline_axis))
        self.stage_ranks: list[int] = pg_mesh.ranks_along_axis(pipeline_axis)
        self.layout = StageLayout(self.num_stages, num_model_chunks, "v" if use_zbv else "loop")
        self.model_chunk_id: int | None = None
        self.num_layers_per_stage: list[int] | None = None
        if num_layers_per_stage is not None:
            counts = list(num_layers_per_stage)
            if len(counts) != self.layout.num_slices or any(
                not isinstance(c, int) or c < 0 for c in counts
            ):
                raise ValueError(
                    f"num_layers_per_stage needs {self.layout.num_slices} non-negative ints "
                    f"(stages x chunks), got {counts}"
                )
            self.num_layers_per_stage = counts
        self.pp_group: ProcessGroup = pg_mesh.get_group_along_axis(pipeline_axis)

    # ---- ranks -----------------------------------------------------------------------
    def get_rank(self, stage: int) -> int:
        """Global rank of ``stage`` in this rank's pipeline (wrapping around)."""
        return self.stage_ranks[stage % self.num_stages]

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous stage (stage ``S-1`` for stage 0)."""
        return self.get_rank(self.stage - 1)

    @property
    def next_rank(self) -> int:
        """Global rank of the next stage (stage 0 for stage ``S-1``)."""
        return self.get_rank(self.stage + 1)

    def get_prev_rank(self) -> int:
        """Global rank of the previous stage."""
        return self.prev_rank

    def get_next_rank(self) -> int:
        """Global rank of the next stage."""
        return self.next_rank

    # ---- stage predicates --------------------------------------------------------------
    def _chunk(self, model_chunk_id: int | None) -> int:
        chunk = self.model_chunk_id if model_chunk_id is None else model_chunk_id
        if chunk is None:
            raise ValueError(
                "no model chunk is current: pass model_chunk_id, ignore_chunk=True, or call "
                "inside switch_model_chunk_id(...)"
            )
        return chunk

    def is_first_stage(self, ignore_chunk: bool = False, model_chunk_id: int | None = None) -> bool:
        """Whether this rank holds the first model slice (or is stage 0 when ``ignore_chunk``)."""
        if not self.is_interleave or ignore_chunk:
            return self.stage == 0
        return self.layout.is_first(self.stage, self._chunk(model_chunk_id))

    def is_last_stage(self, ignore_chunk: bool = False, model_chunk_id: int | None = None) -> bool:
        """Whether this rank holds the last model slice (or is stage ``S-1`` when ``ignore_chunk``).

        In the V layout the last slice sits on stage 0, chunk 1.
        """
        if not self.is_interleave or ignore_chunk:
            return self.stage == self.num_stages - 1
        return self.layout.is_last(self.stage, self._chunk(model_chunk_id))

    @contextlib.contextmanager
    def switch_model_chunk_id(self, model_chunk_id: int) -> Iterator[None]:
        """Make ``model_chunk_id`` the current chunk inside the ``with`` block."""
        previous = self.model_chunk_id
        self.model_chunk_id = model_chunk_id
        try:
            yield
        finally:
            self.model_chunk_id = previous

    # ---- layers ------------------------------------------------------------------------
    def distribute_layers(
        self, num_layers: int, num_stages: int | None = None, num_model_chunks: int | None = None
    ) -> list[int]:
        """Layer count of every model slice (the explicit list, if one was given).

        Raises:
            ValueError: The explicit list does not sum to ``num_layers``, or see
                :func:`~colossal.pipeline.layout.distribute_layers`.
        """
        num_stages = self.num_stages if num_stages is None else num_stages
        chunks = self.num_model_chunks if num_model_chunks is None else num_model_chunks
        if self.num_layers_per_stage is not None:
            if sum(self.num_layers_per_stage) != num_layers:
                raise ValueError(
                    f"num_layers_per_stage {self.num_layers_per_stage} sums to "
                    f"{sum(self.num_layers_per_stage)}, but the model has {num_layers} layers"
                )
            return list(self.num_layers_per_stage)
        return distribute_layers(num_layers, num_stages, chunks)

    def get_stage_index(
        self, layers_per_stage: Sequence[int], stage: int | None = None
    ) -> tuple[int, int] | list[tuple[int, int]]:
        """Layer range ``[start, end)`` of this stage, or one range per chunk when interleaved."""
        ranges = stage_index(layers_per_stage, self.stage if stage is None else stage, self.layout)
        return ranges[0] if self.num_model_chunks == 1 else ranges

    # ---- groups ------------------------------------------------------------------------
    def init_process_group_by_stages(self, stages: Sequence[int]) -> ProcessGroup | None:
        """The group of ``stages`` in this rank's pipeline (collective: every rank calls it).

        Groups are created for the same stages of every pipeline of the mesh, in the same
        order on all ranks, so each rank gets the one of its own pipeline; ``None`` on ranks
        whose stage is not among ``stages``.

        Raises:
            ValueError: A stage outside ``[0, num_stages)`` or a repeated stage.
        """
        stages = list(stages)
        if len(set(stages)) != len(stages) or any(not 0 <= s < self.num_stages for s in stages):
            raise ValueError(f"stages must be distinct and in [0, {self.num_stages}), got {stages}")
        mine: ProcessGroup | None = None
        for line in self.pg_mesh.all_groups_along_axis(self.pipeline_axis):
            ranks = [line[s] for s in stages]
            group = self.pg_mesh.get_group(ranks)
            if self.pg_mesh.rank in ranks:
                mine = group
        return mine

    def __repr__(self) -> str:
        return (
            f"PipelineStageManager(stage={self.stage}/{self.num_stages}, "
            f"chunks={self.num_model_chunks}, layout={self.layout.kind!r})"
        )
