"""The seeds' Python snippets and the ``colossalai`` names they use.

The seeds (``<repo>/../shared/seeds``) are ColossalAI's documentation: Markdown pages and a
large text collection whose code blocks are mangled (curly quotes, lost indentation, fences
that do not close). This module

1. extracts the Python code blocks (```` ```python ```` and the collection's `` `python ``
   fences), de-duplicated (the collection has each page in English and Chinese);
2. normalises them (straight quotes, ``...`` for the ellipsis character) and parses them:
   as written, or else with the indentation rebuilt by a heuristic; a block that still does
   not parse is *unparseable* (its ``colossalai`` imports are then read line by line);
3. collects every ``colossalai`` name a block uses (``import colossalai.x``, ``from
   colossalai.x import y``, ``colossalai.x.y`` and ``alias.y`` through imported names) and
   classifies the block as config-era (``launch(config=...)``, ``gpc``, ``ParallelMode``,
   ``initialize``, ``Engine``, ``Trainer``, hooks, ``AMP_TYPE``...) or Booster-era;
4. resolves each name through ``import colossalai`` (the compat package) without running the
   snippet.

``python seed_snippets.py`` prints the counts and every unresolved name.
"""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType

from colossalai._alias import AliasModule

_HERE = Path(__file__).resolve()
#: The repository root (``packages/colossalai-compat/tests/`` is three levels below it).
REPO = _HERE.parents[3] if len(_HERE.parents) > 3 else _HERE.parent
PACKAGE = "colossalai"
#: How :func:`check` reports the compat package's own "not served" errors (anything else that
#: a name raises is a bug).
NOT_SERVED = ("NotServedError: ", "NotServedAttributeError: ")

_CHARS = str.maketrans(
    {"‘": "'", "’": "'", "“": '"', "”": '"', "…": "...", "\u00a0": " ", "\u3000": " "}
)
_OPEN = re.compile(r"^(?P<fence>```|`)(?P<lang>[\w+-]*)$")
_PYTHON = {"python", "py", "python3"}

#: Modules of the config-era API (second component of a ``colossalai.X`` path).
CONFIG_MODULES = frozenset(
    {
        "amp",
        "builder",
        "communication",
        "constants",
        "context",
        "core",
        "engine",
        "global_variables",
        "legacy",
        "registry",
        "trainer",
    }
)
#: Names only the config-era API has.
CONFIG_NAMES = frozenset(
    {
        "AMP_TYPE",
        "BaseGradientHandler",
        "DIST_GROUP_INITIALIZER",
        "Engine",
        "GRADIENT_HANDLER",
        "InterleavedPipelineSchedule",
        "NonPipelineSchedule",
        "ParallelMode",
        "PipelinableContext",
        "PipelineSchedule",
        "ProcessGroupInitializer",
        "Trainer",
        "build_pipeline_model",
        "build_pipeline_model_from_cfg",
        "global_context",
        "gpc",
        "hooks",
        "initialize",
        "get_default_parser",
        "zero_model_wrapper",
        "zero_optim_wrapper",
    }
)
#: Top-level keys of a config file.
CONFIG_KEYS = frozenset(
    {
        "parallel",
        "fp16",
        "zero",
        "gradient_accumulation",
        "clip_grad_norm",
        "gradient_handler",
        "NUM_MICRO_BATCHES",
    }
)


def seeds_dir() -> Path | None:
    """``<repo>/../shared/seeds`` if it exists."""
    path = REPO.parent / "shared" / "seeds"
    return path if path.is_dir() else None


@dataclass(frozen=True)
class Block:
    """One Python code block of a seed file."""

    source: str  # file name
    line: int  # 1-based line of its first code line
    code: str  # as written


def code_blocks(path: Path) -> list[Block]:
    """The Python code blocks of one seed file, in order.

    A fence line is ```` ``` ```` or `` ` `` alone, optionally with a language, possibly
    indented; an opening fence met inside a block closes that block (the collection has
    blocks that never close).
    """
    blocks: list[Block] = []
    lang: str | None = None  # None: outside a block
    start = 0
    body: list[str] = []

    def close() -> None:
        if lang in _PYTHON and body:
            blocks.append(Block(path.name, start, "\n".join(body)))

    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        match = _OPEN.match(raw.strip())
        if match is None:
            if lang is not None:
                body.append(raw)
            continue
        opener = match["lang"]
        if lang is None:
            lang, start, body = opener.lower(), number + 1, []
        elif opener:  # a new opening fence: the open block ends here
            close()
            lang, start, body = opener.lower(), number + 1, []
        else:
            close()
            lang = None
    if lang is not None:
        close()
    return blocks


