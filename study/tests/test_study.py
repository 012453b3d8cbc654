"""The seeded study (study/study.py): resume, the grid, held-out passages, bundles. (The statistics and the report:
study/tests/test_study_report.py.)

The fixtures in study/tests/fixtures/ are the JSON files of a real `--smoke` grid (tiny preset, CPU, 5 objectives x
2 seeds, a sixth objective with a cell killed at the time limit and a partial one whose fine-tuning was skipped); ``expected_RESULTS.md`` is the report they gave
(regenerate both as study/tests/fixtures/README.md says after changing the report's format).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import study

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "study" / "tests" / "fixtures"


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------
# (resume of a finished grid: study/tests/test_study_runtime.py, on the new cells' JSON)


def test_resume_refuses_other_settings(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(FIXTURES / "tiny__ar__seed0.json", results)
    with pytest.raises(ValueError, match="other settings"):
        study.main(["--smoke", "--objectives", "ar", "--tokens", "999", "--results_dir", str(results),
                    "--work_dir", str(tmp_path / "work"), "--no_plots"])


def test_grid_order_is_seed_major_and_done_cells_are_found(tmp_path):
    cells = study.grid_cells(["small"], ["ar", "mlm-0.3"], [0, 1])
    assert cells == [("small", "ar", 0), ("small", "mlm-0.3", 0), ("small", "ar", 1), ("small", "mlm-0.3", 1)]
    shutil.copy(FIXTURES / "tiny__ar__seed0.json", tmp_path)
    for path in FIXTURES.glob("*__failed__*.json"):
        shutil.copy(path, tmp_path)  # a failure never counts as done
    partial = [p for p in FIXTURES.glob("*__seed*.json") if json.loads(p.read_text())["status"] == "partial"]
    shutil.copy(partial[0], tmp_path)  # a partial cell does, unless --redo_partial
    assert sorted(study.find_done(tmp_path)) == sorted(["tiny__ar__seed0", partial[0].stem])
    assert list(study.find_done(tmp_path, redo_partial=True)) == ["tiny__ar__seed0"]


def test_held_out_passages_are_cut_at_whitespace():
    text = "alpha beta gamma delta epsilon " * 20
    pieces = study.passages(text, 40)
    assert all(0 < len(p) <= 40 for p in pieces)
    assert " ".join(pieces).split() == text.split()  # nothing lost, no word split
    assert study._evenly_spaced(list(range(10)), 3) == [0, 4, 9]  # round(4.5) = 4
    assert study._evenly_spaced([1, 2], 5) == [1, 2]


def test_bundle_round_trip(tmp_path):
    # a GPU call's JSON also comes back as one gzipped bundle; --unbundle writes the files out again
    files = sorted(FIXTURES.glob("*.json"))
    study.write_bundle(tmp_path / "bundle__x.json.gz", files)
    out = study.main(["--unbundle", str(tmp_path / "bundle__x.json.gz"), "--results_dir", str(tmp_path / "r")])
    assert out == 0
    assert sorted(p.name for p in (tmp_path / "r").glob("*.json")) == [p.name for p in files]
    for path in files:
        assert json.loads((tmp_path / "r" / path.name).read_text()) == json.loads(path.read_text())
    text = study.build_report([tmp_path / "r"], tmp_path / "R.md", plots=False)
    assert text == (FIXTURES / "expected_RESULTS.md").read_text(encoding="utf-8")



# ---------------------------------------------------------------------------------------------
# the study uses the package as a user does
# ---------------------------------------------------------------------------------------------
def _private_uses_of_the_package(source: str) -> list[str]:
    """``from hf_lookaround... import _name`` and ``alias._name`` where ``alias`` was imported from hf_lookaround."""
    import ast

    found, aliases = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_lookaround":
            for name in node.names:
                if name.name.startswith("_"):
                    found.append(f"from {node.module} import {name.name}")
                aliases.add(name.asname or name.name)
        elif isinstance(node, ast.Import):
            aliases.update(n.asname or n.name.split(".")[0] for n in node.names if n.name.startswith("hf_lookaround"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_the_study_uses_the_packages_public_api_without_a_facade():
    modules = sorted((ROOT / "study").glob("*.py"))
    assert {"study.py", "study_cell.py", "study_curves_cell.py"} <= {p.name for p in modules}
    assert not (ROOT / "study" / "study_package.py").exists()
    private = {p.name: _private_uses_of_the_package(p.read_text(encoding="utf-8")) for p in modules}
    assert not {name: uses for name, uses in private.items() if uses}, "the study reaches into the package's privates"
    # the checker sees both forms
    assert _private_uses_of_the_package("from hf_lookaround.evaluation import perplexity as M\nM._pad_id(1, 2)\n"
                                        "from hf_lookaround.x import _y\n") == ["from hf_lookaround.x import _y",
                                                                                 "M._pad_id"]


def test_the_study_runs_rows_of_the_objectives_presets_and_its_driver_starts_without_torch():
    """Issue 38: the study keeps no table of its own; its rows are `objectives.presets()` rows, read on first use so
    that the driver and the report start without torch."""
    import os
    import subprocess
    import sys

    import study_common
    from hf_lookaround import objectives

    presets = objectives.presets()
    assert set(study_common.OBJECTIVES) <= set(presets)
    for row in study_common.OBJECTIVES:
        name, _, flags = presets[row]
        assert study_common.STUDY_OBJECTIVES[row] == {"objective": name, **flags}
    code = "import sys, study_common; assert 'torch' not in sys.modules, 'study_common imported torch'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "study"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT / "study")
