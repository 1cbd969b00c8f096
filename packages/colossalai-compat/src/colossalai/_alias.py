"""Thin alias modules: ``colossalai.X`` whose attributes are Colossal's objects.

An :class:`AliasModule` holds no code of its own. An attribute is looked up, in order, in the
row's ``names`` (``"our.module:attr"``), among the row's child paths (another alias module),
in the target module, and in the ``include``d children; the result is cached on the alias.
Anything else raises an error that names the module and the nearest names: AttributeError
for attribute access (so ``hasattr`` and ``getattr(m, name, default)`` behave), ImportError
for ``from colossalai.X import name`` (whose own message would otherwise hide ours).
"""

from __future__ import annotations

import dis
import importlib
import sys
from types import FrameType, ModuleType
from typing import NoReturn

from colossalai import _messages
from colossalai._entries import Served
from colossalai._messages import NotServedAttributeError, NotServedError
from colossalai._resolve import load_name
from colossalai._table import TABLE

__all__ = ["AliasModule", "attribute", "public_names"]

_NOT_FOUND = object()


class AliasModule(ModuleType):
    """A ColossalAI module path served by Colossal's modules (see the module docstring)."""

    __compat_row__: Served
    __compat_target__: ModuleType | None
    __compat_target_error__: str | None

    def __getattr__(self, name: str) -> object:
        if name == "__all__":
            value: object = public_names(self.__name__, self.__compat_row__, self.__compat_target__)
        elif name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)  # probed all the time (copy, inspect, pickle...)
        else:
            value = attribute(
                self.__name__,
                self.__compat_row__,
                self.__compat_target__,
                name,
                _from_import(sys._getframe(1)),
                self.__compat_target_error__,
            )
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        names = set(public_names(self.__name__, self.__compat_row__, self.__compat_target__))
        return sorted(names | set(self.__dict__))

    def __repr__(self) -> str:
        serving = self.__compat_row__.target or "names from the table"
        return f"<colossalai-compat alias {self.__name__!r} of {serving}>"


def _from_import(frame: FrameType | None) -> bool:
    """Whether ``frame`` is executing ``from module import name`` (the IMPORT_FROM opcode)."""
    if frame is None:
        return False
    try:
        for instruction in dis.get_instructions(frame.f_code):
            if instruction.offset == frame.f_lasti:
                return instruction.opname == "IMPORT_FROM"
    except (TypeError, ValueError):  # an exotic code object: fall back to attribute access
        return False
    return False


def _raise(message: str, path: str, from_import: bool) -> NoReturn:
    if from_import:
        raise _messages.NotServedError(message, name=path)
    raise _messages.NotServedAttributeError(message)


def attribute(
    path: str,
    row: Served,
    target: ModuleType | None,
    name: str,
    from_import: bool = False,
    target_error: str | None = None,
) -> object:
    """``path.name`` as the alias module ``path`` (served by ``row``) gives it.

    Args:
        path: The ColossalAI module path.
        row: Its row.
        target: The imported target module (``None``: the row has none, or it is missing).
        name: The attribute.
        from_import: Raise ImportError (``from path import name``) instead of AttributeError.
        target_error: Why a partial row's target is missing, for the error message.
    """
    if name in row.names:
        try:
            return load_name(path, name, row.names[name], row.issue)
        except (NotServedError, NotServedAttributeError) as exc:
            _raise(str(exc), path, from_import)
    if name in row.hints:  # ColossalAI's name that we do not serve (even if target has one)
        _raise(_messages.missing_name(path, name, row.hints[name]), path, from_import)
    if f"{path}.{name}" in TABLE:  # a child row of its own wins (another alias module)
        return _import_child(path, name, from_import)
    if target is not None:
        value = getattr(target, name, _NOT_FOUND)
        if value is not _NOT_FOUND:
            if isinstance(value, ModuleType) and row.tree:  # served as its derived alias
                return _import_child(path, name, from_import)
            return value
    notes: list[str] = [target_error] if target_error else []
    for child in row.include:
        value = _from_included(path, child, name, notes)
        if value is not _NOT_FOUND:
            return value
    serving = row.target or "served from the name table"
    message = _messages.unknown_name(path, name, serving, public_names(path, row, target))
    _raise("; ".join([message, *notes]), path, from_import)


def _import_child(path: str, name: str, from_import: bool) -> ModuleType:
    try:
        return importlib.import_module(f"{path}.{name}")
    except NotServedError as exc:  # an ImportError inside an existing module propagates
        _raise(str(exc), path, from_import)


def _from_included(path: str, child: str, name: str, notes: list[str]) -> object:
    """``name`` from the included child alias ``path.child``; notes why a child is missing."""
    try:
        module = importlib.import_module(f"{path}.{child}")
    except NotServedError as exc:
        notes.append(str(exc))
        return _NOT_FOUND
    if not isinstance(module, AliasModule):
        return getattr(module, name, _NOT_FOUND)
    try:
        return attribute(
            module.__name__,
            module.__compat_row__,
            module.__compat_target__,
            name,
            target_error=module.__compat_target_error__,
        )
    except (NotServedError, NotServedAttributeError):
        if module.__compat_target_error__:
            notes.append(module.__compat_target_error__)
        return _NOT_FOUND


def _target_public(target: ModuleType) -> list[str]:
    exported = getattr(target, "__all__", None)
    if exported is not None:
        return [str(n) for n in exported]
    return [
        n
        for n, v in vars(target).items()
        if not n.startswith("_") and not isinstance(v, ModuleType)
    ]


def public_names(path: str, row: Served, target: ModuleType | None) -> list[str]:
    """What ``from path import *`` gives: the names that resolve now (no child modules)."""
    names: set[str] = set(_target_public(target)) if target is not None else set()
    for name, spec in row.names.items():
        try:
            load_name(path, name, spec, row.issue)
        except (NotServedError, NotServedAttributeError):
            continue
        names.add(name)
    for child in row.include:
        try:
            module = importlib.import_module(f"{path}.{child}")
        except NotServedError:
            continue
        names.update(getattr(module, "__all__", ()))
    return sorted(names - set(row.hints))