def normalise(code: str) -> str:
    """Straight quotes, ``...`` for the ellipsis character, tabs as four spaces."""
    return code.translate(_CHARS).expandtabs(4)


_BLOCK_START = re.compile(
    r"^(if|elif|else|for|while|try|except|finally|with|def|class|async\s+def|async\s+for)\b"
)
_CONTINUES = re.compile(r"^(elif|else|except|finally)\b")
_ENDS_BODY = re.compile(r"^(return|raise|pass|continue|break)\b")


def _bracket_delta(line: str) -> int:
    """Opening minus closing brackets outside strings and comments (roughly)."""
    text = re.sub(r"('[^']*'|\"[^\"]*\")", "", line.split("#", 1)[0])
    return sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")


def reindent(code: str) -> str:
    """Rebuild lost indentation: a heuristic for the collection's flattened blocks.

    A statement ending in ``:`` that starts with a compound keyword opens a block (also when
    its brackets span lines); ``elif/else/except/finally`` go back to their statement's
    level; ``return/raise/pass/continue/break`` end the innermost block; ``def``/``class``/
    decorators go to the top level, or into the innermost class as methods; lines inside
    brackets keep the statement's level.
    """
    out: list[str] = []
    stack: list[tuple[str, int]] = []  # (keyword, level of the line that opened the block)
    level = depth = 0
    opener: str | None = None  # compound keyword of the statement being continued
    for raw in code.splitlines():
        line = raw.strip()
        if not line:
            continue
        if depth > 0:
            out.append("    " * (level + 1) + line)
            depth = max(depth + _bracket_delta(line), 0)
        else:
            level, stack = _place(line, level, stack, out)
            out.append("    " * level + line)
            depth = max(_bracket_delta(line), 0)
            match = _BLOCK_START.match(line)
            opener = match.group(1).split()[-1] if match else None
            if depth == 0 and opener is None and _ENDS_BODY.match(line) and stack:
                level = stack.pop()[1]
        if depth == 0 and opener is not None:
            if line.split("#", 1)[0].rstrip().endswith(":"):
                stack.append((opener, level))
                level += 1
            opener = None
    return "\n".join(out)


def _place(
    line: str, level: int, stack: list[tuple[str, int]], out: list[str]
) -> tuple[int, list[tuple[str, int]]]:
    """The level of a new statement line (and the open blocks after it)."""
    word = line.split("(")[0].split()[0]
    if _CONTINUES.match(line):
        while stack and stack[-1][0] not in ("if", "elif", "for", "while", "try", "except"):
            stack.pop()
        return (stack.pop()[1] if stack else 0), stack
    if word in ("def", "class", "async") or line.startswith("@"):
        classes = [lvl for kw, lvl in stack if kw == "class"]
        if word != "class" and classes:
            level = classes[-1] + 1
            return level, [(kw, lvl) for kw, lvl in stack if lvl < level]
        if not out or not out[-1].lstrip().startswith("@"):
            return 0, []
    if line.startswith("if __name__"):
        return 0, []
    return level, stack


_ELLIPSIS_ARG = re.compile(r",\s*\.\.\.\s*(?=[),])")
_PLACEHOLDER = re.compile(r"<([A-Za-z_][\w ]*)>")


def placeholders(code: str) -> str:
    """Pseudo-code made parseable: ``f(a=1, ...)`` -> ``f(a=1)``, ``<CONFIG>`` -> ``CONFIG``."""
    code = _ELLIPSIS_ARG.sub("", code)
    return _PLACEHOLDER.sub(lambda m: m.group(1).replace(" ", "_"), code)


def _longest_prefix(text: str) -> tuple[ast.Module, int] | None:
    """The longest prefix of ``text`` that parses, cut before each error; with its length."""
    lines = text.splitlines()
    for _ in range(len(lines)):
        try:
            return ast.parse("\n".join(lines)), len(lines)
        except SyntaxError as exc:
            cut = (exc.lineno or 1) - 1
            if cut < 1 or cut >= len(lines):
                cut = len(lines) - 1
            lines = lines[:cut]
            if not lines:
                return None
    return None


