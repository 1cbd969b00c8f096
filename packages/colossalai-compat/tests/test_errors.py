"""What a ColossalAI user sees for a path or name Colossal does not serve."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import colossalai  # noqa: F401 - installs the finder
import pytest
from colossalai._entries import served
from colossalai._messages import NOT_IMPLEMENTED, NotServedAttributeError, NotServedError
from colossalai._table import TABLE


@pytest.fixture
def extra_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """Rows added to the table for one test (their alias modules are dropped afterwards)."""
    added: dict = {}
    yield added
    for path in added:
        for name in [n for n in sys.modules if n == path or n.startswith(path + ".")]:
            del sys.modules[name]


def _add(monkeypatch: pytest.MonkeyPatch, extra_rows: dict, path: str, row: object) -> None:
    monkeypatch.setitem(TABLE, path, row)
    extra_rows[path] = row


def test_unmapped_path_says_not_implemented() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        import colossalai.fx  # noqa: F401
    message = str(info.value)
    assert NOT_IMPLEMENTED in message and "issue 36" in message
    assert info.value.name == "colossalai.fx"
    assert isinstance(info.value, NotServedError)


def test_typo_in_a_path_suggests_the_row() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"did you mean colossalai\.booster\b"):
        importlib.import_module("colossalai.boostr")


@pytest.mark.parametrize(
    ("path", "equivalent"),
    [
        ("colossalai.kernel", "colossal.kernels"),
        ("colossalai.device.device_mesh", "ProcessGroupMesh"),
        ("colossalai.amp.apex_amp", "AMP_TYPE.TORCH"),
        ("colossalai.legacy.amp.apex_amp", "AMP_TYPE.NAIVE"),
    ],
)
def test_missing_path_names_our_equivalent(path: str, equivalent: str) -> None:
    with pytest.raises(ModuleNotFoundError, match="not served by colossalai-compat") as info:
        importlib.import_module(path)
    assert equivalent in str(info.value)


def test_path_under_a_tree_row_that_we_lack() -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("colossalai.booster.plugin.hybrid_parallel_plugin")
    message = str(info.value)
    assert NOT_IMPLEMENTED in message
    assert "colossalai.booster.plugin maps to colossal.booster.plugin" in message


def test_target_not_built_yet(monkeypatch: pytest.MonkeyPatch, extra_rows: dict) -> None:
    _add(monkeypatch, extra_rows, "colossalai.demo", served("colossal.legacy.no_such_module"))
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("colossalai.demo")
    assert str(info.value) == (
        "colossalai.demo maps to colossal.legacy.no_such_module, which is not built yet "
        "(watch issue 31): it is not in this installation"
    )
    assert "colossalai.demo" not in sys.modules


def test_partial_row_serves_its_children_before_its_target(
    monkeypatch: pytest.MonkeyPatch, extra_rows: dict
) -> None:
    row = served("colossal.legacy.no_such_module", partial=True, tree=True)
    _add(monkeypatch, extra_rows, "colossalai.demo", row)
    child = served(names={"Booster": "colossal.booster:Booster"})
    _add(monkeypatch, extra_rows, "colossalai.demo.child", child)
    from colossalai.demo.child import Booster

    import colossal.booster

    assert Booster is colossal.booster.Booster
    module = importlib.import_module("colossalai.demo")
    with pytest.raises(AttributeError, match="not built yet"):
        _ = module.Linear2D


def test_name_not_built_yet(monkeypatch: pytest.MonkeyPatch, extra_rows: dict) -> None:
    names = {"Lamb": "colossal.legacy.no_such_module:Lamb", "Ok": "colossal.core:launch"}
    row = served(names=names)
    _add(monkeypatch, extra_rows, "colossalai.demo", row)
    module = importlib.import_module("colossalai.demo")
    assert module.__all__ == ["Ok"]  # only what resolves now
    with pytest.raises(AttributeError, match=r"colossalai\.demo\.Lamb maps to .* not built yet"):
        _ = module.Lamb
    with pytest.raises(ImportError, match="not built yet"):
        from colossalai.demo import Lamb  # noqa: F401


def test_error_inside_an_existing_target_is_not_hidden(
    monkeypatch: pytest.MonkeyPatch, extra_rows: dict, tmp_path: Path
) -> None:
    """A real ImportError inside our module propagates as is, not as "not built yet"."""
    (tmp_path / "compat_broken_target.py").write_text("import compat_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _add(monkeypatch, extra_rows, "colossalai.demo", served("compat_broken_target"))
    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("colossalai.demo")
    assert info.value.name == "compat_no_such_dependency"
    assert not isinstance(info.value, NotServedError)
    sys.modules.pop("compat_broken_target", None)


def test_unknown_name_on_attribute_access() -> None:
    import colossalai.booster

    with pytest.raises(AttributeError) as info:
        _ = colossalai.booster.Boster
    message = str(info.value)
    assert "'colossalai.booster' (colossal.booster) has no attribute 'Boster'" in message
    assert "nearest names: Booster" in message
    assert isinstance(info.value, NotServedAttributeError)


def test_unknown_name_in_from_import_keeps_the_message() -> None:
    with pytest.raises(ImportError, match="nearest names: .*TorchDDPPlugin"):
        from colossalai.booster.plugin import TorchDDPPlugn  # noqa: F401


@pytest.mark.parametrize(
    ("statement", "text"),
    [
        ("from colossalai.accelerator import NpuAccelerator", "CUDA and CPU accelerators"),
        ("from colossalai.zero import ColoInitContext", "LazyInitContext"),
        ("from colossalai import boost", "booster.boost("),
        ("from colossalai.accelerator import set_accelerator", "COLOSSAL_ACCELERATOR"),
    ],
)
def test_hinted_names(statement: str, text: str) -> None:
    with pytest.raises(ImportError) as info:
        exec(statement, {})
    assert text in str(info.value)
    module, _, name = statement.removeprefix("from ").partition(" import ")
    assert not hasattr(importlib.import_module(module), name)  # attribute access: False


def test_include_reports_a_child_that_is_not_built(
    monkeypatch: pytest.MonkeyPatch, extra_rows: dict
) -> None:
    _add(monkeypatch, extra_rows, "colossalai.demo", served(include=("layer", "optimizer")))
    layer = served("colossal.legacy.no_such_module", partial=True)
    _add(monkeypatch, extra_rows, "colossalai.demo.layer", layer)
    optimizer = served(names={"HybridAdam": "colossal.kernels:HybridAdam"})
    _add(monkeypatch, extra_rows, "colossalai.demo.optimizer", optimizer)
    import colossalai.demo

    import colossal.kernels

    assert colossalai.demo.HybridAdam is colossal.kernels.HybridAdam
    with pytest.raises(AttributeError) as info:
        _ = colossalai.demo.Linear2D
    assert "colossalai.demo.layer maps to colossal.legacy.no_such_module" in str(info.value)
