"""The sharder: applies a policy's module descriptions to a model, then checks the result.

For every instance of each policy key class it sets the divided attributes, replaces
submodules with parallel layers (``from_native_module``) and puts the listed submodules'
inputs into the tensor-parallel region. Native embeddings are replaced before everything
else, so an LM head whose weight is the embedding's Parameter finds it already sharded and
reuses it (weights stay tied). Afterwards every parameter name must still exist, no name may
appear, and parameters that were one object (tied) must still be one object.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from colossal.core import shard_spec
from colossal.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    PolicyMap,
    SubModuleReplacementDescription,
)

__all__ = ["ShardSummary", "apply_module_policy", "get_submodule", "set_attribute"]

logger = logging.getLogger(__name__)


@dataclass
class ShardSummary:
    """What :func:`apply_module_policy` did.

    Attributes:
        replaced: ``"<module path>" -> "<parallel class name>"`` for every replaced submodule.
        attributes: Dotted attribute paths that were set.
        tp_regions: Paths of modules whose input enters the tensor-parallel region.
        sharded_params: Names of parameters now marked sharded.
    """

    replaced: dict[str, str] = field(default_factory=dict)
    attributes: list[str] = field(default_factory=list)
    tp_regions: list[str] = field(default_factory=list)
    sharded_params: list[str] = field(default_factory=list)


def _join(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}" if prefix and suffix else prefix or suffix


def get_submodule(module: nn.Module, dotted: str) -> nn.Module | None:
    """``module``'s submodule at ``dotted`` (``""``: itself), None when absent."""
    if not dotted:
        return module
    current: Any = module
    for part in dotted.split("."):
        current = getattr(current, part, None)
        if not isinstance(current, nn.Module):
            return None
    return current


def set_attribute(module: nn.Module, dotted: str, value: object) -> None:
    """Set ``module.<dotted>`` (a dotted attribute path) to ``value``.

    Raises:
        AttributeError: An intermediate object on the path does not exist.
    """
    *path, name = dotted.split(".")
    target: Any = module
    for i, part in enumerate(path):
        if not hasattr(target, part):
            raise AttributeError(
                f"{type(module).__name__} has no attribute {'.'.join(path[: i + 1])!r} "
                f"(attribute_replacement {dotted!r})"
            )
        target = getattr(target, part)
    setattr(target, name, value)


def _matches(module: nn.Module, key: type[nn.Module] | str) -> bool:
    if isinstance(key, str):
        return type(module).__name__ == key
    return isinstance(module, key)


def _instances(model: nn.Module, key: type[nn.Module] | str) -> Iterator[tuple[str, nn.Module]]:
    return ((n, m) for n, m in list(model.named_modules()) if _matches(m, key))


def _param_owners(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return owners


def _tied_groups(model: nn.Module) -> list[tuple[str, ...]]:
    return [tuple(names) for names in _param_owners(model).values() if len(names) > 1]


def _check_parameters(
    before: set[str], tied_before: list[tuple[str, ...]], model: nn.Module
) -> None:
    after = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    lost, new = sorted(before - after), sorted(after - before)
    if lost or new:
        raise RuntimeError(
            "sharding changed the model's parameter names (state_dict keys must stay Hugging "
            f"Face's): lost {lost[:10]}, new {new[:10]}; check the policy's replacements"
        )
    params = dict(model.named_parameters(remove_duplicate=False))
    for names in tied_before:
        if len({id(params[n]) for n in names}) != 1:
            raise RuntimeError(
                f"sharding untied the parameters {list(names)}: they were one Parameter before; "
                "replace the embedding and the LM head together (the head reuses the sharded "
                "embedding weight) or neither"
            )


def _replace(
    root: nn.Module,
    instance_path: str,
    instance: nn.Module,
    desc: SubModuleReplacementDescription,
    group: Any,
    summary: ShardSummary,
) -> None:
    native = get_submodule(instance, desc.suffix)
    if native is None:
        if desc.ignore_if_not_exist:
            return
        raise ValueError(
            f"{type(instance).__name__} at {instance_path or '<root>'!r} has no submodule "
            f"{desc.suffix!r} to replace with {desc.target_module.__name__}; fix the policy "
            "or set ignore_if_not_exist=True"
        )
    new = desc.target_module.from_native_module(native, group, **desc.kwargs)
    if new is not native:
        parent_path, _, name = desc.suffix.rpartition(".")
        parent = get_submodule(instance, parent_path)
        assert parent is not None
        setattr(parent, name, new)
    summary.replaced[_join(instance_path, desc.suffix)] = type(new).__name__


def apply_module_policy(
    model: nn.Module, policy_map: PolicyMap, process_group: ProcessGroup | None
) -> ShardSummary:
    """Apply ``policy_map`` to ``model`` in place and check the parameters afterwards.

    Args:
        model: The model to shard.
        policy_map: ``Policy.module_policy()``'s result.
        process_group: The tensor-parallel group handed to the parallel layers.

    Returns:
        A :class:`ShardSummary`.

    Raises:
        ValueError: A description names a submodule that does not exist.
        RuntimeError: Parameters were lost, added or untied by the replacements.
    """
    from colossal.shardformer.layer import enter_tp_region

    names_before = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied_before = _tied_groups(model)
    summary = ShardSummary()
    jobs: list[tuple[str, nn.Module, ModulePolicyDescription]] = []
    for key, desc in policy_map.items():
        for path, instance in _instances(model, key):
            jobs.append((path, instance, desc))

    for path, instance, desc in jobs:
        for attr, value in desc.attribute_replacement.items():
            set_attribute(instance, attr, value)
            summary.attributes.append(_join(path, attr))

    # Embeddings first: a head tied to one then reuses the sharded weight.
    replacements = [
        (path, instance, sub)
        for path, instance, desc in jobs
        for sub in desc.sub_module_replacement
    ]
    replacements.sort(
        key=lambda job: not isinstance(get_submodule(job[1], job[2].suffix), nn.Embedding)
    )
    for path, instance, sub in replacements:
        _replace(model, path, instance, sub, process_group, summary)

    for path, instance, desc in jobs:
        for suffix in desc.tp_region_inputs:
            target = get_submodule(instance, suffix)
            if target is None:
                raise ValueError(
                    f"{type(instance).__name__} at {path or '<root>'!r} has no submodule "
                    f"{suffix!r} listed in tp_region_inputs; fix the policy"
                )
            enter_tp_region(target, process_group)
            summary.tp_regions.append(_join(path, suffix))

    _check_parameters(names_before, tied_before, model)
    summary.sharded_params = [n for n, p in model.named_parameters() if shard_spec(p) is not None]
    return summary