def parse(code: str) -> tuple[ast.Module | None, str]:
    """``(tree, how)``: how it parsed, or why not (``"unparseable: ..."``).

    Tried in order: as written; reindented (:func:`reindent`); with pseudo-code placeholders
    replaced (:func:`placeholders`). An unparseable block still gives the tree of its longest
    prefix that parses (the collection's blocks run into prose where a fence is missing).
    """
    text = normalise(code)
    attempts = [
        ("as written", lambda: textwrap.dedent(text)),
        ("reindented", lambda: reindent(text)),
        ("placeholders", lambda: reindent(placeholders(text))),
    ]
    error: SyntaxError | None = None
    for how, make in attempts:
        try:
            return ast.parse(make()), how
        except SyntaxError as exc:
            error = error or exc
    assert error is not None
    why = f"unparseable: {error.msg} (line {error.lineno})"
    prefix = _longest_prefix(reindent(placeholders(text)))
    if prefix is not None and prefix[0].body:
        return prefix[0], f"{why}; its first {prefix[1]} lines parse"
    return None, why


@dataclass(frozen=True, order=True)
class Ref:
    """One use of a ``colossalai`` name: ``import`` (a module), ``from`` or ``attr``."""

    dotted: str
    kind: str
    binding: str = ""  # for attr: the bound path the chain starts from


