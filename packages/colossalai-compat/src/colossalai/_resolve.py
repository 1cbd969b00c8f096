"""From a ColossalAI path to its row, and from a row to our modules and objects."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from colossalai import _messages
from colossalai._entries import Missing, Served, served
from colossalai._table import TABLE, TOP_LEVEL

__all__ = ["PACKAGE", "Lookup", "is_own_module", "load_name", "lookup", "import_target"]

PACKAGE = "colossalai"


@dataclass(frozen=True)
class Lookup:
    """The row serving one ColossalAI path.

    Attributes:
        path: The ColossalAI module path.
        row: Its row (a derived one for a path under a ``tree`` row); ``None``: unmapped.
        ancestor: The ``tree`` row's path when the row was derived from it.
        ancestor_target: That row's target module.
    """

    path: str
    row: Served | Missing | None
    ancestor: str | None = None
    ancestor_target: str | None = None


def is_own_module(fullname: str) -> bool:
    """The compat package's own modules (``colossalai._table``, ``colossalai.__about__``)."""
    parts = fullname.split(".")
    return parts[0] == PACKAGE and len(parts) > 1 and parts[1].startswith("_")


def lookup(path: str) -> Lookup:
    """The row for ``path``: its own, one derived from a ``tree`` ancestor, or none.

    The nearest ancestor with a row decides: a Missing ancestor makes the path missing too,
    a ``tree`` ancestor maps the rest of the path one to one, any other ends the search.
    """
    if path == PACKAGE:
        return Lookup(path, TOP_LEVEL)
    row = TABLE.get(path)
    if row is not None:
        return Lookup(path, row)
    parts = path.split(".")
    for end in range(len(parts) - 1, 1, -1):
        ancestor = ".".join(parts[:end])
        found = TABLE.get(ancestor)
        if found is None:
            continue
        if isinstance(found, Missing):
            return Lookup(path, found)
        if found.tree and found.target is not None:
            rest = ".".join(parts[end:])
            derived = served(f"{found.target}.{rest}", tree=True, issue=found.issue)
            return Lookup(path, derived, ancestor, found.target)
        break
    return Lookup(path, None)


def _is_missing_module(exc: ModuleNotFoundError, module: str) -> bool:
    """Whether ``exc`` says ``module`` itself (or a package above it) does not exist."""
    name = exc.name or ""
    return bool(name) and (module == name or module.startswith(name + "."))


def import_target(found: Lookup) -> ModuleType:
    """Import the target module of a Served lookup.

    Raises:
        ModuleNotFoundError: The target does not exist: "not built yet" for a row of the
            table, "not implemented" for a path derived through a ``tree`` row whose module
            Colossal does not have. An ImportError raised *inside* an existing target
            propagates unchanged.
    """
    row = found.row
    assert isinstance(row, Served) and row.target is not None
    try:
        return importlib.import_module(row.target)
    except ModuleNotFoundError as exc:
        if not _is_missing_module(exc, row.target):
            raise
        if found.ancestor is not None and found.ancestor_target is not None:
            root_missing = _is_missing_module(exc, found.ancestor_target)
            if not root_missing:
                msg = _messages.no_counterpart(
                    found.path, found.ancestor, found.ancestor_target, exc.name or row.target
                )
                raise _messages.NotServedError(msg, name=found.path) from None
        msg = _messages.not_built(found.path, row.target, row.issue)
        raise _messages.NotServedError(msg, name=found.path) from exc


def load_name(path: str, name: str, spec: str, issue: int | None) -> object:
    """The object ``spec`` (``"our.module:attr"``) names, served as ``path.name``.

    Raises:
        ModuleNotFoundError: Its module is not built yet.
        AttributeError: Its module exists but does not define it (yet).
    """
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not _is_missing_module(exc, module_name):
            raise
        why = _messages.not_built(f"{path}.{name}", spec, issue)
        raise _messages.NotServedError(why, name=path) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        why = f"maps to {spec}, which {module_name} does not define (not built yet"
        why += f", issue {issue})" if issue is not None else ")"
        raise _messages.NotServedAttributeError(_messages.missing_name(path, name, why)) from None
