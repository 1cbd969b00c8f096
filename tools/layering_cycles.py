"""Import cycles in a module graph, for ``check_layering.py``'s ``cycle`` rule.

The graph has one node per module and one edge per module-level (non-lazy) import of another
module of the same distribution: the edge goes to the module the import names, or the module
a name is taken from. The implicit import of a module's parent packages is not an edge: Python
initialises a package before its submodules, so ``pkg/__init__.py`` importing ``pkg.a`` and
``pkg.a`` importing ``pkg.b`` is the normal layout, not a cycle. ``pkg.a`` importing a *name*
from ``pkg`` (``from pkg import helper``) is an edge to ``pkg``, and a cycle when ``pkg``
imports ``pkg.a``: whichever runs first sees the other half-initialised.

Standard library only; the strongly connected components come from Tarjan's algorithm
(iterative, so deep graphs do not hit the recursion limit).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


def strongly_connected(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module, each sorted.

    Args:
        graph: module -> {imported module: line of the import}.

    Returns:
        The components, sorted by their first module.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: Mapping[str, Mapping[str, int]], start: str) -> list[str]:
    """A shortest cycle through ``start`` (``[start, ..., start]``), or [] when there is none."""
    parents: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, {})):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if child not in parents:
                parents[child] = node
                queue.append(child)
    return []
