"""Count ``typing.Any`` in the public signatures of the Colossal packages.

Usage::

    python tools/count_any.py [--root DIR] [--list] [--max N]

Static and standard library only: every ``packages/<dist>/src/**.py`` is parsed with
:mod:`ast`, nothing is imported. Prints one line per distribution and the total.

What counts (the rule the tests pin down):

* A module is private when a component of its dotted name (a directory or the file's stem)
  starts with ``_`` and is not a dunder (``__init__``, ``__about__``, ``__main__`` are
  public). Nothing in a private module counts.
* A *public signature* is a ``def`` / ``async def`` at module level (also inside module-level
  ``if`` / ``try`` blocks) whose name does not start with ``_``, and a method of a public
  class (module level, or nested in a public class) whose name does not start with ``_`` or
  is a dunder (``__init__``, ``__call__``, ...). Functions nested in functions are not
  signatures. Overloads and properties are signatures like any other ``def``.
* In a public signature, every annotation of a positional-only, ordinary or keyword-only
  parameter and the return annotation are searched for ``Any``: the name ``Any`` and any
  attribute ``x.Any`` (``typing.Any``), also inside string annotations. Each occurrence
  counts once (``dict[str, Any] | Any`` is two).
* ``*args: Any`` and ``**kwargs: Any`` do **not** count: they are how a function forwards
  arguments it does not inspect, and the precise alternative (``ParamSpec``) belongs to the
  callee, not to the forwarding signature.
* A module-level alias of ``Any`` (``Batch = Any``, ``Batch: TypeAlias = dict[str, Any]``)
  is still ``Any``: using it in a signature counts as the ``Any`` occurrences of its value,
  in its own module and wherever it is imported with ``from <module> import Batch``
  (absolute or relative imports). An alias documents a choice; it does not hide it.

``--list`` also prints each occurrence as ``path:line name`` (``name`` is the function's
qualified name, ``via Alias`` when it came through an alias). ``--max N`` exits 1 when the
total exceeds ``N`` (CI holds the line); the exit status is 0 otherwise, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Occurrence:
    """One ``Any`` in a public signature.

    Attributes:
        dist: The distribution (directory name under ``packages/``).
        path: The file, relative to the root given to :func:`count`.
        line: Line of the annotation that holds it.
        name: Qualified name of the function (``Class.method``).
        alias: The alias it came through, or ``None`` for a literal ``Any``.
    """

    dist: str
    path: str
    line: int
    name: str
    alias: str | None = None


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _is_public(name: str) -> bool:
    """Public: no leading underscore, or a dunder."""
    return not name.startswith("_") or _is_dunder(name)


def _module_name(src: Path, path: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_private_module(module: str) -> bool:
    return any(not _is_public(part) for part in module.split(".") if part)


def _literal_any(node: ast.AST) -> int:
    """``Any`` names and ``x.Any`` attributes in an expression, string annotations parsed."""
    found = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Any":
            found += 1
        elif isinstance(sub, ast.Attribute) and sub.attr == "Any":
            found += 1
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            parsed = _parse_annotation(sub.value)
            if parsed is not None:
                found += _literal_any(parsed)
    return found


def _parse_annotation(text: str) -> ast.expr | None:
    try:
        return ast.parse(text.strip(), mode="eval").body
    except SyntaxError:  # a docstring-like string, not an annotation
        return None


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, descending into ``if`` / ``try`` blocks (not functions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _module_statements(stmt.body)
            yield from _module_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody):
                yield from _module_statements(block)
            for handler in stmt.handlers:
                yield from _module_statements(handler.body)


def _own_aliases(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to an expression holding ``Any`` -> its count of ``Any``."""
    aliases: dict[str, int] = {}
    for stmt in _module_statements(tree.body):
        target: ast.expr | None = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target, value = stmt.target, stmt.value
        if isinstance(target, ast.Name):
            found = _literal_any(value)
            if found:
                aliases[target.id] = found
    return aliases


def _resolve_from(module: str, is_package: bool, stmt: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if stmt.level == 0:
        return stmt.module or ""
    base = module.split(".") if module else []
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (stmt.level - 1)] if stmt.level > 1 else base
    return ".".join([*base, *([stmt.module] if stmt.module else [])])


@dataclass
class _Module:
    dist: str
    rel: str
    name: str
    is_package: bool
    tree: ast.Module
    aliases: dict[str, int]


