"""Check that the Colossal packages import each other only as DESIGN.md allows.

Usage::

    python tools/check_layering.py [--root DIR]

The check is static (it parses every file with :mod:`ast`, nothing is imported) and uses only
the standard library. It looks at ``packages/<dist>/src/colossal/<pkg>/**.py`` (a file belongs
to the package ``colossal.<pkg>``) and ``packages/<dist>/tests/**.py`` (tests may import what
the distribution's packages may import, under the same rules). A package shipped outside the
namespace (``packages/<dist>/src/<name>/``: colossalai-compat's top-level ``colossalai``) is
checked the same way from its ``TOP_LEVEL`` row, and importing it counts like importing any
package of the table (it sits above all of them, so nothing else may). It reports:

* ``upward`` / ``same-level`` / ``not-allowed``: an import of a sibling package the importer
  may not depend on (the ``LAYERS`` table below);
* ``lazy-only``: a module-level import of a package that may only be imported lazily, inside a
  function (``colossal.cli`` -> the meta-package);
* ``private``: an import of another distribution's private module or name (a dotted component
  starting with ``_``; dunders such as ``__about__`` and ``__version__`` are public);
* ``deep-import``: an import of another distribution's module that its package does not
  export. What counts as exported is written in ``layering_modules.py``: ``colossal.X`` and
  the submodules its ``__init__`` re-exports (``__all__`` or ``from . import m``), public
  subpackages (their ``__init__`` defines ``__all__``) and dunder modules, recursively;
* ``cycle``: a cycle of module-level imports among the modules of one distribution (lazy
  imports, inside functions or ``if TYPE_CHECKING:``, break cycles; the graph is described in
  ``layering_cycles.py``). One violation per strongly connected component, at its first
  module, naming a shortest cycle;
* ``namespace-init`` / ``namespace-module``: a file directly in the PEP 420 namespace
  ``src/colossal/`` (there must be no ``src/colossal/__init__.py`` anywhere);
* ``unknown-package`` / ``wrong-distribution``: a package missing from the table, or shipped by
  the wrong distribution; ``relative-import`` / ``syntax``: imports that cannot be resolved.

Handled import forms: ``import colossal.x.y``, ``from colossal.x import y``,
``from colossal import x``, relative imports (resolved against the file's module), and
``importlib.import_module("colossal.x")`` / ``__import__("colossal.x")`` with a literal name.
An import counts as lazy when it is inside a function body or an ``if TYPE_CHECKING:`` block.

Known deep imports and cycles that are not fixed yet are listed, each with its reason, in
``layering_allowlist.py`` (``ALLOWED_DEEP_IMPORTS``, ``ALLOWED_CYCLES``); they are not
reported. The list is meant to shrink: an entry is removed when its import is fixed.

Exit status: 0 and one ``OK`` line when clean; 1 and one line per violation
(``path:line: [rule] message``) otherwise; 2 on usage errors.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Sibling modules of this script (its directory is sys.path[0] when it runs as a script).
from layering_allowlist import ALLOWED_CYCLES, ALLOWED_DEEP_IMPORTS
from layering_cycles import shortest_cycle, strongly_connected
from layering_modules import ModuleIndex, is_dunder

NAMESPACE = "colossal"


@dataclass(frozen=True)
class Layer:
    """One row of the layering table.

    Attributes:
        dist: Distribution (pip name) that ships the package.
        level: Row group in DESIGN.md's table; imports only go to lower levels, and packages
            on the same level never import each other.
        allowed: Packages (import names under ``colossal``) it may import anywhere.
        lazy_only: Packages it may import only lazily, inside a function body.
        tests_also: Lower-level packages its tests (only) may also import: a sibling the
            distribution does not depend on but declares in its ``test`` extra, to drive it
            end to end (colossal-shardformer's pipeline stages under colossal-pipeline's
            schedules).
    """

    dist: str
    level: int
    allowed: frozenset[str] = field(default_factory=frozenset)
    lazy_only: frozenset[str] = field(default_factory=frozenset)
    tests_also: frozenset[str] = field(default_factory=frozenset)


def _layer(
    dist: str,
    level: int,
    allowed: Iterable[str] = (),
    lazy: Iterable[str] = (),
    tests_also: Iterable[str] = (),
) -> Layer:
    for pkg in tests_also:
        assert pkg not in allowed, f"{pkg} is already allowed everywhere"
    return Layer(dist, level, frozenset(allowed), frozenset(lazy), frozenset(tests_also))


# ------------------------------------------------------------------------------------------------
# THE LAYERING TABLE. Source of truth: DESIGN.md (the shared design document), section
# "Packages and layering"
# (columns "distribution", "import", "may import"). Keep the two in sync: a new package must be
# added here, or the checker reports it as an unknown package.
#
# Packages of one distribution (booster, checkpoint_io, lazy and nn all belong to "colossal") may
# import each other freely, including private modules. Third-party imports are not checked.
# ------------------------------------------------------------------------------------------------
_BELOW_META = ("core", "kernels", "zero", "pipeline", "gemini", "shardformer")
_META = ("booster", "checkpoint_io", "lazy", "nn")

LAYERS: dict[str, Layer] = {
    #  import name        distribution            level  may import            lazily only
    "core": _layer("colossal-core", 0),
    "kernels": _layer("colossal-kernels", 1, ["core"]),
    "zero": _layer("colossal-zero", 1, ["core"]),
    "pipeline": _layer("colossal-pipeline", 1, ["core"]),
    "gemini": _layer("colossal-gemini", 2, ["core", "kernels"]),
    # its run time duck-types the pipeline stage manager; its tests drive real schedules
    "shardformer": _layer("colossal-shardformer", 2, ["core", "kernels"], tests_also=["pipeline"]),
    "booster": _layer("colossal", 3, _BELOW_META),
    "checkpoint_io": _layer("colossal", 3, _BELOW_META),
    "lazy": _layer("colossal", 3, _BELOW_META),
    "nn": _layer("colossal", 3, _BELOW_META),
    # DESIGN.md: cli imports core, and the meta-package lazily; `colossal check -i` also shows
    # the kernel registry, so colossal.kernels (under the meta-package) may be imported lazily.
    "cli": _layer("colossal-cli", 4, ["core"], lazy=(*_META, "kernels")),
    # the seeds' config-era API, a front end above the meta-package ("all of the above" in
    # DESIGN.md, the CLI aside: the two never import each other)
    "legacy": _layer("colossal-legacy", 4, (*_BELOW_META, *_META)),
    # Trainer integrations (Hugging Face, Lightning): plugins and the Booster, never legacy
    "integrations": _layer("colossal-integrations", 4, (*_BELOW_META, *_META)),
}

# Top-level packages outside the `colossal` namespace: import name -> layer. colossalai-compat
# (`import colossalai`, opt-in) maps ColossalAI's paths onto every package below it; since it
# sits above all of them, no colossal package (or its tests) may import it.
TOP_LEVEL: dict[str, Layer] = {
    "colossalai": _layer("colossalai-compat", 5, (*_BELOW_META, *_META, "legacy")),
}
_ALL_LAYERS: dict[str, Layer] = {**LAYERS, **TOP_LEVEL}


def shown(pkg: str) -> str:
    """How a package of the table is written in messages (``colossal.zero``, ``colossalai``)."""
    return pkg if pkg in TOP_LEVEL else f"{NAMESPACE}.{pkg}"


def is_private(component: str) -> bool:
    """Whether a dotted name component is private (``_impl``; not dunders like ``__about__``)."""
    return component.startswith("_") and not is_dunder(component)


@dataclass(frozen=True, order=True)
class Violation:
    """One broken rule at one place."""

    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


@dataclass(frozen=True)
class ImportRef:
    """One imported dotted name found in a file."""

    line: int
    target: str  # absolute dotted name, e.g. "colossal.zero._impl" or "colossal.zero.Foo"
    text: str  # what the source says, for messages
    lazy: bool


@dataclass(frozen=True)
class Importer:
    """Who imports: a package's source file, or a distribution's test file."""

    label: str
    dist: str
    packages: frozenset[str]
    module: tuple[str, ...] | None  # dotted module of a source file, for relative imports
    is_package_init: bool = False

    @property
    def is_test(self) -> bool:
        """Whether this is a distribution's test file (those have no dotted module)."""
        return self.module is None


