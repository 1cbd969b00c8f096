"""The ``sys.meta_path`` hook that serves ``colossalai.X`` from the name table.

:class:`AliasFinder` sits first on ``sys.meta_path`` and answers for every ``colossalai.*``
name except the compat package's own private modules: a Served row becomes an
:class:`~colossalai._alias.AliasModule` (created by :meth:`AliasFinder.create_module`, bound
to its row and target by :meth:`AliasFinder.exec_module`); anything else raises
ModuleNotFoundError with the table's hint. Being first matters: a later finder would find
the target's files through the alias's ``__path__`` and execute them a second time.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

from colossalai import _messages
from colossalai._alias import AliasModule
from colossalai._entries import Missing, Served
from colossalai._resolve import PACKAGE, import_target, is_own_module, lookup
from colossalai._table import TABLE

__all__ = ["AliasFinder", "install"]


class AliasFinder(MetaPathFinder, Loader):
    """Finds and loads the alias modules of ``colossalai.*`` (see the module docstring)."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> ModuleSpec | None:
        """A spec for a served path; raises ModuleNotFoundError for any other ``colossalai.*``.

        Raises:
            ModuleNotFoundError: ``fullname`` is a missing or unmapped ColossalAI path (the
                message names our equivalent, or says it is not implemented).
        """
        if not fullname.startswith(PACKAGE + ".") or is_own_module(fullname):
            return None
        found = lookup(fullname)
        if isinstance(found.row, Served):
            return ModuleSpec(fullname, self, is_package=True)
        hint = found.row.hint if isinstance(found.row, Missing) else None
        issue = found.row.issue if isinstance(found.row, Missing) else None
        message = _messages.not_served(fullname, hint, issue, TABLE)
        raise _messages.NotServedError(message, name=fullname)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        """An empty :class:`AliasModule` (the import system then sets ``__path__``...)."""
        return AliasModule(spec.name)

    def exec_module(self, module: ModuleType) -> None:
        """Bind the alias to its row and import its target.

        Raises:
            ModuleNotFoundError: The target is not built yet (a partial row tolerates that),
                or Colossal has no module for a path derived through a ``tree`` row.
        """
        found = lookup(module.__name__)
        row = found.row
        assert isinstance(module, AliasModule) and isinstance(row, Served)
        imported: ModuleType | None = None
        error: str | None = None
        if row.target is not None:
            try:
                imported = import_target(found)
            except _messages.NotServedError as exc:
                if not row.partial:
                    raise
                error = str(exc)
        module.__compat_row__ = row
        module.__compat_target__ = imported
        module.__compat_target_error__ = error
        module.__doc__ = f"ColossalAI's {module.__name__}, served by " + (
            row.target or "objects of Colossal's packages (colossalai/_table.py)"
        )


def install() -> AliasFinder:
    """Put the finder first on ``sys.meta_path`` (once per process); returns it."""
    for finder in sys.meta_path:
        if type(finder).__name__ == AliasFinder.__name__ and type(finder).__module__ == __name__:
            return finder  # type: ignore[return-value]
    finder = AliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