class _Counter:
    """Walks one module's public signatures, resolving aliases through ``known``."""

    def __init__(self, module: _Module, known: dict[str, dict[str, int]]) -> None:
        self.module = module
        self.aliases: dict[str, tuple[str, int]] = {
            name: (name, n) for name, n in module.aliases.items()
        }
        for stmt in _module_statements(module.tree.body):
            if isinstance(stmt, ast.ImportFrom):
                source = _resolve_from(module.name, module.is_package, stmt)
                for alias in stmt.names:
                    n = known.get(source, {}).get(alias.name)
                    if n:
                        self.aliases[alias.asname or alias.name] = (alias.name, n)
        self.found: list[Occurrence] = []

    def run(self) -> list[Occurrence]:
        for stmt in _module_statements(self.module.tree.body):
            if isinstance(stmt, FunctionNode) and not stmt.name.startswith("_"):
                self._signature(stmt, stmt.name)
            elif isinstance(stmt, ast.ClassDef) and not stmt.name.startswith("_"):
                self._class(stmt, stmt.name)
        return self.found

    def _class(self, cls: ast.ClassDef, qualname: str) -> None:
        for stmt in cls.body:
            if isinstance(stmt, FunctionNode) and _is_public(stmt.name):
                self._signature(stmt, f"{qualname}.{stmt.name}")
            elif isinstance(stmt, ast.ClassDef) and not stmt.name.startswith("_"):
                self._class(stmt, f"{qualname}.{stmt.name}")

    def _signature(self, fn: FunctionNode, qualname: str) -> None:
        args = fn.args
        annotations = [a.annotation for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
        annotations.append(fn.returns)  # *args / **kwargs left out on purpose (forwarding)
        for annotation in annotations:
            if annotation is not None:
                self._annotation(annotation, qualname)

    def _annotation(self, node: ast.expr, qualname: str) -> None:
        for _ in range(_literal_any(node)):
            self.found.append(self._occurrence(node, qualname, None))
        for sub in ast.walk(node):
            names = [sub.id] if isinstance(sub, ast.Name) else []
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                parsed = _parse_annotation(sub.value)
                if parsed is not None:
                    names = [n.id for n in ast.walk(parsed) if isinstance(n, ast.Name)]
            for name in names:
                if name in self.aliases:
                    alias, n = self.aliases[name]
                    self.found.extend(self._occurrence(node, qualname, alias) for _ in range(n))

    def _occurrence(self, node: ast.expr, qualname: str, alias: str | None) -> Occurrence:
        return Occurrence(self.module.dist, self.module.rel, node.lineno, qualname, alias)


def _modules(root: Path) -> Iterator[_Module]:
    for src in sorted((root / "packages").glob("*/src")):
        dist = src.parent.name
        for path in sorted(src.rglob("*.py")):
            name = _module_name(src, path)
            if _is_private_module(name):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            rel = path.relative_to(root).as_posix()
            yield _Module(dist, rel, name, path.name == "__init__.py", tree, _own_aliases(tree))


def count(root: Path) -> list[Occurrence]:
    """Every ``Any`` in the public signatures under ``root/packages/*/src``, in file order."""
    modules = list(_modules(root))
    known = {m.name: m.aliases for m in modules if m.aliases}
    found: list[Occurrence] = []
    for module in modules:
        found.extend(_Counter(module, known).run())
    return found


def per_distribution(root: Path, found: list[Occurrence]) -> dict[str, int]:
    """Counts by distribution; every ``packages/<dist>/src`` is listed, zeros included."""
    totals = {src.parent.name: 0 for src in sorted((root / "packages").glob("*/src"))}
    for occurrence in found:
        totals[occurrence.dist] += 1
    return totals


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="repository root (default: this script's repository)",
    )
    parser.add_argument("--list", action="store_true", help="print each occurrence")
    parser.add_argument("--max", type=int, default=None, help="exit 1 when the total exceeds N")
    options = parser.parse_args(argv)
    if not (options.root / "packages").is_dir():
        parser.error(f"{options.root} has no packages/ directory")
    found = count(options.root)
    if options.list:
        for o in found:
            via = f" (via {o.alias})" if o.alias else ""
            print(f"{o.path}:{o.line} {o.name}{via}")
    functions = len({(o.path, o.name) for o in found})
    for dist, n in per_distribution(options.root, found).items():
        print(f"{dist}: {n}")
    print(f"total: {len(found)} Any in the signatures of {functions} public functions")
    if options.max is not None and len(found) > options.max:
        print(
            f"count_any: {len(found)} Any in public signatures exceeds --max {options.max}; "
            "use the real types (tools/count_any.py --list shows where)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
