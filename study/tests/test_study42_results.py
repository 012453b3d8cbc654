"""Issue 42's C1 grid (4 x H100, commit 1a97a21): its committed bundles give docs/RESULTS.md byte for byte, and an
independent recompute (study/recompute_c1.py, gzip + json + scipy only) gives the report's analysis."""

from __future__ import annotations

from pathlib import Path

import study_curves_report as rep

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "docs" / "results" / "study42"
C1_PROTOCOL = ROOT / "study" / "study_protocol_c1.json"
BUNDLES = [str(STUDY / f"curves__part1__c1p1c{i}.json.gz") for i in (1, 2, 3)]


def test_the_committed_bundles_are_the_three_commands():
    assert sorted(p.name for p in STUDY.glob("curves__*.json.gz")) == [Path(b).name for b in BUNDLES]


def test_docs_results_md_is_the_c1_report_of_the_committed_bundles(tmp_path):
    # docs/RESULTS.md is generated: the three bundles give it byte for byte (plot links into docs/results/study42)
    out = tmp_path / "docs" / "RESULTS.md"
    rep.build_report(BUNDLES, out, tmp_path / "docs" / "results" / "study42", C1_PROTOCOL)
    assert out.read_text(encoding="utf-8") == (ROOT / "docs" / "RESULTS.md").read_text(encoding="utf-8")
    # and the copy beside the bundles, its plot links local
    local = tmp_path / "docs" / "results" / "study42" / "RESULTS.md"
    rep.build_report(BUNDLES, local, local.parent, C1_PROTOCOL)
    assert local.read_text(encoding="utf-8") == (STUDY / "RESULTS.md").read_text(encoding="utf-8")
