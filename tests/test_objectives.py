"""The objectives table is the one list of objectives; the model bundle is self-contained remote code."""

import ast
import inspect
import sys
from pathlib import Path

import hf_lookaround as H
from hf_lookaround import objectives, plans
from hf_lookaround.models.lookaround import configuration_lookaround, generation_lookaround

BUNDLE = Path(generation_lookaround.__file__).parent
SRC = Path(H.__file__).parent


def test_every_objective_is_a_plan_with_a_family():
    assert plans.PLAN_NAMES == objectives.PLAN_NAMES == tuple(objectives.OBJECTIVES)
    for name, objective in objectives.OBJECTIVES.items():
        assert objective.family in objectives.FAMILIES
        assert callable(objective.plan) and objective.plan is getattr(plans, objective.plan_function)
        assert plans.make_plan(name, [30], 30, generator=None, **objective.defaults).group_ids.shape == (1, 30)


def test_the_bundles_frozen_facts_agree_with_the_table():
    """Remote code cannot import the package: its few objective facts must say what the table says."""
    look_ahead = objectives.names(objectives.LOOK_AHEAD)
    assert set(generation_lookaround.GROUP_DECODING_OBJECTIVES) == set(look_ahead)
    for name in look_ahead:
        assert objectives.OBJECTIVES[name].defaults.get("t", 1) == generation_lookaround.GROUP_DECODING_OBJECTIVES[name]
    assert set(configuration_lookaround.LEGACY_MASKED_OBJECTIVES) == set(objectives.names(objectives.MASKED))
    assert set(configuration_lookaround.LEGACY_QUERY_STREAM_OBJECTIVES) == set(
        objectives.names(objectives.LOOK_AHEAD, objectives.ANY_ORDER))


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
        elif isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
    return found


def test_the_bundle_imports_only_torch_transformers_and_its_siblings():
    siblings = {p.stem for p in BUNDLE.glob("*.py")}
    for path in BUNDLE.glob("*.py"):
        for level, module in _imports(path):
            if level:
                assert level == 1 and module.split(".")[0] in siblings, (path.name, module)
            else:
                top = module.split(".")[0]  # numpy: a dependency of transformers (the image processor's arrays)
                assert top in {"torch", "transformers", "numpy"} or top in sys.stdlib_module_names, (path.name, module)
        assert "argparse" not in path.read_text(), f"{path.name}: no CLI in remote code"


def test_the_package_has_no_import_circle():
    """Module-level imports between the package's modules form no cycle."""
    modules = {p.relative_to(SRC).with_suffix("").as_posix().replace("/", "."): p for p in SRC.rglob("*.py")}
    modules = {k.removesuffix(".__init__"): v for k, v in modules.items()}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.parse(path.read_text()).body:  # module level only (lazy imports inside functions are not)
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join(base + ([node.module] if node.module else []))
                candidates = [target] + [f"{target}.{a.name}" for a in node.names]
                edges |= {c for c in candidates if c in modules and c != name}
        graph[name] = edges
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in graph[node]:
            assert state.get(nxt) != "open", "import circle: " + " -> ".join(trail + [node, nxt])
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node, [])


def test_the_package_spells_no_objective_list_of_its_own():
    """Objective names appear as string literals only in the table (and the bundle's frozen facts, checked above)."""
    names = set(objectives.PLAN_NAMES)
    allowed = {SRC / "objectives.py", BUNDLE / "generation_lookaround.py", BUNDLE / "configuration_lookaround.py"}
    for path in SRC.rglob("*.py"):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                literals = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                assert len(names.intersection(literals)) < 2, f"{path.relative_to(SRC)}:{node.lineno} lists objectives"
    assert inspect.getsource(objectives).count("Objective(") >= len(names)