# -- finding imports -----------------------------------------------------------------------------


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _dynamic_import_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute):
        name = func.attr
    else:
        return None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    return None if arg.value.startswith(".") else arg.value


class _ImportCollector(ast.NodeVisitor):
    """Collects imports with their line and whether they run lazily."""

    def __init__(self, importer: Importer, path: str) -> None:
        self.importer = importer
        self.path = path
        self.refs: list[ImportRef] = []
        self.errors: list[Violation] = []
        self._lazy_depth = 0
        self._source = ""

    def _lazy(self, node: ast.AST) -> None:
        self._lazy_depth += 1
        self.generic_visit(node)
        self._lazy_depth -= 1

    visit_FunctionDef = _lazy  # noqa: N815 - ast.NodeVisitor method names
    visit_AsyncFunctionDef = _lazy  # noqa: N815
    visit_Lambda = _lazy  # noqa: N815

    def visit_If(self, node: ast.If) -> None:  # noqa: N802 - ast.NodeVisitor naming
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._lazy_depth += 1
        for stmt in node.body:
            self.visit(stmt)
        self._lazy_depth -= 1
        for stmt in node.orelse:
            self.visit(stmt)

    def _add(self, node: ast.Import | ast.ImportFrom | ast.Call, target: str) -> None:
        text = " ".join((ast.get_source_segment(self._source, node) or ast.unparse(node)).split())
        self.refs.append(ImportRef(node.lineno, target, text, self._lazy_depth > 0))

    def visit_Import(self, node: ast.Import) -> None:  # noqa: N802
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        base = self._resolve_from(node)
        if base is None:
            return
        for alias in node.names:
            self._add(node, base if alias.name == "*" else f"{base}.{alias.name}")

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        name = _dynamic_import_name(node)
        if name is not None:
            self._add(node, name)
        self.generic_visit(node)

    def _resolve_from(self, node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module or ""
        module = self.importer.module
        if module is None:  # a test file: relative imports stay inside the tests
            return None
        package = module if self.importer.is_package_init else module[:-1]
        if node.level > len(package):
            self.errors.append(
                Violation(
                    self.path,
                    node.lineno,
                    "relative-import",
                    f"`{ast.unparse(node)}` goes above the top-level namespace `{NAMESPACE}`",
                )
            )
            return None
        base = package[: len(package) - node.level + 1]
        return ".".join([*base, *([node.module] if node.module else [])])

    def collect(self, source: str) -> None:
        self._source = source
        self.visit(ast.parse(source, filename=self.path))


# -- rules ---------------------------------------------------------------------------------------


def _private_component(parts: Sequence[str]) -> str | None:
    return next((part for part in parts if is_private(part)), None)


def _describe(packages: Iterable[str]) -> str:
    names = sorted(packages)
    return ", ".join(shown(p) for p in names) if names else "no other colossal package"


def check_ref(
    importer: Importer, ref: ImportRef, path: str, index: ModuleIndex | None = None
) -> list[Violation]:
    """The violations of one import, given who imports it (and the module tree, if known)."""
    parts = ref.target.split(".")
    if parts[0] in TOP_LEVEL:
        pkg, inner = parts[0], parts[1:]
    elif parts[0] == NAMESPACE and len(parts) >= 2:
        pkg, inner = parts[1], parts[2:]
    else:
        return []
    here = (path, ref.line)
    layer = _ALL_LAYERS.get(pkg)
    if layer is None:
        return [
            Violation(
                *here,
                "unknown-package",
                f"`{ref.text}` imports colossal.{pkg}, which is not in the layering table "
                "(tools/check_layering.py LAYERS, from DESIGN.md)",
            )
        ]
    if pkg in importer.packages or layer.dist == importer.dist:
        return []  # own package or own distribution: anything goes, private modules included

    found: list[Violation] = []
    mine = [_ALL_LAYERS[p] for p in importer.packages if p in _ALL_LAYERS]
    allowed = frozenset().union(*(m.allowed for m in mine))
    if importer.is_test:
        allowed |= frozenset().union(*(m.tests_also for m in mine))
    lazy_only = frozenset().union(*(m.lazy_only for m in mine))
    if pkg in allowed:
        pass
    elif pkg in lazy_only:
        if not ref.lazy:
            found.append(
                Violation(
                    *here,
                    "lazy-only",
                    f"`{ref.text}` runs at import time, but {importer.label} may import "
                    f"{shown(pkg)} only lazily: move the import into the function that needs it",
                )
            )
    else:
        level = max((m.level for m in mine), default=0)
        if layer.level > level:
            rule, why = "upward", "imports only go down the DESIGN.md table"
        elif layer.level == level:
            rule, why = "same-level", "packages on the same level never import each other"
        else:
            rule, why = "not-allowed", "not in its 'may import' list in DESIGN.md"
        found.append(
            Violation(
                *here,
                rule,
                f"{importer.label} must not import {shown(pkg)} (`{ref.text}`): {why}; "
                f"it may import {_describe(allowed)}"
                + (f" (and lazily {_describe(lazy_only)})" if lazy_only else ""),
            )
        )
    private = _private_component(inner)
    if private is not None:
        found.append(
            Violation(
                *here,
                "private",
                f"`{ref.text}` uses `{private}`, a private part of {shown(pkg)}: import its "
                f"public names from `{shown(pkg)}` instead",
            )
        )
    deep = None if index is None or private is not None else index.deep_module(ref.target)
    if deep is not None and (path, deep) not in ALLOWED_DEEP_IMPORTS:
        public = index.public_parent(deep) if index is not None else f"colossal.{pkg}"
        found.append(
            Violation(
                *here,
                "deep-import",
                f"`{ref.text}` reaches into {deep}, which {public} does not export: import the "
                f"name from {public} (re-export it there: `__all__` or `from . import m`)",
            )
        )
    return found


# -- walking the repository ----------------------------------------------------------------------


def _python_files(directory: Path) -> Iterator[Path]:
    for path in sorted(directory.rglob("*.py")):
        rel = path.relative_to(directory).parts
        if any(p == "__pycache__" or p.startswith(".") for p in rel):
            continue
        yield path


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def check_file(
    root: Path,
    path: Path,
    importer: Importer,
    index: ModuleIndex | None = None,
    graph: dict[str, dict[str, int]] | None = None,
) -> list[Violation]:
    """All violations of the per-import rules in one Python file.

    Args:
        root: Repository root, for the paths in messages.
        path: The file.
        importer: Who the file imports as.
        index: The module tree, for the deep-import rule (skipped without it).
        graph: Filled with the file's module-level imports of indexed modules (module ->
            {imported module: line}), for the cycle rule; only for source files.
    """
    rel = _rel(root, path)
    try:
        source = path.read_text(encoding="utf-8")
        collector = _ImportCollector(importer, rel)
        collector.collect(source)
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        line = getattr(exc, "lineno", None) or 1
        return [Violation(rel, line, "syntax", f"cannot parse this file: {exc}")]
    found = list(collector.errors)
    for ref in collector.refs:
        found.extend(check_ref(importer, ref, rel, index))
    if graph is not None and index is not None and importer.module is not None:
        module = ".".join(importer.module)
        edges = graph.setdefault(module, {})
        for ref in collector.refs:
            target = None if ref.lazy else index.module_of(ref.target)
            if target is not None and target != module:
                edges.setdefault(target, ref.line)
    return found


def check_cycles(
    root: Path, index: ModuleIndex, graph: dict[str, dict[str, int]]
) -> list[Violation]:
    """One ``cycle`` violation per strongly connected component not in ``ALLOWED_CYCLES``."""
    found = []
    for component in strongly_connected(graph):
        if tuple(component) in ALLOWED_CYCLES:
            continue
        cycle = shortest_cycle(graph, component[0])
        steps = " -> ".join(
            f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)
        )
        more = len(component) - (len(cycle) - 1)
        found.append(
            Violation(
                _rel(root, index.modules[component[0]].path),
                graph[cycle[0]][cycle[1]],
                "cycle",
                f"module-level imports form a cycle: {steps} -> {cycle[0]}"
                + (f" ({more} more module(s) in the same cycle group)" if more else "")
                + ": import one of them lazily (inside the function that needs it) or move "
                "the shared code into a module that both import",
            )
        )
    return found


