"""Tests of tools/compat_table.py (the migration page generated from the compat name table)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1]
SCRIPT = TOOLS / "compat_table.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compat_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


compat_table = _load()


def test_every_table_row_is_on_the_page() -> None:
    """Catches: rows dropped from the page (a section forgotten, a row type not rendered)."""
    table = compat_table._load_table()
    page = compat_table.render()
    paths = [*table.BOOSTER_ERA, *table.CONFIG_ERA, *table.OTHER]
    assert len(paths) > 40
    missing = [p for p in paths if f"| `{p}` |" not in page]
    assert missing == []


def test_served_and_missing_rows_render_their_target_or_hint() -> None:
    """Catches: a served row without its Colossal module, a missing row without its hint,
    or the ``colossalai`` package left importable-by-side-effect (its finder installed)."""
    table = compat_table._load_table()
    path, target, _ = compat_table.row_cells(
        "colossalai.booster", table.BOOSTER_ERA["colossalai.booster"]
    )
    assert (path, target) == ("`colossalai.booster`", "`colossal.booster` (and its submodules)")
    _, target, notes = compat_table.row_cells("colossalai.kernel", table.OTHER["colossalai.kernel"])
    assert target == "*not served*" and "colossal.kernels" in notes
    assert "colossalai" not in sys.modules or hasattr(sys.modules["colossalai"], "launch")
