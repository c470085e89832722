"""No module of edgesdk imports, directly or through others, a module that imports it back (imports inside
functions count too): the import-linter contracts order the layers and two packages' modules, this covers
every package, including the ones whose modules have no contract of their own."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules that
    import each other round."""
    modules = sorted(m for m in graph.modules if m.startswith(package))
    edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i.startswith(package) and i != m)
             for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for m in modules:
        if m not in index:
            visit(m)
    return found


def test_edgesdk_has_no_import_cycle():
    cycles = _cycles(grimp.build_graph("edgesdk"), "edgesdk.")
    assert not cycles, f"modules that import each other round: {cycles}"


def test_a_cycle_is_found():
    graph = grimp.ImportGraph()
    for m in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(m)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert _cycles(graph, "pkg.") == [["pkg.a", "pkg.b"]]