def _check_distribution(
    root: Path, dist_dir: Path, index: ModuleIndex, graph: dict[str, dict[str, int]]
) -> tuple[list[Violation], int]:
    dist = dist_dir.name
    found: list[Violation] = []
    files = 0
    namespace = dist_dir / "src" / NAMESPACE
    shipped: set[str] = set()
    if namespace.is_dir():
        for entry in sorted(namespace.iterdir()):
            if entry.name == "__pycache__" or entry.name.startswith("."):
                continue
            if entry.is_file() and entry.name == "__init__.py":
                found.append(
                    Violation(
                        _rel(root, entry),
                        1,
                        "namespace-init",
                        f"`{NAMESPACE}` is a PEP 420 namespace package shared by all "
                        "distributions: delete this __init__.py",
                    )
                )
            elif entry.is_file() and entry.suffix in (".py", ".pyi"):
                found.append(
                    Violation(
                        _rel(root, entry),
                        1,
                        "namespace-module",
                        f"modules belong in a subpackage `{NAMESPACE}/<pkg>/`, not directly in "
                        "the shared namespace",
                    )
                )
            elif entry.is_dir():
                shipped.add(entry.name)
                layer = LAYERS.get(entry.name)
                init = entry / "__init__.py"
                where = _rel(root, init) if init.is_file() else f"{_rel(root, entry)}/"
                if layer is None:
                    found.append(
                        Violation(
                            where,
                            1,
                            "unknown-package",
                            f"colossal.{entry.name} is not in the layering table (add it to "
                            "LAYERS in tools/check_layering.py, matching DESIGN.md)",
                        )
                    )
                elif layer.dist != dist:
                    found.append(
                        Violation(
                            where,
                            1,
                            "wrong-distribution",
                            f"colossal.{entry.name} belongs to the distribution {layer.dist!r} "
                            f"(DESIGN.md), not {dist!r}",
                        )
                    )
        for pkg in sorted(shipped):
            importer_base = (NAMESPACE, pkg)
            for path in _python_files(namespace / pkg):
                rel_parts = path.relative_to(namespace / pkg).with_suffix("").parts
                is_init = rel_parts[-1] == "__init__"
                module = importer_base + (rel_parts[:-1] if is_init else rel_parts)
                importer = Importer(f"colossal.{pkg}", dist, frozenset({pkg}), module, is_init)
                found.extend(check_file(root, path, importer, index, graph))
                files += 1

    top_found, top_files = _check_top_level(root, dist_dir, index, graph, shipped)
    found.extend(top_found)
    files += top_files

    tests = dist_dir / "tests"
    if tests.is_dir():
        packages = frozenset(shipped) or frozenset(
            p for p, layer in _ALL_LAYERS.items() if layer.dist == dist
        )
        importer = Importer(f"the tests of {dist}", dist, packages, None)
        for path in _python_files(tests):
            found.extend(check_file(root, path, importer, index))
            files += 1
    return found, files


