"""ParallelContext: the ``gpc`` the config-era API reads, a view of one ParallelDims.

``launch(config=...)`` (:mod:`colossal.legacy.launch`) parses the config, builds the job's
:class:`~colossal.core.ParallelDims`, creates the groups of every parallel mode the config
uses and installs them here. Afterwards the context answers ColossalAI's questions
(``gpc.config.X``, ``gpc.get_local_rank(ParallelMode.DATA)``,
``gpc.is_pipeline_first_stage()``...) but cannot change the layout: the mesh stays the
ParallelDims'. This module holds the one global of the design (``global_context``); nothing
below colossal-legacy reads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch.distributed as dist
from torch.distributed import ProcessGroup

from colossal.core import ParallelDims, set_seed
from colossal.legacy.config import Config
from colossal.legacy.context.initializer import GroupInfo, new_groups
from colossal.legacy.context.layer_env import LayerEnv
from colossal.legacy.context.parallel_config import ParallelSettings
from colossal.legacy.context.parallel_mode import ParallelMode

__all__ = ["ParallelContext", "global_context", "mode_axes"]

_WORLD: tuple[str, ...] = ()  # GLOBAL: the default group
# The expert axes, which ParallelDims names by a bare string (not a tuple of mesh axes).
_EXPERT = (("ep",), ("moe_dp",))

# Group names (of ParallelDims) behind each mode of a tensor mode.
_TENSOR_MODE_GROUPS: dict[str | None, dict[ParallelMode, tuple[str, ...]]] = {
    None: {},
    "1d": {ParallelMode.PARALLEL_1D: ("tp",)},
    "2d": {
        ParallelMode.PARALLEL_2D_ROW: ("tp_row",),
        ParallelMode.PARALLEL_2D_COL: ("tp_col",),
    },
    "2.5d": {
        ParallelMode.PARALLEL_2P5D_ROW: ("tp_row",),
        ParallelMode.PARALLEL_2P5D_COL: ("tp_col",),
        ParallelMode.PARALLEL_2P5D_DEP: ("tp_dep",),
        ParallelMode.PARALLEL_2P5D_XZ: ("tp_dep", "tp_row"),
    },
    "3d": {
        ParallelMode.PARALLEL_3D_INPUT: ("tp_input",),
        ParallelMode.PARALLEL_3D_WEIGHT: ("tp_weight",),
        ParallelMode.PARALLEL_3D_OUTPUT: ("tp_output",),
        ParallelMode.PARALLEL_3D_INPUT_X_WEIGHT: ("tp_input", "tp_weight"),
        ParallelMode.PARALLEL_3D_OUTPUT_X_WEIGHT: ("tp_output", "tp_weight"),
    },
    "sequence": {ParallelMode.SEQUENCE: ("sp",), ParallelMode.SEQUENCE_DP: ("dp", "sp")},
}


def mode_axes(settings: ParallelSettings) -> dict[ParallelMode, tuple[str, ...]]:
    """The ParallelDims group names of every built-in mode a config's settings create.

    ``GLOBAL`` maps to ``()`` (the default group).
    """
    axes: dict[ParallelMode, tuple[str, ...]] = {
        ParallelMode.GLOBAL: _WORLD,
        ParallelMode.DATA: ("dp",),
        ParallelMode.MODEL: ("pp", "sp", "tp"),
        ParallelMode.TENSOR: ("sp",) if settings.mode == "sequence" else ("tp",),
    }
    if settings.pipeline > 1:
        axes[ParallelMode.PIPELINE] = ("pp",)
    axes.update(_TENSOR_MODE_GROUPS.get(settings.mode, {}))
    if settings.moe is not None:
        axes[ParallelMode.MOE_MODEL] = ("ep",)
        axes[ParallelMode.MOE_DATA] = ("moe_dp",)
    return axes


def _key(mode: ParallelMode | str) -> object:
    if isinstance(mode, ParallelMode):
        return mode
    try:
        return ParallelMode(mode)
    except ValueError:
        return mode  # a custom mode's name


class ParallelContext:
    """The process groups and config of a config-era job (ColossalAI's ``gpc``).

    Filled once by :func:`colossal.legacy.launch` (or :func:`colossal.legacy.init_context`);
    read everywhere else. Modes a job does not use are not initialized: asking for their
    groups raises a ``RuntimeError`` that names the config key that creates them.
    """

    def __init__(self) -> None:
        self._config = Config()
        self._dims: ParallelDims | None = None
        self._settings = ParallelSettings()
        self._groups: dict[object, GroupInfo] = {}
        self._seed: int | None = None
        self.virtual_pipeline_parallel_size: int | None = None
        self.virtual_pipeline_parallel_rank: int | None = None
        #: State the mode-dispatched ``colossalai.nn`` layers pass along while a model is
        #: built (see :mod:`colossal.legacy.context.layer_env`).
        self.layer_env = LayerEnv()

    # ---- filled by launch ----------------------------------------------------------------
    def _install(
        self,
        config: Config,
        settings: ParallelSettings,
        dims: ParallelDims,
        custom: Mapping[object, GroupInfo] | None = None,
    ) -> None:
        """Create the groups of every built-in mode and take the custom ones (collective)."""
        if self._dims is not None:
            raise RuntimeError(
                "the global context is already initialized; launch once per process "
                "(gpc.destroy() first to launch again)"
            )
        groups: dict[object, GroupInfo] = {}
        for mode, axes in mode_axes(settings).items():
            groups[mode] = self._built_in(dims, mode, axes)
        groups.update(custom or {})
        self._config, self._settings, self._dims, self._groups = config, settings, dims, groups

    @staticmethod
    def _built_in(dims: ParallelDims, mode: ParallelMode, axes: tuple[str, ...]) -> GroupInfo:
        world = dist.get_world_size()
        rank = dist.get_rank()
        if not axes:
            whole = tuple(range(world))
            group = dist.group.WORLD
            assert group is not None
            cpu = group if dist.get_backend() == "gloo" else None
            if cpu is None:
                info = new_groups([whole], mode)
                assert info is not None
                cpu = info.cpu_group
            return GroupInfo(rank, world, group, cpu, whole, mode)
        names: str | tuple[str, ...] = axes[0] if axes in _EXPERT else axes
        group = dims.group(names)
        ranks = tuple(dims.ranks(names))
        cpu_group = group
        if dist.get_backend() != "gloo":
            every = sorted({tuple(dims.ranks(names, r)) for r in range(world)})
            info = new_groups(every, mode)
            assert info is not None
            cpu_group = info.cpu_group
        return GroupInfo(ranks.index(rank), len(ranks), group, cpu_group, ranks, mode)

    # ---- config and layout ---------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The job's config (empty before launch)."""
        return self._config

    @property
    def dims(self) -> ParallelDims:
        """The job's :class:`~colossal.core.ParallelDims` (what plugins and packages take).

        Raises:
            RuntimeError: Not launched yet.
        """
        if self._dims is None:
            raise RuntimeError(_NOT_LAUNCHED)
        return self._dims

    @property
    def settings(self) -> ParallelSettings:
        """The parsed ``parallel`` section of the config."""
        return self._settings

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel size (1 before launch)."""
        return self._dims.dp if self._dims is not None else 1

    @property
    def pipeline_parallel_size(self) -> int:
        """Pipeline stages (1 before launch)."""
        return self._settings.pipeline

    @property
    def tensor_parallel_size(self) -> int:
        """Tensor-parallel size, the sequence-parallel size in ``mode='sequence'``."""
        return self._settings.tensor

    @property
    def tensor_parallel_mode(self) -> str | None:
        """The config's tensor mode (``None``, ``'1d'``, ``'2d'``, ``'2.5d'``, ``'3d'``...)."""
        return self._settings.mode

    @property
    def num_processes_on_current_node(self) -> int:
        """Ranks on this node (``LOCAL_WORLD_SIZE`` when the launcher sets it)."""
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if local is not None and local.isdigit():
            return int(local)
        return dist.get_world_size() if dist.is_initialized() else 1

    # ---- per mode ------------------------------------------------------------------------
    def is_initialized(self, parallel_mode: ParallelMode | str) -> bool:
        """Whether the job has groups of ``parallel_mode``."""
        return _key(parallel_mode) in self._groups

    def _info(self, parallel_mode: ParallelMode | str) -> GroupInfo:
        info = self._groups.get(_key(parallel_mode))
        if info is not None:
            return info
        if self._dims is None:
            raise RuntimeError(_NOT_LAUNCHED)
        raise RuntimeError(
            f"{parallel_mode} is not initialized in this job: {_why_missing(parallel_mode)}"
        )

    def get_global_rank(self) -> int:
        """This process's rank in the job."""
        return dist.get_rank() if dist.is_initialized() else 0

    def get_local_rank(self, parallel_mode: ParallelMode | str) -> int:
        """This rank's index in its group of ``parallel_mode``."""
        return self._info(parallel_mode).local_rank

    def get_world_size(self, parallel_mode: ParallelMode | str) -> int:
        """Ranks in the groups of ``parallel_mode``."""
        return self._info(parallel_mode).world_size

    def get_group(self, parallel_mode: ParallelMode | str) -> ProcessGroup:
        """This rank's process group of ``parallel_mode``."""
        return self._info(parallel_mode).group

    def get_cpu_group(self, parallel_mode: ParallelMode | str) -> ProcessGroup:
        """A gloo group over the same ranks as :meth:`get_group`."""
        return self._info(parallel_mode).cpu_group

    def get_ranks_in_group(self, parallel_mode: ParallelMode | str) -> list[int]:
        """Global ranks of this rank's group of ``parallel_mode``, in group order."""
        return list(self._info(parallel_mode).ranks)

    def is_first_rank(self, parallel_mode: ParallelMode | str) -> bool:
        """Whether this rank is first in its group of ``parallel_mode``."""
        return self.get_local_rank(parallel_mode) == 0

    def is_last_rank(self, parallel_mode: ParallelMode | str) -> bool:
        """Whether this rank is last in its group of ``parallel_mode``."""
        info = self._info(parallel_mode)
        return info.local_rank == info.world_size - 1

    def get_next_global_rank(self, parallel_mode: ParallelMode | str) -> int:
        """Global rank of the next rank in the group (wrapping around)."""
        info = self._info(parallel_mode)
        return info.ranks[(info.local_rank + 1) % info.world_size]

    def get_prev_global_rank(self, parallel_mode: ParallelMode | str) -> int:
        """Global rank of the previous rank in the group (wrapping around)."""
        info = self._info(parallel_mode)
        return info.ranks[(info.local_rank - 1) % info.world_size]

    # ---- pipeline ------------------------------------------------------------------------
    def _stage(self) -> tuple[int, int]:
        if not self.is_initialized(ParallelMode.PIPELINE):
            return 0, 1
        info = self._info(ParallelMode.PIPELINE)
        return info.local_rank, info.world_size

    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        """Whether this rank runs the first pipeline stage (always, without a pipeline).

        With interleaved stages, also whether the current model chunk is the first, unless
        ``ignore_virtual``.
        """
        if not ignore_virtual and self.virtual_pipeline_parallel_rank not in (None, 0):
            return False
        return self._stage()[0] == 0

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        """Whether this rank runs the last pipeline stage (always, without a pipeline)."""
        if not ignore_virtual and self.virtual_pipeline_parallel_size is not None:
            if self.virtual_pipeline_parallel_rank != self.virtual_pipeline_parallel_size - 1:
                return False
        stage, stages = self._stage()
        return stage == stages - 1

    def set_virtual_pipeline_parallel_size(self, size: int | None) -> None:
        """Model chunks per stage of an interleaved pipeline (set by its schedule)."""
        self.virtual_pipeline_parallel_size = size

    def set_virtual_pipeline_parallel_rank(self, rank: int | None) -> None:
        """The model chunk running now in an interleaved pipeline."""
        self.virtual_pipeline_parallel_rank = rank

    # ---- seeds and teardown --------------------------------------------------------------
    def set_seed(self, seed: int) -> None:
        """Seed python, numpy and torch on this rank (the same seed on every rank)."""
        set_seed(seed)
        self._seed = seed

    @property
    def seed(self) -> int | None:
        """The seed given at launch."""
        return self._seed

    def destroy(self) -> None:
        """Forget the config and the groups (the ParallelDims' groups are destroyed)."""
        if self._dims is not None:
            self._dims.destroy()
        self.__init__()  # type: ignore[misc]


_NOT_LAUNCHED = (
    "the global context is empty: call colossal.legacy.launch(config=...) (or "
    "launch_from_torch(config=...)) first"
)


def _why_missing(parallel_mode: ParallelMode | str) -> str:
    key = _key(parallel_mode)
    if key is ParallelMode.PIPELINE:
        return "it needs parallel=dict(pipeline=N) with N > 1"
    if key in (ParallelMode.SEQUENCE, ParallelMode.SEQUENCE_DP):
        return "it needs parallel=dict(tensor=dict(size=N, mode='sequence'))"
    if key in (ParallelMode.MOE_MODEL, ParallelMode.MOE_DATA):
        return "it needs parallel=dict(moe=dict(size=E))"
    for mode, groups in _TENSOR_MODE_GROUPS.items():
        if key in groups:
            return f"it needs parallel=dict(tensor=dict(size=N, mode={mode!r}))"
    return "no initializer created it (see colossal.legacy.constants.INITIALIZER_MAPPING)"


#: The job's context: ColossalAI's ``from colossalai.core import global_context as gpc``.
global_context = ParallelContext()
