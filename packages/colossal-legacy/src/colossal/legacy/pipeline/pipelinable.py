"""PipelinableContext: build a model once, keep only this pipeline stage's layers.

The seeds' way to pipeline an ordinary model ("Pipeline Parallel", ResNet example)::

    pipelinable = PipelinableContext()
    with pipelinable:
        model = resnet50()                      # built lazily: no weight memory yet
    flatten = (lambda x: torch.flatten(x, 1), "behind")
    pipelinable.to_layer_list(["conv1", "bn1", ..., "avgpool", flatten, "fc"])
    model = pipelinable.partition(num_chunks, gpc.pipeline_parallel_size,
                                  gpc.get_local_rank(ParallelMode.PIPELINE))

Inside the context the model is built under :class:`colossal.lazy.LazyInitContext`;
``partition`` materializes only this stage's layers, with the values an eager build would
have given them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Literal

from torch import nn

from colossal.lazy import LazyInitContext
from colossal.legacy.builder.partition import Parts, partition_balanced, partition_uniform

__all__ = ["ExecStep", "PipelinableContext", "PipelinableModel"]

#: One entry of an execution sequence: a child module's name, a module, or a function with
#: where it goes (``"behind"`` the previous layer or in ``"front"`` of the next).
ExecStep = str | nn.Module | tuple[Callable[..., object], str]

_Policy = Literal["balanced", "uniform"]


class _Func(nn.Module):
    """A function in the layer list (no parameters)."""

    def __init__(self, fn: Callable[..., object]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: object) -> object:
        return self.fn(*args)


class PipelinableModel(nn.Module):
    """This stage's layers, run in order; functions attached to them run with them.

    Args:
        layers: ``(name, module)`` pairs in execution order; names are kept as the
            submodule names so state-dict keys match the whole model's.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self._order: list[str] = []
        for name, module in layers:
            key = name.replace(".", "_")
            self.add_module(key, module)
            self._order.append(key)

    def forward(self, *args: object, **kwargs: object) -> object:
        """Feed the inputs through every layer in order."""
        out: object = None
        for i, key in enumerate(self._order):
            layer = self._modules[key]
            assert layer is not None
            if i == 0:
                out = layer(*args, **kwargs)
            else:
                out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out


class PipelinableContext:
    """Record a model built inside the context and split it into pipeline stages.

    Args:
        policy: ``"balanced"`` (by parameter count, the default) or ``"uniform"`` (by layer
            count); settable later through :attr:`policy`.
    """

    def __init__(self, policy: _Policy = "balanced") -> None:
        self.policy: _Policy = policy
        self._lazy = LazyInitContext()
        self._built: list[nn.Module] = []
        self._saved_init: Callable[..., None] | None = None
        self._layers: list[tuple[str, nn.Module]] | None = None

    def __enter__(self) -> PipelinableContext:
        self._built.clear()
        saved = nn.Module.__init__
        built = self._built

        def recording_init(module: nn.Module, *args: object, **kwargs: object) -> None:
            saved(module, *args, **kwargs)
            built.append(module)

        self._saved_init = saved
        nn.Module.__init__ = recording_init  # type: ignore[method-assign, assignment]
        self._lazy.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lazy.__exit__(exc_type, exc, tb)
        assert self._saved_init is not None
        nn.Module.__init__ = self._saved_init  # type: ignore[method-assign]

    @property
    def model(self) -> nn.Module:
        """The model built in the context: the last module built that is no other's child."""
        children = {id(c) for m in self._built for c in m.children()}
        roots = [m for m in self._built if id(m) not in children]
        if not roots:
            raise RuntimeError("no module was built inside `with PipelinableContext():`")
        return roots[-1]

    def to_layer_list(self, exec_seq: Sequence[ExecStep] | None = None) -> None:
        """Fix the sequence of layers to split.

        Args:
            exec_seq: Names of the model's children (dotted paths allowed), modules, and
                ``(function, "behind" | "front")`` pairs, in execution order. ``None`` takes
                the model's direct children in registration order (right only when its
                forward calls them in that order, one after another).

        Raises:
            ValueError: An unknown name or a function placement other than behind/front.
        """
        model = self.model
        if exec_seq is None:
            self._layers = list(model.named_children())
            return
        layers: list[tuple[str, nn.Module]] = []
        pending_front: list[Callable[..., object]] = []
        for i, step in enumerate(exec_seq):
            if isinstance(step, tuple):
                fn, where = step
                if where == "behind":
                    if not layers:
                        raise ValueError(
                            f"exec_seq[{i}]: a function 'behind' needs a layer before it"
                        )
                    name, prev = layers[-1]
                    layers[-1] = (name, nn.Sequential(prev, _Func(fn)))
                elif where == "front":
                    pending_front.append(fn)
                else:
                    raise ValueError(
                        f"exec_seq[{i}]: function placement {where!r} must be 'behind' or 'front'"
                    )
                continue
            if isinstance(step, str):
                try:
                    module = model.get_submodule(step)
                except AttributeError:
                    children = [n for n, _ in model.named_children()]
                    raise ValueError(
                        f"exec_seq[{i}]={step!r} is not a submodule of "
                        f"{type(model).__name__} (children: {children})"
                    ) from None
                name = step
            elif isinstance(step, nn.Module):
                module, name = step, f"layer{i}"
            else:
                raise ValueError(f"exec_seq[{i}]={step!r} is not a name, module or (fn, where)")
            if pending_front:
                module = nn.Sequential(*(_Func(f) for f in pending_front), module)
                pending_front.clear()
            layers.append((name, module))
        if pending_front:
            raise ValueError("exec_seq ends with a 'front' function and no layer after it")
        self._layers = layers

    @property
    def layers(self) -> list[tuple[str, nn.Module]]:
        """The ``(name, module)`` sequence fixed by :meth:`to_layer_list`."""
        if self._layers is None:
            self.to_layer_list()
        assert self._layers is not None
        return self._layers

    def parts(self, num_chunks: int, pipeline_size: int) -> Parts:
        """The ``(start, end)`` slices of :attr:`layers` per stage, by :attr:`policy`."""
        if self.policy == "uniform":
            return partition_uniform(len(self.layers), pipeline_size, num_chunks)
        if self.policy == "balanced":
            counts = [float(sum(p.numel() for p in m.parameters())) for _, m in self.layers]
            return partition_balanced(counts, pipeline_size, num_chunks)
        raise ValueError(f"policy={self.policy!r} must be 'balanced' or 'uniform'")

    def partition(self, num_chunks: int, pipeline_size: int, rank: int) -> nn.Module:
        """This stage's model: one :class:`PipelinableModel`, or a ``ModuleList`` of chunks.

        Only the returned layers are materialized.

        Raises:
            ValueError: ``rank`` is not a stage of ``pipeline_size``.
        """
        if not 0 <= rank < pipeline_size:
            raise ValueError(f"rank={rank} is not a stage of a {pipeline_size}-stage pipeline")
        chunks = []
        for start, end in self.parts(num_chunks, pipeline_size)[rank]:
            chunk = PipelinableModel(self.layers[start:end])
            LazyInitContext.materialize(chunk)
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)

    def __repr__(self) -> str:
        return f"PipelinableContext(policy={self.policy!r}, layers={len(self._layers or [])})"
