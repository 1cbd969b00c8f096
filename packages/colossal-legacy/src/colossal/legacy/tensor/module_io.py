"""The boundary of a module whose parameters are ColoTensors: plain tensors in, plain out.

The seeds' ColoTensor models take plain ``torch.Tensor`` batches and return plain outputs
("ColoTensor is capable of inferring the computation patterns of all operators"). Here every
operator inside runs on ``DTensor`` and its sharding propagation; this module only converts at
the model boundary (:func:`attach_colo_io`, installed by ``ColoInitContext`` on the modules it
builds that are not inside another):

* in: each plain tensor argument is this data-parallel rank's part of the global batch, so it
  becomes a DTensor split along dim 0 over the process group's dp dimension and replicated
  over tp (a 0-d tensor is replicated); plain tensors made inside (masks, position ids) are
  treated as replicated (torch's ``implicit_replication``);
* out (when a plain tensor came in; ColoTensor inputs give DTensor outputs as they are):
  each DTensor output becomes this dp rank's part of it, whole over tp (a 0-d output,
  e.g. a loss computed inside, its global value); differentiable. As in DDP, each rank's loss
  is its own batch's and the parameters' gradients are averaged over dp: DTensor sums the
  ranks' ``Partial`` gradients, the boundary scales the outputs' gradients by ``1 / dp``, and
  each gradient is laid out like its parameter once accumulated.
* A module holding TP1D ColoParameters makes its output whole over tp unless their compute
  specs say ``set_output_replicate(False)`` (:mod:`.output_spec`).
* An operator DTensor has no sharding strategy for raises :class:`NotImplementedError` naming
  the operator and its arguments' placements; nothing is replicated silently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from colossal.legacy.tensor.output_spec import hook_output_specs
from colossal.legacy.tensor.state import accept_plain_state

__all__ = ["attach_colo_io", "colo_mesh_of", "to_colo_input", "to_plain_output"]

_HOOKED = "_colo_io_hooked"
_STACKS = "_colo_io_stacks"


def colo_mesh_of(module: nn.Module) -> DeviceMesh | None:
    """The ``("dp", "tp")`` mesh of ``module``'s DTensor parameters (``None`` without any).

    Raises:
        ValueError: Its DTensor parameters lie on different meshes.
    """
    mesh: DeviceMesh | None = None
    for name, param in module.named_parameters():
        if isinstance(param, DTensor):
            if mesh is None:
                mesh = param.device_mesh
            elif param.device_mesh != mesh:
                raise ValueError(
                    f"parameter {name!r} is on {param.device_mesh}, others on {mesh}: call "
                    "set_process_group(pg) with one ProcessGroup on every parameter"
                )
    return mesh


def to_colo_input(value: object, mesh: DeviceMesh) -> object:
    """``value`` with each plain tensor made a DTensor (dim 0 split over dp, replicated on tp)."""

    def convert(x: object) -> object:
        if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
            return x
        dp_place: Placement = Shard(0) if x.dim() > 0 else Replicate()
        placements: list[Placement] = [dp_place] + [Replicate()] * (mesh.ndim - 1)
        return DTensor.from_local(x, mesh, placements, run_check=False)

    return tree_map(convert, value)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, factor: float
    ) -> torch.Tensor:
        ctx.factor = factor  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None  # type: ignore[attr-defined]


def _plain(x: DTensor) -> torch.Tensor:
    """This dp rank's part of ``x``, whole over tp; gradients averaged over dp in backward."""
    mesh = x.device_mesh
    if x.dim() == 0:
        return x.full_tensor()
    placements: list[Placement] = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    local = x.redistribute(mesh, placements).to_local()
    dp = mesh.size(0)
    return local if dp == 1 else cast(torch.Tensor, _ScaleGrad.apply(local, 1.0 / dp))


def to_plain_output(value: object) -> object:
    """``value`` with each DTensor made plain (see the module doc); differentiable."""
    if isinstance(value, dict):  # transformers' ModelOutput is a dict that tree_map keeps
        for key in list(value.keys()):
            value[key] = to_plain_output(value[key])
        return value
    return tree_map(lambda x: _plain(x) if isinstance(x, DTensor) else x, value)


@contextmanager
def _implicit_replication() -> Iterator[None]:
    """Plain tensors meeting DTensors count as replicated; the previous setting is restored.

    (torch's ``implicit_replication`` resets the flag to ``False`` on exit, which would end an
    enclosing model's setting.)
    """
    dispatcher = DTensor._op_dispatcher
    before = bool(dispatcher._allow_implicit_replication)
    dispatcher._allow_implicit_replication = True
    try:
        yield
    finally:
        dispatcher._allow_implicit_replication = before


