"""Tests of tools/check_layering.py on small synthetic repositories and on the real one."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[1]
REPO = TOOLS.parent
SCRIPT = TOOLS / "check_layering.py"


def _load_checker() -> ModuleType:
    if str(TOOLS) not in sys.path:  # its sibling modules, as when it runs as a script
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location("check_layering", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


checker = _load_checker()

# A clean miniature of the monorepo: every package imports only what DESIGN.md allows.
CLEAN_TREE: dict[str, str] = {
    "packages/colossal-core/src/colossal/core/__init__.py": """
        from colossal.core.__about__ import __version__
        from .mesh import ProcessGroupMesh
        from . import _impl
    """,
    "packages/colossal-core/src/colossal/core/__about__.py": '__version__ = "0.1.0"\n',
    "packages/colossal-core/src/colossal/core/mesh.py": "class ProcessGroupMesh: ...\n",
    "packages/colossal-core/src/colossal/core/_impl.py": "X = 1\n",
    # a public subpackage (its own __all__) with one re-exported and one internal module
    "packages/colossal-core/src/colossal/core/comm/__init__.py": """
        from colossal.core.comm import shm
        from .ops import all_reduce

        __all__ = ["all_reduce"]
    """,
    "packages/colossal-core/src/colossal/core/comm/ops.py": "def all_reduce(): ...\n",
    "packages/colossal-core/src/colossal/core/comm/shm.py": "def reduce_scatter(): ...\n",
    "packages/colossal-core/tests/test_core.py": """
        import torch
        from colossal.core import ProcessGroupMesh
        from colossal.core._impl import X
        from colossal.core.mesh import ProcessGroupMesh
        from colossal.core.comm.ops import all_reduce
    """,
    "packages/colossal-kernels/src/colossal/kernels/__init__.py": """
        from colossal.core import ProcessGroupMesh
        from colossal.core.__about__ import __version__ as core_version
    """,
    "packages/colossal-kernels/src/colossal/kernels/_impl.py": "Y = 1\n",
    "packages/colossal-kernels/src/colossal/kernels/comm_users.py": """
        from colossal.core.comm import all_reduce, shm
        from colossal.core.comm.shm import reduce_scatter
        import colossal.core.comm
    """,
    "packages/colossal-zero/src/colossal/zero/__init__.py": """
        import colossal.core
        from colossal import core
        from ._impl import LowLevelZeroOptimizer
    """,
    "packages/colossal-zero/src/colossal/zero/_impl.py": "class LowLevelZeroOptimizer: ...\n",
    "packages/colossal-zero/src/colossal/zero/sub/__init__.py": "from .. import _impl\n",
    # the normal package layout: __init__ imports a submodule that imports its siblings
    "packages/colossal-zero/src/colossal/zero/sub/a.py": """
        from colossal.zero.sub import b
        from .c import C
    """,
    "packages/colossal-zero/src/colossal/zero/sub/b.py": "from . import c\n",
    "packages/colossal-zero/src/colossal/zero/sub/c.py": """
        from typing import TYPE_CHECKING

        C = 1
        if TYPE_CHECKING:
            from .a import b

        def f():
            from .a import b
    """,
    "packages/colossal-zero/tests/test_zero.py": """
        from colossal.core import ProcessGroupMesh
        from colossal.zero._impl import LowLevelZeroOptimizer
    """,
    "packages/colossal-pipeline/src/colossal/pipeline/__init__.py": "import colossal.core.comm\n",
    "packages/colossal-gemini/src/colossal/gemini/__init__.py": """
        from colossal.core import ProcessGroupMesh
        from colossal.kernels import something
    """,
    "packages/colossal-shardformer/src/colossal/shardformer/__init__.py": """
        import transformers
        from colossal.kernels import something
    """,
    "packages/colossal/src/colossal/booster/__init__.py": """
        from colossal.checkpoint_io import CheckpointIO
        from colossal.lazy._impl import LazyInit
        from colossal.zero import LowLevelZeroOptimizer
        from colossal.pipeline import Schedule

        def gemini_plugin():
            from colossal.gemini import GeminiDDP
            from colossal.shardformer import ShardFormer
    """,
    "packages/colossal/src/colossal/checkpoint_io/__init__.py": "from ..lazy import x\n",
    "packages/colossal/src/colossal/lazy/__init__.py": "",
    "packages/colossal/src/colossal/lazy/_impl.py": "class LazyInit: ...\n",
    "packages/colossal/tests/test_booster.py": """
        from colossal.booster import Booster
        from colossal.gemini import GeminiDDP
    """,
    "packages/colossal-cli/src/colossal/cli/__init__.py": """
        from __future__ import annotations

        import importlib
        from typing import TYPE_CHECKING

        from colossal.core import ProcessGroupMesh

        if TYPE_CHECKING:
            from colossal.booster import Booster


        def benchmark() -> None:
            try:
                from colossal.booster import Booster
            except ImportError:
                raise SystemExit("pip install colossal") from None


        class Runner:
            def run(self) -> None:
                importlib.import_module("colossal.checkpoint_io")
    """,
    "packages/colossal-shardformer/tests/test_pipeline_stages.py": """
        from colossal.pipeline import PipelineStageManager
    """,
    "packages/colossal-cli/tests/test_cli.py": """
        import pytest
        from colossal.cli import benchmark

        def test_benchmark():
            pytest.importorskip("colossal.booster")
    """,
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")


def _run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    _write(tmp_path, CLEAN_TREE)
    return tmp_path


def test_clean_tree_passes(repo: Path) -> None:
    result = _run(repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("check_layering: OK")
    assert len(result.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("rel", "text", "rule", "line"),
    [
        pytest.param(
            "packages/colossal-core/src/colossal/core/bad.py",
            "import os\nfrom colossal.zero import LowLevelZeroOptimizer\n",
            "upward",
            2,
            id="core-imports-zero",
        ),
        pytest.param(
            "packages/colossal-core/src/colossal/core/bad.py",
            "from colossal import zero\n",
            "upward",
            1,
            id="core-imports-zero-from-namespace",
        ),
        pytest.param(
            "packages/colossal-core/src/colossal/core/sub/bad.py",
            "from ...zero import LowLevelZeroOptimizer\n",
            "upward",
            1,
            id="core-imports-zero-relative",
        ),
        pytest.param(
            "packages/colossal-core/src/colossal/core/bad.py",
            "import importlib\nimportlib.import_module('colossal.zero')\n",
            "upward",
            2,
            id="core-imports-zero-dynamically",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/zero/bad.py",
            "import colossal.pipeline.schedule\n",
            "same-level",
            1,
            id="zero-imports-pipeline",
        ),
        pytest.param(
            "packages/colossal-gemini/src/colossal/gemini/bad.py",
            "def f():\n    from colossal.shardformer import ShardFormer\n",
            "same-level",
            2,
            id="gemini-imports-shardformer-lazily",
        ),
        pytest.param(
            "packages/colossal-gemini/src/colossal/gemini/bad.py",
            "from colossal.zero import LowLevelZeroOptimizer\n",
            "not-allowed",
            1,
            id="gemini-imports-zero",
        ),
        pytest.param(
            "packages/colossal-shardformer/src/colossal/shardformer/bad.py",
            "from colossal.pipeline import PipelineStageManager\n",
            "not-allowed",
            1,
            id="shardformer-source-imports-pipeline",  # only its tests may
        ),
        pytest.param(
            "packages/colossal-shardformer/src/colossal/shardformer/bad.py",
            "from colossal.zero._private import helper\n",
            "private",
            1,
            id="shardformer-imports-zero-private",
        ),
        pytest.param(
            "packages/colossal-shardformer/src/colossal/shardformer/bad.py",
            "from colossal.kernels import _impl\n",
            "private",
            1,
            id="shardformer-imports-kernels-private-name",
        ),
        pytest.param(
            "packages/colossal-shardformer/src/colossal/shardformer/bad.py",
            "from colossal.core.mesh import ProcessGroupMesh\n",
            "deep-import",
            1,
            id="deep-import-of-unexported-module",
        ),
        pytest.param(
            "packages/colossal-shardformer/src/colossal/shardformer/bad.py",
            "import colossal.core.mesh as mesh\n",
            "deep-import",
            1,
            id="deep-import-of-module-itself",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/zero/bad.py",
            "from colossal.core.comm.ops import all_reduce\n",
            "deep-import",
            1,
            id="deep-import-below-public-subpackage",
        ),
        pytest.param(
            "packages/colossal-kernels/tests/test_bad.py",
            "import pytest\nfrom colossal.core.comm import ops\n",
            "deep-import",
            2,
            id="deep-import-from-tests",
        ),
        pytest.param(
            "packages/colossal-cli/src/colossal/cli/bad.py",
            "def f():\n    import importlib\n    importlib.import_module('colossal.core.mesh')\n",
            "deep-import",
            3,
            id="deep-import-lazy-and-dynamic",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/__init__.py",
            "",
            "namespace-init",
            1,
            id="namespace-init",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/helpers.py",
            "",
            "namespace-module",
            1,
            id="module-in-namespace",
        ),
        pytest.param(
            "packages/colossal-cli/src/colossal/cli/bad.py",
            "from colossal.booster import Booster\n",
            "lazy-only",
            1,
            id="cli-imports-booster-at-module-level",
        ),
        pytest.param(
            "packages/colossal-cli/src/colossal/cli/bad.py",
            "import colossal.lazy\n",
            "lazy-only",
            1,
            id="cli-imports-lazy-at-module-level",
        ),
        pytest.param(
            "packages/colossal-cli/src/colossal/cli/bad.py",
            "class C:\n    from colossal.checkpoint_io import CheckpointIO\n",
            "lazy-only",
            2,
            id="cli-imports-in-class-body",
        ),
        pytest.param(
            "packages/colossal-core/tests/test_bad.py",
            "from colossal.zero import LowLevelZeroOptimizer\n",
            "upward",
            1,
            id="core-tests-import-zero",
        ),
        pytest.param(
            "packages/colossal-kernels/tests/test_bad.py",
            "from colossal.core._impl import X\n",
            "private",
            1,
            id="kernels-tests-import-core-private",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/zero/bad.py",
            "from colossal.optim import X\n",
            "unknown-package",
            1,
            id="import-of-unknown-package",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/zero2/__init__.py",
            "",
            "unknown-package",
            1,
            id="package-not-in-table",
        ),
        pytest.param(
            "packages/colossal-zero/src/colossal/pipeline/__init__.py",
            "",
            "wrong-distribution",
            1,
            id="package-in-wrong-distribution",
        ),
        pytest.param(
            "packages/colossal-core/src/colossal/core/bad.py",
            "from .... import x\n",
            "relative-import",
            1,
            id="relative-import-above-namespace",
        ),
        pytest.param(
            "packages/colossal-core/src/colossal/core/bad.py",
            "def f(:\n",
            "syntax",
            1,
            id="syntax-error",
        ),
        pytest.param(
            "packages/colossal/src/colossal/booster/bad.py",
            "import os\nimport colossalai\n",
            "upward",
            2,
            id="meta-imports-compat",  # colossalai-compat is opt-in: nothing depends on it
        ),
        pytest.param(
            "packages/colossal-core/tests/test_bad.py",
            "def test():\n    from colossalai.booster import Booster\n",
            "upward",
            2,
            id="core-tests-import-compat-lazily",
        ),
        pytest.param(
            "packages/colossalai-compat/src/colossalai/bad.py",
            "from colossal.cli import main\n",
            "not-allowed",
            1,
            id="compat-imports-cli",
        ),
        pytest.param(
            "packages/colossalai-compat/src/colossalai/bad.py",
            "from colossal.zero._impl import LowLevelZeroOptimizer\n",
            "private",
            1,
            id="compat-imports-zero-private",
        ),
        pytest.param(
            "packages/colossal-core/src/colossalai/__init__.py",
            "",
            "wrong-distribution",
            1,
            id="compat-package-in-core",
        ),
        pytest.param(
            "packages/colossal-zero/src/zero_extra/__init__.py",
            "",
            "unknown-package",
            1,
            id="unknown-top-level-package",
        ),
    ],
)
def test_violation_fails_naming_file(repo: Path, rel: str, text: str, rule: str, line: int) -> None:
    _write(repo, {rel: text})
    result = _run(repo)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines, result.stderr
    assert any(entry.startswith(f"{rel}:{line}: [{rule}] ") for entry in lines), lines
    assert all(entry.startswith(rel) for entry in lines), lines  # nothing else is flagged
    assert "violation" in result.stderr


@pytest.mark.parametrize(
    "text",
    [
        "def bench():\n    from colossal.booster import Booster\n",
        "def bench():\n    import colossal.booster.plugin\n",
        "async def bench():\n    import importlib\n    importlib.import_module('colossal.lazy')\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from colossal.booster import B\n",
        "from colossal.core.__about__ import __version__\n",
    ],
    ids=["from-import", "import", "dynamic", "type-checking", "core-about"],
)
def test_cli_lazy_imports_of_meta_package_pass(repo: Path, text: str) -> None:
    _write(repo, {"packages/colossal-cli/src/colossal/cli/lazy.py": text})
    result = _run(repo)
    assert result.returncode == 0, result.stdout + result.stderr


def test_each_violation_is_one_line(repo: Path) -> None:
    _write(
        repo,
        {
            "packages/colossal-zero/src/colossal/zero/bad.py": (
                "import colossal.pipeline\nimport colossal.gemini\nfrom colossal.kernels import x\n"
            ),
        },
    )
    violations, _, _ = checker.check(repo)
    assert [(v.line, v.rule) for v in violations] == [
        (1, "same-level"),
        (2, "upward"),
        (3, "same-level"),
    ]
    assert all("colossal.zero must not import" in v.message for v in violations)


def test_missing_packages_dir_is_a_usage_error(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.returncode == 2
    assert "no packages/ directory" in result.stderr


def test_table_matches_design() -> None:
    layers = checker.LAYERS
    assert layers["core"].allowed == frozenset()
    assert {p for p, lay in layers.items() if lay.dist == "colossal"} == {
        "booster",
        "checkpoint_io",
        "lazy",
        "nn",
    }
    assert layers["cli"].allowed == {"core"}
    assert layers["cli"].lazy_only == {"booster", "checkpoint_io", "lazy", "nn", "kernels"}
    # legacy: above the meta-package ("all of the above", the CLI aside)
    meta = {"booster", "checkpoint_io", "lazy", "nn"}
    assert layers["legacy"].dist == "colossal-legacy"
    assert layers["legacy"].allowed == set(layers) - {"legacy", "cli", "integrations"}
    assert layers["legacy"].level > max(layers[p].level for p in meta)
    # colossalai-compat: the top-level `colossalai`, above legacy
    compat = checker.TOP_LEVEL["colossalai"]
    assert compat.dist == "colossalai-compat"
    assert compat.allowed == set(layers) - {"cli", "integrations"}
    # colossal-integrations (trainers): the meta-package and below, never legacy or the CLI
    assert layers["integrations"].allowed == set(layers) - {"legacy", "cli", "integrations"}
    assert compat.level > layers["legacy"].level
    every = {**layers, **checker.TOP_LEVEL}
    for name, layer in every.items():
        for dep in layer.allowed:
            assert every[dep].level < layer.level, (name, dep)


def test_compat_top_level_package_is_checked(repo: Path) -> None:
    files_before = checker.check(repo)[1]
    _write(
        repo,
        {
            "packages/colossalai-compat/src/colossalai/__init__.py": """
                import importlib
                from colossal.booster import Booster
                from colossal.core import ProcessGroupMesh
                from . import _table
                from colossalai._table import TABLE

                importlib.import_module("colossal.legacy")
            """,
            "packages/colossalai-compat/src/colossalai/_table.py": "TABLE = {}\n",
            "packages/colossalai-compat/tests/test_compat.py": """
                import colossalai
                from colossalai._table import TABLE
                from colossal.zero import LowLevelZeroOptimizer
            """,
        },
    )
    violations, files, _ = checker.check(repo)
    assert violations == []
    assert files == files_before + 3  # the compat package's two files and its test
    _write(repo, {"packages/colossalai-compat/src/colossalai/bad.py": "import colossal.cli\n"})
    [violation] = checker.check(repo)[0]
    assert violation.rule == "not-allowed"
    assert violation.message.startswith("colossalai must not import colossal.cli")


def test_real_repository_is_clean() -> None:
    result = _run(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deep_import_names_the_public_package(repo: Path) -> None:
    _write(
        repo,
        {
            "packages/colossal-zero/src/colossal/zero/bad.py": (
                "from colossal.core.comm.ops import all_reduce\n"
            )
        },
    )
    [violation] = checker.check(repo)[0]
    assert violation.rule == "deep-import"
    assert "reaches into colossal.core.comm.ops, which colossal.core.comm does not export" in (
        violation.message
    )


def test_allowlisted_deep_import_is_not_reported(repo: Path, monkeypatch) -> None:
    rel = "packages/colossal-zero/src/colossal/zero/bad.py"
    _write(repo, {rel: "from colossal.core.mesh import ProcessGroupMesh\n"})
    assert [v.rule for v in checker.check(repo)[0]] == ["deep-import"]
    monkeypatch.setitem(checker.ALLOWED_DEEP_IMPORTS, (rel, "colossal.core.mesh"), "reason")
    assert checker.check(repo)[0] == []


ZERO = "packages/colossal-zero/src/colossal/zero"


@pytest.mark.parametrize(
    ("files", "first", "line", "cycle"),
    [
        pytest.param(
            {
                "a.py": "import os\nfrom colossal.zero.b import B\nA = 1\n",
                "b.py": "from .a import A\n",
            },
            "a.py",
            2,
            "colossal.zero.a (line 2) -> colossal.zero.b (line 1) -> colossal.zero.a",
            id="two-modules",
        ),
        pytest.param(
            {
                "a.py": "from . import b\n",
                "b.py": "from . import c\n",
                "c.py": "import colossal.zero.a\n",
            },
            "a.py",
            1,
            "colossal.zero.a (line 1) -> colossal.zero.b (line 1) -> colossal.zero.c (line 1) "
            "-> colossal.zero.a",
            id="three-modules",
        ),
        pytest.param(
            # __init__ imports m, m takes a name from __init__: one of them sees the other half-done
            {
                "__init__.py": "from .m import f\nHELPER = 1\n",
                "m.py": "from colossal.zero import HELPER\n",
            },
            "__init__.py",
            1,
            "colossal.zero (line 1) -> colossal.zero.m (line 1) -> colossal.zero",
            id="name-from-own-package-init",
        ),
    ],
)
def test_import_cycle_is_reported_once(
    repo: Path, files: dict[str, str], first: str, line: int, cycle: str
) -> None:
    _write(repo, {f"{ZERO}/{name}": text for name, text in files.items()})
    result = _run(repo)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{ZERO}/{first}:{line}: [cycle] "), lines
    assert f"form a cycle: {cycle}" in lines[0], lines


@pytest.mark.parametrize(
    "b_text",
    [
        "def g():\n    from .a import A\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
        "import colossal.zero\n",  # parent package: initialised first, not an edge to a
    ],
    ids=["function", "type-checking", "parent-package"],
)
def test_lazy_or_parent_imports_make_no_cycle(repo: Path, b_text: str) -> None:
    _write(repo, {f"{ZERO}/a.py": "from .b import g\nA = 1\n", f"{ZERO}/b.py": b_text})
    assert checker.check(repo)[0] == []


def test_allowlisted_cycle_is_not_reported(repo: Path, monkeypatch) -> None:
    _write(repo, {f"{ZERO}/a.py": "from . import b\n", f"{ZERO}/b.py": "from . import a\n"})
    assert [v.rule for v in checker.check(repo)[0]] == ["cycle"]
    monkeypatch.setitem(checker.ALLOWED_CYCLES, ("colossal.zero.a", "colossal.zero.b"), "why")
    assert checker.check(repo)[0] == []


def test_cycle_helpers_on_a_known_graph() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2, "a": 3}, "c": {"a": 4}, "d": {"a": 5}, "e": {"e": 6}}
    assert checker.strongly_connected(graph) == [["a", "b", "c"]]
    assert checker.shortest_cycle(graph, "a") == ["a", "b", "a"]
    assert checker.shortest_cycle(graph, "c") == ["c", "a", "b", "c"]
    assert checker.shortest_cycle(graph, "d") == []


def test_no_machine_paths_in_the_tool() -> None:
    absolute = re.compile(r"(?<![\w.:/])/(?:work|home|tmp|opt|root|usr|mnt|Users)/")
    files = [*TOOLS.glob("*.py"), *(TOOLS / "tests").glob("*.py")]
    assert SCRIPT in files
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert not absolute.search(text), f"{path.name}: {absolute.search(text)}"
