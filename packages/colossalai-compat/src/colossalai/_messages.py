"""The texts of the errors the compat package raises (one place, so tests can rely on them)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from colossalai._entries import ISSUE_TODAY

__all__ = [
    "NOT_IMPLEMENTED",
    "NotServedAttributeError",
    "NotServedError",
    "missing_name",
    "no_counterpart",
    "not_built",
    "not_served",
    "unknown_name",
]


class NotServedError(ModuleNotFoundError):
    """A ColossalAI path or name colossalai-compat does not serve (not built, not mapped)."""


class NotServedAttributeError(AttributeError):
    """A name a served module does not have, on attribute access (``hasattr`` is False)."""


#: The phrase every "Colossal has nothing for this" message contains.
NOT_IMPLEMENTED = "not implemented in Colossal"
_TABLE = "colossalai-compat's name table (colossalai/_table.py)"


def _watch(issue: int | None) -> str:
    return f" (watch issue {issue})" if issue is not None else ""


def _nearest(word: str, candidates: Iterable[str]) -> list[str]:
    return difflib.get_close_matches(word, sorted(set(candidates)), n=3, cutoff=0.6)


def not_built(path: str, target: str, issue: int | None) -> str:
    """``path`` maps to ``target``, which this installation does not have (yet)."""
    return (
        f"{path} maps to {target}, which is not built yet{_watch(issue)}: it is not in this "
        "installation"
    )


def not_served(path: str, hint: str | None, issue: int | None, known: Iterable[str]) -> str:
    """``path`` has no row in the table (``hint``: the row's text, for a Missing row)."""
    if hint is not None:
        return f"{path} is not served by colossalai-compat: {hint}{_watch(issue)}"
    close = _nearest(path, known)
    also = f"; did you mean {', '.join(close)}?" if close else ""
    return (
        f"No module named {path!r}: {NOT_IMPLEMENTED} ({path} is not in {_TABLE}; watch "
        f"issue {ISSUE_TODAY} for more of today's ColossalAI names){also}"
    )


def no_counterpart(path: str, ancestor: str, target: str, missing_module: str) -> str:
    """A path derived through a ``tree`` row whose module Colossal does not have."""
    return (
        f"No module named {path!r}: {NOT_IMPLEMENTED}. {ancestor} maps to {target}, which has "
        f"no module {missing_module!r}; import the names from {ancestor} instead (watch issue "
        f"{ISSUE_TODAY} for more of today's ColossalAI paths)"
    )


def missing_name(path: str, name: str, why: str) -> str:
    """A name the table knows but cannot give: not built yet, or hinted."""
    return f"{path}.{name}: {why}"


def unknown_name(path: str, name: str, serving: str, candidates: Iterable[str]) -> str:
    """A name neither the table nor our module has."""
    close = _nearest(name, candidates)
    nearest = f"; nearest names: {', '.join(close)}" if close else ""
    return f"module {path!r} ({serving}) has no attribute {name!r}{nearest}"
