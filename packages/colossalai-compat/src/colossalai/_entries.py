"""The row types of the name table (:mod:`colossalai._table`).

A ColossalAI module path maps to one of two rows:

* :class:`Served`: ``colossalai.X`` is served by a thin alias module whose attributes come
  from our module ``target`` (the same objects, never copies), from ``names`` (ColossalAI
  name -> ``"our.module:attr"``) and from the child modules listed in ``include`` (like
  ColossalAI's ``from .optimizer import *``). With ``tree=True``, a submodule path that has
  no row of its own maps to the same submodule path under ``target``.
* :class:`Missing`: a ColossalAI path Colossal does not serve; importing it raises an
  ImportError carrying ``hint`` (our equivalent, or why there is none) and the issue to watch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["ISSUE_LEGACY", "ISSUE_TODAY", "Missing", "Row", "Served", "missing", "served"]

#: The issue that builds the config-era API (colossal-legacy) and this package.
ISSUE_LEGACY = 31
#: The issue that adds more of today's ColossalAI names (spawn, fp8 communication...).
ISSUE_TODAY = 36


def _frozen(mapping: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Served:
    """A ColossalAI module path served from Colossal's modules.

    Attributes:
        target: Our module whose names the alias serves (``None``: only ``names`` and
            ``include``). Importing the alias imports it, so a target that is not installed
            makes the import fail with ``issue`` in the message.
        names: ColossalAI name -> ``"our.module:attr"``; takes precedence over ``target``.
        include: Child modules (relative names) whose names this module re-exports.
        tree: Submodules without a row map to the same relative path under ``target``.
        partial: Importing the alias succeeds even when ``target`` is not installed (so its
            child rows still work); only the target's names are then missing.
        hints: Names ColossalAI has here that we do not serve: name -> what to use instead.
        issue: The issue that builds ``target`` (or the names) when it is not there yet.
        note: Why the row looks the way it does (shown by nothing; for readers).
    """

    target: str | None = None
    names: Mapping[str, str] = field(default_factory=lambda: _frozen(None))
    include: tuple[str, ...] = ()
    tree: bool = False
    partial: bool = False
    hints: Mapping[str, str] = field(default_factory=lambda: _frozen(None))
    issue: int | None = ISSUE_LEGACY
    note: str = ""

    def __post_init__(self) -> None:
        for name, spec in self.names.items():
            module, sep, attr = spec.partition(":")
            if not (sep and module and attr):
                raise ValueError(f"name {name!r}: {spec!r} must be 'our.module:attr'")
        if (self.tree or self.partial) and self.target is None:
            raise ValueError("tree=True and partial=True need a target module")
        overlap = set(self.names) & set(self.hints)
        if overlap:
            raise ValueError(f"names both served and hinted: {sorted(overlap)}")


@dataclass(frozen=True)
class Missing:
    """A ColossalAI module path Colossal does not serve.

    Attributes:
        hint: What to use instead, or why it does not exist here.
        issue: The issue to watch, if one plans it.
    """

    hint: str
    issue: int | None = None


Row = Served | Missing


def served(
    target: str | None = None,
    *,
    names: Mapping[str, str] | None = None,
    include: tuple[str, ...] = (),
    tree: bool = False,
    partial: bool = False,
    hints: Mapping[str, str] | None = None,
    issue: int | None = ISSUE_LEGACY,
    note: str = "",
) -> Served:
    """A :class:`Served` row (keyword helper for the table)."""
    return Served(target, _frozen(names), include, tree, partial, _frozen(hints), issue, note)


def missing(hint: str, issue: int | None = None) -> Missing:
    """A :class:`Missing` row."""
    return Missing(hint, issue)
