"""RuntimeMemTracer: run one forward/backward and record non-model memory and parameter use.

How it measures (module-level steps, op-level detail):

- Steps: a step begins when a module's forward starts (forward pre-hook on every leaf module
  and every module that owns parameters directly) and, in backward, when the gradient of that
  module's output arrives (a hook on its output tensors). Work between modules belongs to
  the step before it; backward work before the first module's gradient is step
  ``"<start>"``.
- Parameter use: every operator is seen through a ``TorchDispatchMode``; an operator reading
  a parameter's storage (including views such as ``weight.t()``) uses that parameter in the
  current step, and so does the arrival of a parameter's gradient.
- Non-model bytes on the CPU: the untyped storage of every tensor an operator reads or
  produces is counted once (keyed by storage) unless it holds model data (a parameter, a
  buffer or a parameter's gradient), and subtracted when the storage is freed
  (``weakref.finalize``). Inputs therefore count from their first use. On CUDA it is
  ``torch.cuda.memory_allocated()`` minus the model data (parameters, buffers, gradients).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from colossal.core.accelerator import get_accelerator
from colossal.gemini.memory.stats import MemStats, Phase, StepRecord

logger = logging.getLogger(__name__)

Backend = Literal["auto", "dispatch", "cuda"]


def _in_backward() -> bool:
    node = getattr(torch._C, "_current_autograd_node", None)
    return node is not None and node() is not None


class _Recorder:
    """Live non-model bytes, the current step, and the finished step records."""

    def __init__(self, params: list[nn.Parameter], buffers: list[torch.Tensor], cuda: bool):
        self.cuda = cuda
        self.lock = threading.RLock()
        self.param_of: dict[int, nn.Parameter] = {}
        self.model_keys: set[int] = set()
        self.model_static_bytes = 0
        for p in params:
            s = p.untyped_storage()
            self.param_of[id(s)] = p
            if id(s) not in self.model_keys:
                self.model_keys.add(id(s))
                self.model_static_bytes += s.nbytes()
        for b in buffers:
            s = b.untyped_storage()
            if id(s) not in self.model_keys:
                self.model_keys.add(id(s))
                self.model_static_bytes += s.nbytes()
        self.grad_bytes = 0
        self.nonmodel: dict[int, int] = {}  # id(storage) -> nbytes
        self.finalizers: list[weakref.finalize] = []
        self.live = 0
        self.records: list[StepRecord[nn.Parameter]] = []
        self.phase: Phase = "forward"
        self.label = "<start>"
        self.start = self.peak = 0
        self.uses: dict[int, nn.Parameter] = {}
        self.touched = False

    # ---- steps ---------------------------------------------------------------------------
    def begin(self, phase: Phase, label: str) -> None:
        with self.lock:
            if phase == self.phase and label == self.label:
                return
            self.close()
            self.phase, self.label = phase, label
            self.start = self.peak = self.live
            self.uses = {}
            self.touched = False

    def close(self) -> None:
        with self.lock:
            if self.touched or self.uses:
                self.records.append(
                    StepRecord(
                        len(self.records), self.phase, self.label, self.start, self.live,
                        self.peak, tuple(self.uses.values()),
                    )
                )
            self.touched = False
            self.uses = {}

    def use(self, param: nn.Parameter) -> None:
        self.uses.setdefault(id(param), param)
        self.touched = True

    # ---- bytes ---------------------------------------------------------------------------
    def _set_live(self, value: int) -> None:
        self.live = value
        if value > self.peak:
            self.peak = value

    def refresh_cuda(self) -> None:  # pragma: no cover - CUDA only
        model = self.model_static_bytes + self.grad_bytes
        self._set_live(max(0, torch.cuda.memory_allocated() - model))

    def see(self, t: torch.Tensor) -> None:
        """Note a tensor an operator read or produced."""
        if t.is_meta or t.layout != torch.strided:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # wrapper subclasses: no storage
            return
        key = id(storage)
        param = self.param_of.get(key)
        if param is not None:
            self.use(param)
            return
        if self.cuda or key in self.model_keys or key in self.nonmodel:
            return
        nbytes = storage.nbytes()
        with self.lock:
            self.nonmodel[key] = nbytes
            self._set_live(self.live + nbytes)
        self.finalizers.append(weakref.finalize(storage, self._freed, key))

    def _freed(self, key: int) -> None:
        with self.lock:
            nbytes = self.nonmodel.pop(key, None)
            if nbytes is not None:
                self.live -= nbytes
            self.model_keys.discard(key)

    def grad_arrived(self, param: nn.Parameter) -> None:
        """A parameter's gradient was accumulated: it is model data, and a use."""
        with self.lock:
            self.use(param)
            grad = param.grad
            if grad is None:
                return
            storage = grad.untyped_storage()
            key = id(storage)
            if key in self.model_keys:
                return
            nbytes = self.nonmodel.pop(key, None)
            if nbytes is not None:
                self.live -= nbytes
            self.model_keys.add(key)
            self.grad_bytes += storage.nbytes()
            self.finalizers.append(weakref.finalize(storage, self._freed, key))

    def detach(self) -> None:
        for fin in self.finalizers:
            fin.detach()
        self.finalizers.clear()


