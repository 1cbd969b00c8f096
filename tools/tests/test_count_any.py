"""Tests of tools/count_any.py on a small synthetic source tree and on the real repository."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[1]
REPO = TOOLS.parent
SCRIPT = TOOLS / "count_any.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("count_any", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


count_any = _load()

CORE = "packages/colossal-core/src/colossal/core"
# Each counted occurrence is marked by a trailing "# +N" comment on its line (checked below).
TREE: dict[str, str] = {
    f"{CORE}/__init__.py": """
        from typing import Any

        def public(x: Any, y: int) -> dict[str, Any]:  # +2
            def nested(z: Any) -> Any:
                return z
            return {}

        def forwards(*args: Any, **kwargs: Any) -> None:
            pass

        def keyword_only(*, flag: Any = None) -> None:  # +1
            pass

        def _private(x: Any) -> Any:
            return x
    """,
    f"{CORE}/api.py": """
        import typing
        from typing import Any, TypeAlias

        Batch = Any
        Tree: TypeAlias = dict[str, Any]

        class Public:
            def __init__(self, value: Any) -> None:  # +1
                self.value = value

            def __call__(self, *args: Any, **kwargs: Any) -> "Any":  # +1
                return None

            def method(self, x: typing.Any, /) -> Batch:  # +2
                return x

            def _helper(self, x: Any) -> Any:
                return x

            class Inner:
                def get(self) -> Tree:  # +1
                    return {}

        class _Hidden:
            def method(self, x: Any) -> Any:
                return x

        if typing.TYPE_CHECKING:
            def typed(x: "list[Any]") -> None:  # +1
                pass
    """,
    f"{CORE}/user.py": """
        from .api import Batch as B, Tree
        from colossal.core.api import Tree as T

        def use(a: B, b: Tree, c: T) -> None:  # +3
            pass
    """,
    f"{CORE}/_impl.py": """
        from typing import Any

        def helper(x: Any) -> Any:
            return x
    """,
    f"{CORE}/_private_pkg/mod.py": """
        from typing import Any

        def helper(x: Any) -> Any:
            return x
    """,
    "packages/colossal-zero/src/colossal/zero/__init__.py": """
        def clean(x: int) -> int:
            return x
    """,
}
EXPECTED_CORE = 12


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in TREE.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return tmp_path


def _marked_lines(tree: Path) -> dict[tuple[str, int], int]:
    """``(path, line) -> N`` for each ``# +N`` comment in the synthetic tree."""
    marks: dict[tuple[str, int], int] = {}
    for rel in TREE:
        lines = (tree / rel).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, start=1):
            if "# +" in line:
                marks[(rel, number)] = int(line.rsplit("# +", 1)[1])
    return marks


def test_counts_exactly_the_marked_annotations(tree: Path) -> None:
    found = count_any.count(tree)
    by_line: dict[tuple[str, int], int] = {}
    for o in found:
        by_line[(o.path, o.line)] = by_line.get((o.path, o.line), 0) + 1
    assert by_line == _marked_lines(tree)
    assert sum(by_line.values()) == EXPECTED_CORE


def test_per_distribution_lists_clean_packages(tree: Path) -> None:
    found = count_any.count(tree)
    totals = count_any.per_distribution(tree, found)
    assert totals == {"colossal-core": EXPECTED_CORE, "colossal-zero": 0}


def test_names_and_aliases(tree: Path) -> None:
    found = count_any.count(tree)
    names = {(o.name, o.alias) for o in found}
    assert ("Public.method", "Batch") in names
    assert ("Public.Inner.get", "Tree") in names
    assert ("use", "Batch") in names
    assert ("use", "Tree") in names
    assert {o.name for o in found} == {
        "public",
        "keyword_only",
        "Public.__init__",
        "Public.__call__",
        "Public.method",
        "Public.Inner.get",
        "typed",
        "use",
    }
    assert not any("_impl" in o.path or "_private_pkg" in o.path for o in found)


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_cli_max_and_list(tree: Path) -> None:
    held = _run(tree, "--max", str(EXPECTED_CORE))
    assert held.returncode == 0, held.stderr
    assert held.stdout.splitlines()[-3:] == [
        f"colossal-core: {EXPECTED_CORE}",
        "colossal-zero: 0",
        f"total: {EXPECTED_CORE} Any in the signatures of 8 public functions",
    ]
    exceeded = _run(tree, "--max", str(EXPECTED_CORE - 1))
    assert exceeded.returncode == 1
    assert "exceeds --max" in exceeded.stderr
    listed = _run(tree, "--list").stdout.splitlines()
    assert f"{CORE}/user.py:4 use (via Batch)" in listed
    assert f"{CORE}/__init__.py:3 public" in listed
    assert len([line for line in listed if line.startswith("packages/")]) == EXPECTED_CORE


def test_usage_error_without_packages(tmp_path: Path) -> None:
    assert _run(tmp_path).returncode == 2


def test_real_repository_runs() -> None:
    result = _run(REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("total: ")