def _check_top_level(
    root: Path,
    dist_dir: Path,
    index: ModuleIndex,
    graph: dict[str, dict[str, int]],
    shipped: set[str],
) -> tuple[list[Violation], int]:
    """The packages a distribution ships outside the namespace (``src/colossalai/``).

    Every directory of ``src/`` holding Python files, the namespace aside, is one. Each must
    be a row of ``TOP_LEVEL`` for this distribution; its files are checked like a
    namespace package's, and its name is added to ``shipped``.
    """
    dist = dist_dir.name
    found: list[Violation] = []
    files = 0
    src = dist_dir / "src"
    entries = sorted(src.iterdir()) if src.is_dir() else []
    for entry in entries:
        if entry.name in (NAMESPACE, "__pycache__") or entry.name.startswith("."):
            continue
        if not entry.is_dir() or next(_python_files(entry), None) is None:
            continue
        init = entry / "__init__.py"
        where = _rel(root, init) if init.is_file() else f"{_rel(root, entry)}/"
        layer = TOP_LEVEL.get(entry.name)
        if layer is None:
            found.append(
                Violation(
                    where,
                    1,
                    "unknown-package",
                    f"top-level package {entry.name} is not in the layering table (add it to "
                    "TOP_LEVEL in tools/check_layering.py, matching DESIGN.md)",
                )
            )
            continue
        if layer.dist != dist:
            found.append(
                Violation(
                    where,
                    1,
                    "wrong-distribution",
                    f"{entry.name} belongs to the distribution {layer.dist!r} (DESIGN.md), "
                    f"not {dist!r}",
                )
            )
            continue
        shipped.add(entry.name)
        for path in _python_files(entry):
            rel_parts = path.relative_to(entry).with_suffix("").parts
            is_init = rel_parts[-1] == "__init__"
            module = (entry.name,) + (rel_parts[:-1] if is_init else rel_parts)
            importer = Importer(entry.name, dist, frozenset({entry.name}), module, is_init)
            found.extend(check_file(root, path, importer, index, graph))
            files += 1
    return found, files


