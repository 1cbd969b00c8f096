"""Every row of the name table imports, and serves Colossal's own objects (no copies)."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import colossalai
import pytest
from colossalai._alias import AliasModule
from colossalai._entries import Missing, Served
from colossalai._messages import NotServedAttributeError, NotServedError
from colossalai._table import BOOSTER_ERA, CONFIG_ERA, OTHER, TABLE, TOP_LEVEL

SERVED = sorted(p for p, row in TABLE.items() if isinstance(row, Served))
NAMES = sorted(
    [(p, n) for p in SERVED for n in TABLE[p].names]  # type: ignore[union-attr]
    + [("colossalai", n) for n in TOP_LEVEL.names]
)


def _import_or_skip(path: str) -> ModuleType:
    """Import a served path; a target that is not built yet skips, naming it."""
    try:
        return importlib.import_module(path)
    except NotServedError as exc:
        if "not built yet" not in str(exc):
            raise
        pytest.skip(f"not built yet: {exc}")


@pytest.mark.parametrize("path", SERVED)
def test_every_served_row_imports(path: str) -> None:
    module = _import_or_skip(path)
    row = TABLE[path]
    assert isinstance(module, AliasModule) and sys.modules[path] is module
    assert module.__compat_row__ is row
    if row.target is not None and module.__compat_target__ is not None:
        assert module.__compat_target__ is importlib.import_module(row.target)
    assert module.__path__ == []  # a package, so its children import


@pytest.mark.parametrize(("path", "name"), NAMES, ids=[f"{p}:{n}" for p, n in NAMES])
def test_every_named_object_is_ours(path: str, name: str) -> None:
    module = _import_or_skip(path)
    row = TOP_LEVEL if path == "colossalai" else TABLE[path]
    our_module, _, attr = row.names[name].partition(":")
    try:
        ours = getattr(importlib.import_module(our_module), attr)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"not built yet: {row.names[name]} ({exc})")
    assert getattr(module, name) is ours
    scope: dict[str, object] = {}
    exec(f"from {path} import {name} as got", scope)
    assert scope["got"] is ours


@pytest.mark.parametrize("path", sorted(p for p, r in TABLE.items() if isinstance(r, Missing)))
def test_missing_rows_raise_their_hint(path: str) -> None:
    row = TABLE[path]
    assert isinstance(row, Missing)
    with pytest.raises(NotServedError) as info:
        importlib.import_module(path)
    assert row.hint in str(info.value) and info.value.name == path


IDENTICAL = [
    ("colossalai.booster", "Booster", "colossal.booster:Booster"),
    ("colossalai.booster.plugin", "TorchDDPPlugin", "colossal.booster.plugin:TorchDDPPlugin"),
    ("colossalai.booster.plugin", "GeminiPlugin", "colossal.booster.plugin:GeminiPlugin"),
    (
        "colossalai.booster.mixed_precision",
        "FP16TorchMixedPrecision",
        "colossal.booster:FP16TorchMixedPrecision",
    ),
    ("colossalai.cluster", "DistCoordinator", "colossal.core:DistCoordinator"),
    ("colossalai.cluster", "ProcessGroupMesh", "colossal.core:ProcessGroupMesh"),
    ("colossalai.accelerator", "get_accelerator", "colossal.core:get_accelerator"),
    ("colossalai.logging", "get_dist_logger", "colossal.core:get_dist_logger"),
    ("colossalai.testing", "free_port", "colossal.core.testing:free_port"),
    ("colossalai.lazy", "LazyInitContext", "colossal.lazy:LazyInitContext"),
    ("colossalai.nn.optimizer", "HybridAdam", "colossal.kernels:HybridAdam"),
    ("colossalai.nn.optimizer", "CPUAdam", "colossal.kernels:CPUAdam"),
    ("colossalai.nn.lr_scheduler", "LinearWarmupLR", "colossal.nn.lr_scheduler:LinearWarmupLR"),
    ("colossalai.nn", "CosineAnnealingLR", "colossal.nn.lr_scheduler:CosineAnnealingLR"),
    ("colossalai.nn", "HybridAdam", "colossal.kernels:HybridAdam"),
    ("colossalai.zero", "LowLevelZeroOptimizer", "colossal.zero:LowLevelZeroOptimizer"),
    ("colossalai.zero.low_level", "LowLevelZeroOptimizer", "colossal.zero:LowLevelZeroOptimizer"),
    ("colossalai.zero", "GeminiDDP", "colossal.legacy.zero:GeminiDDP"),
    ("colossalai.zero.gemini", "GeminiDDP", "colossal.gemini:GeminiDDP"),
    ("colossalai.pipeline", "PipelineStageManager", "colossal.pipeline:PipelineStageManager"),
    ("colossalai.pipeline", "PipelinableContext", "colossal.legacy.pipeline:PipelinableContext"),
    ("colossalai.shardformer", "ShardFormer", "colossal.shardformer:ShardFormer"),
    ("colossalai.shardformer.layer", "Linear1D_Col", "colossal.shardformer:Linear1D_Col"),
    ("colossalai.core", "global_context", "colossal.legacy.core:global_context"),
    ("colossalai.context", "ParallelMode", "colossal.legacy.context:ParallelMode"),
    ("colossalai.context.parallel_mode", "ParallelMode", "colossal.legacy.context:ParallelMode"),
    ("colossalai.context.config", "Config", "colossal.legacy:Config"),
    ("colossalai.legacy.core", "gpc", "colossal.legacy.core:gpc"),
    ("colossalai.legacy.context", "ParallelMode", "colossal.legacy.context:ParallelMode"),
    ("colossalai.registry", "GRADIENT_HANDLER", "colossal.legacy.registry:GRADIENT_HANDLER"),
    ("colossalai.constants", "NUM_PARTITIONS", "colossal.legacy.constants:NUM_PARTITIONS"),
    ("colossalai.builder", "build_pipeline_model", "colossal.legacy.builder:build_pipeline_model"),
    ("colossalai.amp", "AMP_TYPE", "colossal.legacy.amp:AMP_TYPE"),
    ("colossalai.amp.amp_type", "AMP_TYPE", "colossal.legacy.amp:AMP_TYPE"),
    ("colossalai.engine", "Engine", "colossal.legacy.engine:Engine"),
    ("colossalai", "get_default_parser", "colossal.legacy:get_default_parser"),
]


@pytest.mark.parametrize(
    ("path", "name", "ours"), IDENTICAL, ids=[f"{p}:{n}" for p, n, _ in IDENTICAL]
)
def test_objects_are_identical(path: str, name: str, ours: str) -> None:
    module_name, _, attr = ours.partition(":")
    expected = getattr(importlib.import_module(module_name), attr)
    assert getattr(_import_or_skip(path), name) is expected


def test_import_forms_of_the_seeds() -> None:
    import colossalai.booster.plugin
    from colossalai.context.parallel_mode import ParallelMode
    from colossalai.core import global_context as gpc
    from colossalai.nn.optimizer import HybridAdam

    import colossal.booster
    import colossal.kernels
    from colossal.legacy.context import ParallelMode as OurMode
    from colossal.legacy.context import global_context

    assert colossalai.booster.Booster is colossal.booster.Booster
    assert colossalai.booster.plugin.TorchDDPPlugin is colossal.booster.TorchDDPPlugin
    assert gpc is global_context
    assert ParallelMode is OurMode
    assert HybridAdam is colossal.kernels.HybridAdam
    assert colossalai.launch.__module__ == "colossalai._launch"
    assert isinstance(colossalai.__version__, str)


def test_nothing_is_copied_and_our_modules_stay_untouched() -> None:
    import colossalai.zero.gemini
    import colossalai.zero.low_level  # noqa: F401 - imported for the side effect checked below

    import colossal.legacy.zero

    # the children were set on the alias modules, not on ours
    assert "low_level" not in vars(colossal.legacy.zero)
    assert isinstance(colossalai.zero.gemini, AliasModule)
    # every colossalai.* module is an alias or one of the compat package's own files
    for name, module in list(sys.modules.items()):
        if name.startswith("colossalai.") and not name.split(".")[1].startswith("_"):
            assert isinstance(module, AliasModule), name
            assert getattr(module, "__file__", None) is None, name
    # and no Colossal module was executed a second time under a ColossalAI name
    found = {vars(m).get("Booster") for m in list(sys.modules.values()) if hasattr(m, "__dict__")}
    assert found - {None} == {colossal.booster.Booster}


def test_star_import_gives_the_public_names() -> None:
    scope: dict[str, object] = {}
    exec("from colossalai.booster.plugin import *", scope)
    import colossal.booster.plugin

    assert set(colossal.booster.plugin.__all__) <= set(scope)
    exec("from colossalai.testing import *", scope)
    # ColossalAI's spawn (no group launched first) is served by our spawn_with_port
    assert "free_port" in scope and scope["spawn"] is colossal.core.testing.spawn_with_port
    assert "Booster" in dir(colossalai.booster)


def test_rows_are_consistent() -> None:
    """Config-era rows are also served under colossalai.legacy; every path is colossalai's."""
    for path in CONFIG_ERA:
        assert TABLE[path] is TABLE["colossalai.legacy." + path.removeprefix("colossalai.")]
    for path in (*BOOSTER_ERA, *CONFIG_ERA, *OTHER):
        assert path.startswith("colossalai.") and not path.split(".")[1].startswith("_"), path
    for path, row in TABLE.items():
        if isinstance(row, Served):
            for child in row.include:
                assert f"{path}.{child}" in TABLE or path.startswith("colossalai.legacy."), path


def test_hasattr_and_getattr_default_behave() -> None:
    import colossalai.booster
    import colossalai.zero

    assert not hasattr(colossalai.booster, "Boster")
    assert getattr(colossalai.zero, "ColoInitContext", None) is None
    with pytest.raises(NotServedAttributeError):
        _ = colossalai.booster.Boster