class _Collector(ast.NodeVisitor):
    def __init__(self) -> None:
        self.bindings: dict[str, str] = {}
        self.refs: set[Ref] = set()
        self.names: set[str] = set()
        self.config_launch = False

    def visit_Import(self, node: ast.Import) -> None:  # noqa: N802
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                self.refs.add(Ref(alias.name, "import"))
                if alias.asname:
                    self.bindings[alias.asname] = alias.name
                else:
                    self.bindings[PACKAGE] = PACKAGE

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        module = node.module or ""
        if node.level or module.split(".")[0] != PACKAGE:
            return
        for alias in node.names:
            if alias.name == "*":
                self.refs.add(Ref(module, "import"))
                continue
            self.refs.add(Ref(f"{module}.{alias.name}", "from"))
            self.bindings[alias.asname or alias.name] = f"{module}.{alias.name}"
            self.names.add(alias.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:  # noqa: N802
        chain: list[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.bindings:
            bound = self.bindings[base.id]
            self.refs.add(Ref(".".join([bound, *reversed(chain)]), "attr", bound))
            self.names.update(chain)
            return
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:  # noqa: N802
        self.names.add(node.id)

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called.startswith("launch") and (
            any(k.arg == "config" for k in node.keywords)
            or (node.args and not isinstance(node.args[0], ast.Constant | ast.Name))
        ):
            self.config_launch = True
        self.generic_visit(node)


def _config_file_keys(tree: ast.Module) -> bool:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id in CONFIG_KEYS for t in stmt.targets):
                return True
    return False


_IMPORT_LINE = re.compile(r"^(from\s+colossalai[\w.]*\s+import\s|import\s+colossalai\b)")
_DOTTED_USE = re.compile(r"\bcolossalai(?:\.\w+)+")


def _line_refs(code: str) -> tuple[set[Ref], set[str]]:
    """Refs of an unparseable block: its import statements one by one, and dotted uses."""
    collector = _Collector()
    lines = [ln.strip() for ln in normalise(code).splitlines()]
    for number, line in enumerate(lines):
        if not _IMPORT_LINE.match(line):
            continue
        statement = line
        rest = iter(lines[number + 1 :])
        while statement.count("(") > statement.count(")"):
            statement += " " + next(rest, ")")
        try:
            collector.visit(ast.parse(statement.rstrip("\\")))
        except SyntaxError:
            continue
    if PACKAGE in collector.bindings:
        for line in lines:
            if line.startswith("#") or _IMPORT_LINE.match(line):
                continue
            for dotted in _DOTTED_USE.findall(line.split("#", 1)[0]):
                collector.refs.add(Ref(dotted, "attr", PACKAGE))
    return collector.refs, collector.names


@dataclass
class Snippet:
    """One de-duplicated Python block, what it uses and how it parsed."""

    block: Block
    parse: str
    refs: tuple[Ref, ...]
    era: str  # "config", "booster" or "none" (no colossalai name, no config-era name)
    copies: int = 1
    unresolved: dict[str, str] = field(default_factory=dict)  # dotted -> error

    @property
    def id(self) -> str:
        """``file:line`` of the first copy."""
        return f"{Path(self.block.source).stem}:{self.block.line}"

    @property
    def parseable(self) -> bool:
        """Whether it parsed (as written or reindented)."""
        return not self.parse.startswith("unparseable")


def analyse(block: Block) -> Snippet:
    """Parse one block, collect its ``colossalai`` names and classify its era."""
    tree, how = parse(block.code)
    refs: set[Ref] = set()
    names: set[str] = set()
    config = False
    if tree is not None:
        collector = _Collector()
        collector.visit(tree)
        refs, names = collector.refs, collector.names
        config = collector.config_launch or _config_file_keys(tree)
    if how.startswith("unparseable"):  # also what the unparsed rest imports and uses
        line_refs, line_names = _line_refs(block.code)
        refs, names = refs | line_refs, names | line_names
        config = config or bool(re.search(r"launch\w*\(\s*config\s*=", normalise(block.code)))
    modules = {r.dotted.split(".")[1] for r in refs if r.dotted.count(".") >= 1}
    config = config or bool(names & CONFIG_NAMES) or bool(modules & CONFIG_MODULES)
    era = "config" if config else ("booster" if refs else "none")
    return Snippet(block, how, tuple(sorted(refs)), era)


def _walk(obj: object, attrs: list[str]) -> None:
    """Follow ``attrs`` from ``obj`` while it is a module (object attributes are not ours).

    An alias module serves its children itself; a plain module may need its submodule
    imported first, as Python's ``import a.b`` would have.
    """
    for attr in attrs:
        if not isinstance(obj, ModuleType):
            return
        if isinstance(obj, AliasModule) or hasattr(obj, attr):
            obj = getattr(obj, attr)
        else:
            obj = importlib.import_module(f"{obj.__name__}.{attr}")


def resolve(ref: Ref) -> None:
    """Resolve one name through the compat package, as the snippet's import would.

    Raises:
        ImportError, AttributeError: The name does not resolve (the compat package's message).
    """
    if ref.kind == "import":
        importlib.import_module(ref.dotted)
        return
    if ref.kind == "from":
        module, _, name = ref.dotted.rpartition(".")
        exec(f"from {module} import {name}", {})  # Python's own from-import semantics
        return
    bound = ref.binding
    if bound == PACKAGE:
        root: object = importlib.import_module(PACKAGE)
    else:
        module, _, name = bound.rpartition(".")
        scope: dict[str, object] = {}
        exec(f"from {module} import {name} as bound", scope)
        root = scope["bound"]
    _walk(root, ref.dotted[len(bound) + 1 :].split("."))


def check(snippet: Snippet) -> dict[str, str]:
    """Resolve every name of ``snippet``; returns the unresolved ones (dotted -> error)."""
    failed: dict[str, str] = {}
    for ref in snippet.refs:
        try:
            resolve(ref)
        except (ImportError, AttributeError) as exc:
            failed[ref.dotted] = f"{type(exc).__name__}: {exc}"
    return failed


def _all_blocks(directory: Path) -> Iterator[Block]:
    for path in sorted(directory.iterdir()):
        if path.suffix in (".md", ".txt") and path.name != "README.md":
            yield from code_blocks(path)


@cache
def snippets() -> tuple[tuple[Snippet, ...], int]:
    """``(de-duplicated snippets, number of Python blocks found)``; empty without seeds."""
    directory = seeds_dir()
    if directory is None:
        return (), 0
    found = list(_all_blocks(directory))
    unique: dict[str, Snippet] = {}
    for block in found:
        key = re.sub(r"\s+", "", normalise(block.code))
        if key in unique:
            unique[key].copies += 1
        else:
            unique[key] = analyse(block)
    return tuple(unique.values()), len(found)


def summary() -> dict[str, object]:
    """The counts the report needs (names are resolved here, once per process)."""
    items, found = snippets()
    for item in items:
        item.unresolved = check(item)
    relevant = [s for s in items if s.era != "none"]
    counts: dict[str, object] = {
        "python blocks found": found,
        "unique": len(items),
        "parse as written": sum(s.parse == "as written" for s in items),
        "parse reindented": sum(s.parse == "reindented" for s in items),
        "parse with placeholders": sum(s.parse == "placeholders" for s in items),
        "unparseable": sum(not s.parseable for s in items),
        "unparseable, a prefix parses": sum("lines parse" in s.parse for s in items),
    }
    for era in ("config", "booster"):
        mine = [s for s in relevant if s.era == era]
        counts[f"{era}-era snippets"] = len(mine)
        counts[f"{era}-era parseable"] = sum(s.parseable for s in mine)
        counts[f"{era}-era with colossalai names"] = sum(bool(s.refs) for s in mine)
        resolved = sum(bool(s.refs) and not s.unresolved for s in mine)
        counts[f"{era}-era all names resolved"] = resolved
    counts["unparseable snippets"] = [s.id for s in relevant if not s.parseable]
    counts["unresolved names"] = sorted({n for s in relevant for n in s.unresolved})
    return counts


if __name__ == "__main__":
    for key, value in summary().items():
        print(f"{key}: {value}")
