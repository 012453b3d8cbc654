"""Issue 42's C1 grid (4 x H100, commit 1a97a21): its committed bundles give docs/RESULTS.md byte for byte, and an
independent recompute (study/recompute_c1.py, gzip + json + scipy only) gives the report's analysis."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import recompute_c1 as rc
import study_curves_report as rep
from study_curves import load_protocol

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


def _report_analysis(bundles, n_boot=rep.N_BOOT):
    """The report's own analysis of the bundles: the last checkpoint's tests, verdicts and descriptive tests."""
    protocol = load_protocol(C1_PROTOCOL)
    kept, _ = rep.apply_rule(rep.merge_bundles(bundles), protocol)
    checkpoints = rep.by_checkpoint(kept, protocol)
    results = rep.analyse(checkpoints, protocol, n_boot)[protocol["checkpoint_tokens"][-1]]
    rules = rep.rules_of(protocol)
    verdicts = {c: rep.verdict([r["outcome"] for r in results if r["claim"] == c], rules)
                for c in dict.fromkeys(r["claim"] for r in results)}
    group = checkpoints[protocol["checkpoint_tokens"][-1]]
    descriptive = [rep.run_test(group, t, None) for t in protocol["tests"]["descriptive"]]
    return results, verdicts, descriptive


def _assert_same(mine, report, boot_tolerance, descriptive_too=True):
    results, verdicts, descriptive = report
    assert mine["verdicts"] == verdicts
    assert len(mine["tests"]) == len(results) == 3
    for r, theirs in zip(mine["tests"], results):
        assert (r["claim"], r["a"], r["b"], r["measure"]) == (theirs["claim"], theirs["a"], theirs["b"], theirs["measure"])
        assert r["n"] == theirs["n"] and r["outcome"] == theirs["outcome"] and r["called"] == theirs["called"]
        if r["has_data"]:
            assert abs(r["mean"] - theirs["mean"]) < 1e-9
            assert abs(r["p_holm"] - theirs["p_holm"]) < 1e-6
            # the bootstrap has its own random stream: the interval moves by Monte Carlo error (the calls are compared)
            assert abs(r["boot_low"] - theirs["boot_low"]) < boot_tolerance
            assert abs(r["boot_high"] - theirs["boot_high"]) < boot_tolerance
        else:
            assert math.isnan(theirs["p_holm"])
    for r, theirs in zip(mine["descriptive"] if descriptive_too else [], descriptive):
        assert r["n"] == theirs["n"]
        assert abs(r["mean"] - theirs["mean"]) < 1e-9 and abs(r["p"] - theirs["p"]) < 1e-6


def test_the_independent_recompute_gives_the_reports_analysis():
    mine = rc.recompute(BUNDLES, C1_PROTOCOL)
    assert mine["cells"] == 24 and mine["dropped"] == [] and mine["n_boot"] == 2000 and mine["seed"] == 0
    # the scores recomputed from the predictions are the records' stored scores (rounded to 5 decimals there)
    assert mine["max_difference_from_stored_scores"] < 1e-5
    _assert_same(mine, _report_analysis(BUNDLES), boot_tolerance=1e-3)
    assert mine["verdicts"] == {"C1": "cannot tell", "C1s": "cannot tell", "P": "cannot tell"}


def test_the_recompute_and_the_report_agree_when_a_cell_lacks_its_fine_tuning(tmp_path):
    # the last bundle without dar-t2 seed 3's fine-tuning record: C1 and P lose their test (every seed is required)
    with gzip.open(BUNDLES[-1], "rt", encoding="utf-8") as handle:
        bundle = json.load(handle)
    del bundle["records"]["small__dar-t2__seed3__finetune.json"]
    lost = tmp_path / "lost.json.gz"
    with gzip.open(lost, "wt", encoding="utf-8") as handle:
        json.dump(bundle, handle)
    mine = rc.recompute([str(lost)], C1_PROTOCOL, n_boot=200)
    assert mine["cells"] == 23
    # the protocol's rule drops a cell without its fine-tuning from everything, its probes too (n 7 in both)
    _assert_same(mine, _report_analysis([str(lost)], n_boot=200), boot_tolerance=3e-3)
    assert [r["n"] for r in mine["descriptive"]] == [7, 7, 8, 8]
    assert mine["verdicts"]["C1"] == "no data" and mine["verdicts"]["P"] == "no data"
    assert [r["n"] for r in mine["tests"]] == [7, 8, 7]