def check(root: Path) -> tuple[list[Violation], int, int]:
    """Check a repository.

    Args:
        root: Repository root (the directory holding ``packages/``).

    Returns:
        The sorted violations, the number of files and of distributions checked.

    Raises:
        FileNotFoundError: ``root/packages`` does not exist.
    """
    packages_dir = root / "packages"
    if not packages_dir.is_dir():
        raise FileNotFoundError(f"no packages/ directory under {root}")
    found: list[Violation] = []
    files = dists = 0
    index = ModuleIndex.scan(packages_dir)
    graph: dict[str, dict[str, int]] = {}
    for dist_dir in sorted(p for p in packages_dir.iterdir() if p.is_dir()):
        if dist_dir.name.startswith(".") or dist_dir.name == "__pycache__":
            continue
        dist_found, dist_files = _check_distribution(root, dist_dir, index, graph)
        found.extend(dist_found)
        files += dist_files
        dists += 1
    found.extend(check_cycles(root, index, graph))
    return sorted(set(found)), files, dists


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="repository root holding packages/ (default: the repository of this script)",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        violations, files, dists = check(root)
    except FileNotFoundError as exc:
        print(f"check_layering: error: {exc}", file=sys.stderr)
        return 2
    for violation in violations:
        print(violation)
    if violations:
        print(
            f"check_layering: {len(violations)} violation(s) in {files} files "
            "(rules: DESIGN.md 'Packages and layering')",
            file=sys.stderr,
        )
        return 1
    print(f"check_layering: OK ({files} files in {dists} distribution(s) follow the layering)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