class _OpMode(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.rec = recorder

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        rec = self.rec
        if rec.phase == "forward" and _in_backward():
            rec.begin("backward", "<start>")
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                rec.see(leaf)
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                rec.see(leaf)
        rec.touched = True
        if rec.cuda:  # pragma: no cover - CUDA only
            rec.refresh_cuda()
        return out


class RuntimeMemTracer:
    """Trace a forward and backward of ``model`` and record a :class:`MemStats`.

    Use it as a context manager around one training step's forward and backward (the model
    is not modified; hooks are removed on exit)::

        tracer = RuntimeMemTracer(model)
        with tracer:
            loss = model(x).sum()
            loss.backward()
        stats = tracer.memstats

    ``tracer(*args)`` calls the model, and ``tracer.backward(loss)`` calls ``loss.backward()``.

    Args:
        model: The module to trace.
        backend: ``"dispatch"`` counts live tensor storages (exact, any device), ``"cuda"``
            reads ``torch.cuda.memory_allocated()``; ``"auto"`` picks ``"cuda"`` when the
            accelerator is CUDA and the model's parameters are on it, else ``"dispatch"``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``backend`` is unknown.
    """

    def __init__(self, model: nn.Module, backend: Backend = "auto") -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"RuntimeMemTracer needs an nn.Module, got {type(model).__name__}")
        if backend not in ("auto", "dispatch", "cuda"):
            raise ValueError(f"unknown backend {backend!r}; use 'auto', 'dispatch' or 'cuda'")
        if backend == "auto":
            on_cuda = any(p.is_cuda for p in model.parameters())
            backend = "cuda" if on_cuda and get_accelerator().name == "cuda" else "dispatch"
        self.model = model
        self.backend: Backend = backend
        self._memstats: MemStats[nn.Parameter] | None = None
        self._rec: _Recorder | None = None
        self._mode: _OpMode | None = None
        self._handles: list[Any] = []

    @property
    def memstats(self) -> MemStats[nn.Parameter]:
        """The recorded statistics (available after the ``with`` block)."""
        if self._memstats is None:
            raise RuntimeError("no trace recorded yet; run the step inside `with tracer:` first")
        return self._memstats

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward."""
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Run ``loss.backward()`` inside the trace."""
        if self._rec is not None:
            self._rec.begin("backward", "<start>")
        loss.backward()

    def __enter__(self) -> RuntimeMemTracer:
        if self._rec is not None:
            raise RuntimeError("RuntimeMemTracer is already active")
        params = list(self.model.parameters())
        buffers = list(self.model.buffers())
        rec = _Recorder(params, buffers, cuda=self.backend == "cuda")
        self._rec = rec
        for name, module in self.model.named_modules():
            owns_params = any(True for _ in module.parameters(recurse=False))
            if next(module.children(), None) is not None and not owns_params:
                continue
            label = name or "<root>"
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(label)))
            self._handles.append(module.register_forward_hook(self._post_forward(label)))
        for p in params:
            if p.requires_grad:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(rec.grad_arrived)
                )
        if rec.cuda:  # pragma: no cover - CUDA only
            rec.refresh_cuda()
            rec.start = rec.peak = rec.live
        self._mode = _OpMode(rec)
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._mode is not None and self._rec is not None
        self._mode.__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        rec = self._rec
        rec.close()
        rec.detach()
        self._memstats = MemStats(rec.records)
        self._rec = self._mode = None
        logger.debug("traced %d steps, non-model peak %d B", len(rec.records),
                     self._memstats.peak_non_model_bytes)

    # ---- hooks ---------------------------------------------------------------------------
    def _pre_forward(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._rec is not None:
                self._rec.begin("forward", label)

        return hook

    def _post_forward(self, label: str) -> Callable[..., None]:
        def on_grad(grad: torch.Tensor) -> None:
            if self._rec is not None:
                self._rec.begin("backward", label)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(on_grad)

        return hook
