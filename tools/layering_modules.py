"""The module tree of the Colossal packages, for ``check_layering.py``'s deep-import rule.

Static, standard library only: every ``packages/<dist>/src/colossal/**.py`` is indexed by its
dotted module name, and each package ``__init__.py`` is parsed for what it exports.

The deep-import rule (applied to imports across distributions): a package ``colossal.X`` is
used through its public surface, which is

* any name of ``colossal.X`` itself (``from colossal.X import Foo``);
* an *exported* submodule ``colossal.X.m`` and any name it defines. ``m`` is exported when
  ``colossal/X/__init__.py`` re-exports it (lists ``"m"`` in ``__all__``, or binds it at
  module level with ``from . import m`` / ``from colossal.X import m``), or when ``m`` is a
  documented public subpackage (``colossal/X/m/__init__.py`` defines ``__all__``), or when
  ``m`` is a dunder module such as ``__about__``;
* below an exported subpackage, the same rule again, one level down.

Anything else below ``colossal.X`` (``colossal.X.impl``, ``colossal.X.sub.impl`` where
``sub`` does not export ``impl``) is a *deep import*: a module the package does not promise
to keep. Names that are not modules (``from colossal.X import helper`` where ``helper`` is
missing from ``__all__``) are not checked here; private names are the ``private`` rule's job.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

NAMESPACE = "colossal"


def is_dunder(component: str) -> bool:
    """Whether a dotted name component is a dunder (``__about__``, ``__version__``)."""
    return len(component) > 4 and component.startswith("__") and component.endswith("__")


@dataclass(frozen=True)
class ModuleInfo:
    """One indexed module.

    Attributes:
        name: Dotted module name (a package's name for its ``__init__.py``).
        path: The file.
        is_package: Whether the file is a package ``__init__.py``.
        all_names: The literal ``__all__`` of a package ``__init__`` (None when it has none).
        bound_submodules: Submodule names its ``__init__`` binds with ``from . import m``.
    """

    name: str
    path: Path
    is_package: bool = False
    all_names: frozenset[str] | None = None
    bound_submodules: frozenset[str] = field(default_factory=frozenset)


def _literal_strings(node: ast.expr) -> list[str] | None:
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return None
    values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
    return [v for v in values if isinstance(v, str)]


def _parse_init(name: str, source: str) -> tuple[frozenset[str] | None, frozenset[str]]:
    """``__all__`` (``=`` and ``+=`` of literal lists) and ``from . import m`` bindings."""
    tree = ast.parse(source)
    all_names: set[str] | None = None
    bound: set[str] = set()
    for stmt in tree.body:  # module level only: what importing the package runs
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                values = _literal_strings(stmt.value) if stmt.value is not None else None
                if values is not None:
                    all_names = (all_names or set()) | set(values)
        elif isinstance(stmt, ast.ImportFrom):
            own = (stmt.level == 1 and not stmt.module) or (stmt.level == 0 and stmt.module == name)
            if own:
                bound.update(a.asname or a.name for a in stmt.names if a.name != "*")
    return (None if all_names is None else frozenset(all_names)), frozenset(bound)


class ModuleIndex:
    """Every module of the ``colossal`` namespace found under ``packages/*/src``."""

    def __init__(self, modules: Iterable[ModuleInfo] = ()) -> None:
        self.modules: dict[str, ModuleInfo] = {m.name: m for m in modules}

    @classmethod
    def scan(cls, packages_dir: Path) -> ModuleIndex:
        """Index ``packages_dir/<dist>/src/colossal/<pkg>/**.py`` (unparsable inits: no exports)."""
        found: list[ModuleInfo] = []
        for namespace in sorted(packages_dir.glob(f"*/src/{NAMESPACE}")):
            for path in sorted(namespace.rglob("*.py")):
                parts = path.relative_to(namespace.parent).with_suffix("").parts
                if len(parts) < 3:
                    continue  # files directly in the namespace are another rule's business
                if any(p == "__pycache__" or p.startswith(".") for p in parts):
                    continue
                if parts[-1] == "__init__":
                    name = ".".join(parts[:-1])
                    try:
                        all_names, bound = _parse_init(name, path.read_text(encoding="utf-8"))
                    except (SyntaxError, UnicodeDecodeError, ValueError):
                        all_names, bound = None, frozenset()
                    found.append(ModuleInfo(name, path, True, all_names, bound))
                else:
                    found.append(ModuleInfo(".".join(parts), path))
        return cls(found)

    def module_of(self, target: str) -> str | None:
        """The module a dotted import target names or takes a name from (longest prefix)."""
        parts = target.split(".")
        for end in range(len(parts), 0, -1):
            name = ".".join(parts[:end])
            if name in self.modules:
                return name
        return None

    def _exports(self, package: str, child: str) -> bool:
        info = self.modules[package]
        sub = self.modules.get(f"{package}.{child}")
        return (
            is_dunder(child)
            or (info.all_names is not None and child in info.all_names)
            or child in info.bound_submodules
            or (sub is not None and sub.is_package and sub.all_names is not None)
        )

    def deep_module(self, target: str) -> str | None:
        """The first module on the way to ``target`` that its package does not export.

        Args:
            target: An absolute dotted import target, e.g. ``colossal.core.comm.ops.f``.

        Returns:
            The non-exported module (``colossal.core.comm.ops``), or None when ``target`` only
            goes through the public surface (or is not an indexed ``colossal`` module).
        """
        parts = target.split(".")
        if len(parts) < 3 or parts[0] != NAMESPACE:
            return None
        package = ".".join(parts[:2])
        if package not in self.modules:
            return None
        for child in parts[2:]:
            module = f"{package}.{child}"
            info = self.modules.get(module)
            if info is None:
                return None  # a name, not a module
            if not self._exports(package, child):
                return module
            if not info.is_package:
                return None
            package = module
        return None

    def public_parent(self, module: str) -> str:
        """The nearest package above ``module`` whose import is public (for messages)."""
        parts = module.split(".")
        for end in range(len(parts) - 1, 1, -1):
            candidate = ".".join(parts[:end])
            if self.deep_module(candidate) is None:
                return candidate
        return ".".join(parts[:2])
