"""Where a model's repeated layers live: the one seam sequence and pipeline parallelism share.

Both split a transformers model at its stack of identical layers (``model.layers``,
``transformer.h``, ``encoder.layer``): sequence parallelism splits the hidden states on the
way into the stack and gathers them on the way out; pipeline parallelism gives each stage a
slice of it. :func:`find_layer_stack` finds the stack from the config's
``base_model_pp_plan`` when the model has one, else as the ``nn.ModuleList`` of
``config.num_hidden_layers`` modules holding the most parameters. The path is remembered on
the model instance, so a pipeline stage (a shallow copy holding fewer layers) finds it too.
"""

from __future__ import annotations

from torch import nn

__all__ = ["find_layer_stack"]

_PATH_ATTR = "_colossal_layer_stack_path"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _from_pp_plan(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_pp_plan", None) or {}
    base = getattr(model, "base_model", model)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    for key in plan:
        sub = base.get_submodule(key) if _has_submodule(base, key) else None
        if isinstance(sub, nn.ModuleList):
            return f"{prefix}.{key}" if prefix else key
    return None


def _has_submodule(module: nn.Module, dotted: str) -> bool:
    try:
        module.get_submodule(dotted)
    except AttributeError:
        return False
    return True


def find_layer_stack(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The dotted path and the ``nn.ModuleList`` of ``model``'s repeated layers.

    Args:
        model: A transformers model (any head) or base model.

    Returns:
        ``(path, layers)``, e.g. ``("model.layers", ModuleList(...))``.

    Raises:
        ValueError: No such stack, naming the model class and how to point at it.
    """
    path = getattr(model, _PATH_ATTR, None) or _from_pp_plan(model)
    if path is not None:
        layers = model.get_submodule(path)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(
                f"{type(model).__name__}.{path} is a {type(layers).__name__}, not the "
                "nn.ModuleList of its layers; point base_model_pp_plan at the layer list"
            )
        setattr(model, _PATH_ATTR, path)
        return path, layers
    want = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (want is None or len(m) == want)
    ]
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of its {want} layers; sequence and "
            "pipeline parallelism need one (give the config a base_model_pp_plan naming it)"
        )
    name, layers = max(candidates, key=lambda item: _numel(item[1]))
    setattr(model, _PATH_ATTR, name)  # found again after a pipeline stage drops layers
    return name, layers
