"""The package's import graph (grimp: every import statement, function-level ones too): no circle, and no arrow
running back up the layers models <- plans <- objectives/data <- hub <- training/evaluation/decoding/theory <- demo
<- cli. The root package (lazy public names, Auto registration) is the top; nothing below the command line imports
it (importing any submodule has run it already)."""

import grimp
import pytest

from hf_lookaround import objectives

PACKAGE = "hf_lookaround"
# high to low; the modules of one layer may import each other (independent=False)
LAYERS = (
    ("cli",),
    ("demo",),
    ("training", "evaluation", "decoding", "theory", "generation"),
    ("hub",),
    ("objectives", "data", "leakcheck"),
    ("plans",),
    ("models",),
)


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph(PACKAGE, exclude_type_checking_imports=True)


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                child = edges[node][i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if work:  # done with node: pass its low link to its parent
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
                    found.append(sorted(component))
    return found


def describe(graph, modules: list[str]) -> str:
    members = set(modules)
    arrows = []
    for importer in modules:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            lines = [d["line_number"] for d in graph.get_import_details(importer=importer, imported=imported)]
            arrows.append(f"{importer} -> {imported} (line {', '.join(map(str, lines))})")
    return "; ".join(arrows)


def test_the_circle_finder_finds_a_circle(graph):
    """The check can fail: a circle added to a copy of the graph is found, with its arrows."""
    importer, imported = f"{PACKAGE}.plans", f"{PACKAGE}.objectives.dar"  # dar imports plans
    assert not graph.direct_import_exists(importer=importer, imported=imported)
    graph.add_import(importer=importer, imported=imported, line_number=1, line_contents="from .objectives import dar")
    try:
        found = circles(graph)
        assert len(found) == 1 and {importer, imported} <= set(found[0])
        assert f"{importer} -> {imported} (line 1)" in describe(graph, found[0])
    finally:
        graph.remove_import(importer=importer, imported=imported)


def test_no_import_circle(graph):
    found = circles(graph)
    assert not found, "import circles: " + " | ".join(describe(graph, c) for c in found)


def test_no_arrow_runs_back_up_the_layers(graph):
    present = set(graph.modules)
    layers = [grimp.Layer(*(f"{PACKAGE}.{m}" for m in layer if f"{PACKAGE}.{m}" in present), independent=False)
              for layer in LAYERS]
    illegal = graph.find_illegal_dependencies_for_layers(layers=layers)
    assert not illegal, "arrows back up: " + "; ".join(
        f"{d.importer} -> {d.imported} via {[r.heads for r in d.routes]}" for d in illegal)


def test_only_the_command_line_imports_the_root_package(graph):
    importers = {m for m in graph.find_modules_that_directly_import(PACKAGE) if not m.startswith(f"{PACKAGE}.cli")}
    assert not importers, f"{sorted(importers)} import {PACKAGE} itself: import the module that defines the name"


@pytest.mark.parametrize("name", objectives.names())
def test_a_collator_draws_its_own_objectives_plan(name):
    """The collators sit below the table and draw through their plan function, not by name: it must be the
    objective's own (a subclass such as vmlm's must not inherit mlm's)."""
    entry = objectives.get(name)
    assert entry.collator.plan_function is entry.plan and entry.collator.objective == name
