"""The objectives table is the one list of objectives; the model bundle is self-contained remote code."""

import ast
import importlib
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.models.lookaround import configuration_lookaround, decoding_lookaround

BUNDLE = Path(decoding_lookaround.__file__).parent
SRC = Path(H.__file__).parent


def test_every_objective_module_is_in_the_table_with_a_family():
    modules = {p.stem for p in (SRC / "objectives").glob("*.py")} - {"__init__", "base"}
    assert set(objectives.PLAN_NAMES) == modules and objectives.PLAN_NAMES == tuple(objectives.OBJECTIVES)
    order = [(objectives.FAMILIES.index(o.family), o.name) for o in objectives.OBJECTIVES.values()]
    assert order == sorted(order)  # by family, then by name
    for name, objective in objectives.OBJECTIVES.items():
        assert objective.family in objectives.FAMILIES
        module = importlib.import_module(f"hf_lookaround.objectives.{name}")
        assert module.OBJECTIVE is objective and objective.plan is module.plan
        assert objectives.make_plan(name, [30], 30, generator=None, **objective.defaults).group_ids.shape == (1, 30)


def test_a_look_ahead_config_records_its_plans_default_group_size():
    """What a checkpoint decodes is recorded from its objective's Params (``config_fields``): every look-ahead
    objective of the table records its plan's default group size, and the bundle's decoders read it there."""
    for name in objectives.names(objectives.LOOK_AHEAD):
        fields = objectives.OBJECTIVES[name].Params().config_fields()
        config = SimpleNamespace(objective=name, plan_params={}, **fields)
        default_t = objectives.OBJECTIVES[name].defaults.get("t", 1)
        assert decoding_lookaround.trained_group_sizes(config) == (default_t,), name


def test_a_legacy_look_ahead_config_without_plan_params_decodes_with_its_plans_default_group_size():
    """Configs written before ``decoding_group_sizes`` fall back to the bundle's frozen table: history, which
    objectives added since never join; every name in it is still a look-ahead objective with that default t."""
    for name, t in decoding_lookaround.LEGACY_GROUP_DECODING_OBJECTIVES.items():
        assert name in objectives.names(objectives.LOOK_AHEAD)
        config = SimpleNamespace(objective=name, plan_params={})
        default_t = objectives.OBJECTIVES[name].defaults.get("t", 1)
        assert t == default_t and decoding_lookaround.trained_group_sizes(config) == (default_t,), name


def test_the_legacy_stream_tuples_name_objectives_of_their_family():
    # the LEGACY_* tuples describe configs written before `prediction_stream` existed: frozen history, which
    # objectives added since (span) never join; every name in them is still an objective of that family
    assert set(configuration_lookaround.LEGACY_MASKED_OBJECTIVES) <= set(objectives.names(objectives.MASKED))
    assert set(configuration_lookaround.LEGACY_QUERY_STREAM_OBJECTIVES) <= set(
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


def objective_lists(source: str, names: set[str]) -> list[int]:
    """Lines of ``source`` where a tuple, list, set or dict (its keys or its values, a literal or ``dict(ar=...)``)
    names two objectives or more."""
    found = []
    for node in ast.walk(ast.parse(source)):
        keywords = set()
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elements = node.elts
        elif isinstance(node, ast.Dict):
            elements = [*node.keys, *node.values]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            elements, keywords = [kw.value for kw in node.keywords], {kw.arg for kw in node.keywords}
        else:
            continue
        literals = keywords | {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        if len(names & literals) >= 2:
            found.append(node.lineno)
    return found


def test_the_guard_sees_dict_tables_too():
    names = {"ar", "dar", "mlm"}
    assert objective_lists('COLLATORS = {"ar": A, "dar": B}', names) == [1]
    assert objective_lists('x = {"ar": {"t": 1}, "k": "dar"}', names) == [1]
    assert objective_lists('ORDER = ("ar", "dar")', names) == [1]
    assert objective_lists('one = {"ar": 1}; other = "dar"', names) == []
    assert objective_lists('TABLE = dict(ar=A, dar=B)', names) == [1]
    assert objective_lists('f(ar=1, dar=2)', names) == []  # keywords of a call: not a table


def test_the_package_spells_no_objective_list_of_its_own():
    """Objective names appear together only in the objective modules (a mixture names its components) and the
    bundle's frozen facts about configs written before a field existed."""
    names = set(objectives.PLAN_NAMES)
    allowed = {BUNDLE / "decoding_lookaround.py", BUNDLE / "configuration_lookaround.py"}
    for path in SRC.rglob("*.py"):
        if path in allowed or path.parent == SRC / "objectives":
            continue
        assert objective_lists(path.read_text(), names) == [], f"{path.relative_to(SRC)} lists objectives"
