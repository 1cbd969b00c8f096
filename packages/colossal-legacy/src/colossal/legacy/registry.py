"""Registries: named classes that a config can refer to by ``type``.

ColossalAI's config-era API builds gradient handlers, process-group initializers, hooks and
more from dicts such as ``dict(type='DataParallelGradientHandler')``; a class becomes
buildable by decorating it with ``@GRADIENT_HANDLER.register_module``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TypeVar

__all__ = [
    "DATASETS",
    "DATA_SAMPLERS",
    "DIST_GROUP_INITIALIZER",
    "GRADIENT_HANDLER",
    "HOOKS",
    "LAYERS",
    "LOSSES",
    "LR_SCHEDULERS",
    "MODELS",
    "OPHOOKS",
    "OPTIMIZERS",
    "Registry",
    "SCHEDULE",
    "TRANSFORMS",
]

T = TypeVar("T")


class Registry:
    """Named objects of one kind.

    Args:
        name: What the registry holds, used in error messages.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._registry: dict[str, object] = {}

    def register_module(self, module_class: T) -> T:
        """Decorator: register ``module_class`` under its ``__name__``.

        Raises:
            ValueError: Another object has that name already.
        """
        key = getattr(module_class, "__name__", None)
        if not isinstance(key, str):
            raise TypeError(f"{self.name}: only named classes or functions can be registered")
        current = self._registry.get(key)
        if current is not None and current is not module_class:
            raise ValueError(f"{self.name} already has {key!r} ({current!r})")
        self._registry[key] = module_class
        return module_class

    def get_module(self, module_name: str) -> object:
        """The object registered as ``module_name``.

        Raises:
            NameError: Nothing is registered under that name (the error lists what is).
        """
        if module_name not in self._registry:
            raise NameError(
                f"{module_name!r} is not in the {self.name} registry (registered: "
                f"{sorted(self._registry)}); decorate your class with "
                f"@{self.name.upper()}.register_module"
            )
        return self._registry[module_name]

    def has(self, module_name: str) -> bool:
        """Whether ``module_name`` is registered."""
        return module_name in self._registry

    def build(self, spec: Mapping[str, object], **defaults: object) -> object:
        """Call the object named by ``spec["type"]`` with the other keys (over ``defaults``).

        Raises:
            ValueError: ``spec`` has no ``type``.
        """
        if "type" not in spec:
            raise ValueError(f"{self.name}: {dict(spec)!r} needs a 'type' naming what to build")
        factory = self.get_module(str(spec["type"]))
        if not callable(factory):
            raise TypeError(f"{self.name}: {spec['type']!r} is not callable")
        kwargs = {**defaults, **{k: v for k, v in spec.items() if k != "type"}}
        return factory(**kwargs)

    def __contains__(self, module_name: object) -> bool:
        return module_name in self._registry

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry)

    def __repr__(self) -> str:
        return f"Registry({self.name!r}, {sorted(self._registry)})"


DIST_GROUP_INITIALIZER = Registry("dist_group_initializer")
GRADIENT_HANDLER = Registry("gradient_handler")
HOOKS = Registry("hooks")
OPHOOKS = Registry("ophooks")
LAYERS = Registry("layers")
LOSSES = Registry("losses")
MODELS = Registry("models")
OPTIMIZERS = Registry("optimizers")
LR_SCHEDULERS = Registry("lr_schedulers")
SCHEDULE = Registry("schedule")
DATASETS = Registry("datasets")
DATA_SAMPLERS = Registry("data_samplers")
TRANSFORMS = Registry("transforms")