def _saved_as_replicated(mesh: DeviceMesh) -> torch.autograd.graph.saved_tensors_hooks:
    """Save plain tensors (position ids, masks) for backward as replicated DTensors.

    Backward runs after the forward's implicit replication has ended, so a plain tensor an
    operator saved next to DTensors (``embedding``'s position ids) is made a DTensor when saved.
    """

    def pack(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return x
        return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)

    def unpack(x: torch.Tensor) -> torch.Tensor:
        return x

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _placements_text(args: object) -> str:
    """The placements of the DTensors in an operator's arguments, for an error message."""
    leaves, _ = tree_flatten(args)
    parts = [f"{tuple(x.shape)}:{tuple(x.placements)}" for x in leaves if isinstance(x, DTensor)]
    return ", ".join(parts) or "none"


def _strategy_error(exc: Exception) -> bool:
    """Whether ``exc`` is DTensor saying an operator has no sharding strategy."""
    text = str(exc)
    return "sharding strategy" in text or "sharding propagation" in text.lower()


class _NamingMode(torch.overrides.TorchFunctionMode):
    """Re-raise DTensor's missing-strategy errors naming the call and its placements."""

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except NotImplementedError as exc:
            if not _strategy_error(exc) or "ColoTensor:" in str(exc):
                raise
            name = getattr(func, "__name__", repr(func))
            raise NotImplementedError(
                f"ColoTensor: operator {name} has no sharding strategy for arguments with "
                f"placements [{_placements_text((args, kwargs))}]; nothing is replicated "
                f"silently: lay the inputs out as a supported pattern (set_dist_spec) or "
                f"register a strategy. DTensor said: {exc}"
            ) from exc


_GRAD_HOOKED = "_colo_grad_hooked"


def _lay_out_grad(param: torch.Tensor) -> None:
    """Give ``param``'s accumulated gradient the parameter's own placements.

    DTensor's backward may leave a gradient ``Partial`` (summed over dp, or over tp where a
    replicated parameter met sharded activations); the reduction happens here, once, so the
    optimizer and ``clip_grad_norm_`` see a gradient laid out like its parameter.
    """
    grad = param.grad
    if isinstance(param, DTensor) and isinstance(grad, DTensor):
        if tuple(grad.placements) != tuple(param.placements):
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _hook_grads(module: nn.Module) -> None:
    """Register :func:`_lay_out_grad` once on each DTensor parameter of ``module``."""
    for param in module.parameters():
        if isinstance(param, DTensor) and not getattr(param, _GRAD_HOOKED, False):
            param.register_post_accumulate_grad_hook(_lay_out_grad)
            setattr(param, _GRAD_HOOKED, True)


def _enter(
    module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[tuple[object, ...], dict[str, object]] | None:
    """Forward pre-hook: inputs to DTensors and the DTensor settings entered."""
    mesh = colo_mesh_of(module)
    stacks: list[tuple[ExitStack, bool]] = module.__dict__.setdefault(_STACKS, [])
    stack = ExitStack()
    leaves, _ = tree_flatten((args, kwargs))
    plain = any(isinstance(x, torch.Tensor) and not isinstance(x, DTensor) for x in leaves)
    stacks.append((stack, mesh is not None and plain))
    if mesh is None:
        return None
    _hook_grads(module)
    hook_output_specs(module)
    stack.enter_context(_implicit_replication())
    stack.enter_context(_saved_as_replicated(mesh))
    stack.enter_context(_NamingMode())
    return (
        cast(tuple[object, ...], to_colo_input(args, mesh)),
        cast(dict[str, object], to_colo_input(kwargs, mesh)),
    )


def _leave(
    module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], output: object
) -> object:
    """Forward hook (also run when forward raises): settings left, outputs made plain.

    Outputs stay DTensors when the caller passed no plain tensor (ColoTensors in, out).
    """
    stacks: list[tuple[ExitStack, bool]] = module.__dict__.get(_STACKS, [])
    if not stacks:
        return output
    stack, plain = stacks.pop()
    stack.close()
    return to_plain_output(output) if plain else output


def attach_colo_io(module: nn.Module) -> nn.Module:
    """Make ``module`` take plain tensors and return plain tensors (see the module doc).

    Installed as forward hooks (so ``deepcopy`` and ``state_dict`` are unaffected); idempotent;
    returns ``module``. Modules without DTensor parameters run unchanged. ``load_state_dict``
    also takes a plain model's whole tensors (:func:`~.state.accept_plain_state`).
    """
    if getattr(module, _HOOKED, False):
        return module
    accept_plain_state(module)
    module.register_forward_pre_hook(_enter, with_kwargs=True)
    module.register_forward_hook(_leave, with_kwargs=True, always_call=True)
    setattr(module, _HOOKED, True)
    return module
