"""The ``parallel`` section of a config, validated, as a :class:`~colossal.core.ParallelDims`.

The rules are the seeds' ("Configure Parallelization"): ``pipeline`` and ``data`` are an int or
``dict(size=N)``; ``tensor`` is ``dict(size=N, mode=...)`` (a bare ``tensor=4`` is refused:
the mode must be named); anything left unset is 1 and the data-parallel size is inferred as
``world_size / (pipeline * tensor)``. ``moe=dict(size=E)`` (or ``moe=E``) splits the
data-parallel ranks into MoE model-parallel groups of ``E`` consecutive ranks (each holds a
share of the experts) and MoE data-parallel groups across them (``ParallelDims(ep=E)``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from colossal.core import ParallelDims

__all__ = ["GRID_MODES", "TENSOR_MODES", "ParallelSettings", "parse_parallel"]

#: Tensor modes built into the config API; other names need an initializer registered in
#: ``INITIALIZER_MAPPING`` (see :mod:`colossal.legacy.context.initializer`).
TENSOR_MODES = (None, "1d", "2d", "2.5d", "3d", "sequence")
#: Tensor modes whose ranks form a grid (``ParallelDims.tp_mode``).
GRID_MODES = ("2d", "2.5d", "3d")


@dataclass(frozen=True)
class ParallelSettings:
    """The parallel sizes a config asks for.

    Attributes:
        data: Data-parallel size, ``-1`` to infer it from the world size.
        pipeline: Pipeline stages.
        tensor: Tensor-parallel size (the sequence-parallel size in ``mode='sequence'``).
        mode: Tensor mode: one of :data:`TENSOR_MODES` or a custom initializer's mode.
        depth: Depth of the 2.5D grid.
        tensor_kwargs: Further keys of ``tensor=dict(...)`` (a custom initializer's args).
        moe: MoE model-parallel size (``parallel=dict(moe=dict(size=E))``); ``None``
            without ``moe`` (no MoE groups).
    """

    data: int = -1
    pipeline: int = 1
    tensor: int = 1
    mode: str | None = None
    depth: int = 1
    tensor_kwargs: Mapping[str, object] = field(default_factory=dict)
    moe: int | None = None

    def to_dims(self, world_size: int | None = None) -> ParallelDims:
        """The :class:`ParallelDims` of these settings (validated against the world size).

        Raises:
            ValueError: The sizes do not fit the world size (``moe`` must divide the
                data-parallel size).
        """
        try:
            return self._dims(world_size)
        except ValueError as err:
            if self.moe is not None and "ep=" in str(err):
                raise ValueError(
                    f"parallel.moe size {self.moe} must divide the data-parallel size: {err}; "
                    "set moe=dict(size=E) with E among those divisors"
                ) from err
            raise

    def _dims(self, world_size: int | None) -> ParallelDims:
        grid = self.mode in GRID_MODES
        sequence = self.mode == "sequence"
        return ParallelDims(
            dp=self.data,
            pp=self.pipeline,
            tp=1 if sequence else self.tensor,
            sp=self.tensor if sequence else 1,
            tp_mode=self.mode if grid or self.mode == "1d" else None,
            tp_depth=self.depth if self.mode == "2.5d" else 1,
            ep=self.moe or 1,
            world_size=world_size,
        )


def _size(section: str, value: object) -> int:
    if isinstance(value, Mapping):
        if "size" not in value:
            raise ValueError(
                f"parallel.{section}={dict(value)!r} has no size; write "
                f"parallel=dict({section}=dict(size=N)) or {section}=N"
            )
        value = value["size"]
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"parallel.{section} size must be a positive int, got {value!r}")
    return value


def parse_parallel(
    parallel: Mapping[str, object] | None, custom_modes: tuple[str, ...] = ()
) -> ParallelSettings:
    """Validate a config's ``parallel`` section.

    Args:
        parallel: ``config.parallel`` (``None`` when the config has none: all sizes 1).
        custom_modes: Tensor modes with a registered initializer, accepted besides the
            built-in ones.

    Raises:
        ValueError: An unknown key, a size that is not a positive int, ``tensor`` given as
            a bare size above 1 or without a mode, an unknown mode, or a 2.5D mode without
            ``depth``.
    """
    if parallel is None:
        return ParallelSettings()
    if not isinstance(parallel, Mapping):
        raise ValueError(
            f"parallel must be a dict like dict(pipeline=2, tensor=dict(size=4, mode='2d')), "
            f"got {parallel!r}"
        )
    known = {"data", "pipeline", "tensor", "moe"}
    unknown = sorted(set(parallel) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in parallel; use {sorted(known)}")
    moe = _size("moe", parallel["moe"]) if "moe" in parallel else None
    settings = _parse_sizes(parallel, custom_modes)
    return replace(settings, moe=moe) if moe is not None else settings


def _parse_sizes(parallel: Mapping[str, object], custom_modes: tuple[str, ...]) -> ParallelSettings:
    """The data, pipeline and tensor sections (``parse_parallel`` without ``moe``)."""
    data = _size("data", parallel["data"]) if "data" in parallel else -1
    pipeline = _size("pipeline", parallel["pipeline"]) if "pipeline" in parallel else 1
    tensor = parallel.get("tensor")
    if tensor is None:
        return ParallelSettings(data=data, pipeline=pipeline)
    if not isinstance(tensor, Mapping):
        size = _size("tensor", tensor)
        if size == 1:
            return ParallelSettings(data=data, pipeline=pipeline)
        raise ValueError(
            f"parallel.tensor={tensor!r} does not say which tensor parallelism to use; write "
            f"tensor=dict(size={size}, mode='1d') (or '2d', '2.5d', '3d', 'sequence')"
        )
    size = _size("tensor", tensor) if "size" in tensor else 1
    mode = tensor.get("mode")
    modes = (*TENSOR_MODES, *custom_modes)
    if mode not in modes:
        raise ValueError(
            f"parallel.tensor.mode={mode!r} is not one of {list(modes)}; register an "
            "initializer in INITIALIZER_MAPPING for a mode of your own"
        )
    if size > 1 and mode is None:
        raise ValueError(
            f"parallel.tensor has size {size} but no mode; add mode='1d' (or '2d', '2.5d', "
            "'3d', 'sequence')"
        )
    depth = tensor.get("depth", 1)
    if mode == "2.5d" and "depth" not in tensor:
        raise ValueError(
            f"tensor mode '2.5d' needs its depth: tensor=dict(size={size}, mode='2.5d', "
            "depth=d) with size = d * q * q"
        )
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        raise ValueError(f"parallel.tensor.depth must be a positive int, got {depth!r}")
    extra = {k: v for k, v in tensor.items() if k not in ("size", "mode", "depth")}
    return ParallelSettings(data, pipeline, size, mode, depth, extra)
