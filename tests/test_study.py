"""The seeded study (benchmarks/study.py): the statistics rule, the report rebuilt from committed JSON, resume.

The fixtures in tests/fixtures/study/ are the JSON files of a real `--smoke` grid (tiny preset, CPU, 5 objectives x
2 seeds, a sixth objective with a cell killed at the time limit and a partial one whose fine-tuning was skipped); ``expected_RESULTS.md`` is the report they gave
(regenerate both as tests/fixtures/study/README.md says after changing the report's format).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study  # noqa: E402
from study_stats import mean, paired_comparison, sd  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "study"


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def test_mean_and_sd_match_the_statistics_module():
    values = [0.71, 0.69, 0.745, 0.7]
    assert mean(values) == pytest.approx(statistics.fmean(values))
    assert sd(values) == pytest.approx(statistics.stdev(values))
    assert math.isnan(sd([1.0]))
    with pytest.raises(ValueError):
        mean([])


def test_paired_t_matches_scipy():
    from scipy import stats

    a, b = [0.81, 0.79, 0.84, 0.80], [0.78, 0.77, 0.80, 0.79]
    r = paired_comparison(a, b)
    ref = stats.ttest_rel(a, b)
    assert r.t == pytest.approx(ref.statistic)
    assert r.p_t == pytest.approx(ref.pvalue)
    assert r.mean_diff == pytest.approx(statistics.fmean([x - y for x, y in zip(a, b)]))
    # the interval is mean +- t_{0.975, n-1} sd / sqrt(n)
    half = stats.t.ppf(0.975, 3) * r.sd_diff / 2
    assert (r.ci_low, r.ci_high) == pytest.approx((r.mean_diff - half, r.mean_diff + half))


def test_the_rule_calls_clear_differences_only():
    # consistent and large against the spread: called, with its direction
    r = paired_comparison([5.0, 5.2, 5.1], [4.0, 4.1, 4.05])
    assert r.called and r.direction == 1 and r.p_t < 0.05
    assert paired_comparison([4.0, 4.1, 4.05], [5.0, 5.2, 5.1]).direction == -1
    # same sign but small against the spread (3 seeds: needs |mean| > 2.48 sd): not called
    r = paired_comparison([1.0, 1.0, 1.0], [0.9, 0.99, 0.5])
    assert r.same_sign and not r.called and r.direction == 0
    # the interval excludes 0 but one seed goes the other way: not called
    r = paired_comparison([10.0, 10.0, 10.0, 10.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.1])
    assert r.ci_low > 0 and not r.same_sign and not r.called
    # one seed: never called; identical differences: called (zero spread)
    assert not paired_comparison([2.0], [1.0]).called
    assert paired_comparison([2.0, 3.0], [1.0, 2.0]).called
    assert not paired_comparison([1.0, 2.0], [1.0, 2.0]).called


def test_sign_test_p_is_exact():
    assert paired_comparison([1, 2, 3], [0, 0, 0]).p_sign == pytest.approx(0.25)  # 2 * (1/2)^3
    assert paired_comparison([1, 2, 3, 4, 5, 6], [0] * 6).p_sign == pytest.approx(2 / 64)
    with pytest.raises(ValueError, match="same seeds"):
        paired_comparison([1, 2], [1])


# ---------------------------------------------------------------------------------------------
# the report from committed JSON
# ---------------------------------------------------------------------------------------------
def test_report_is_regenerated_exactly_from_the_committed_json(tmp_path):
    text = study.build_report([FIXTURES], tmp_path / "RESULTS.md", plots=False)
    expected = (FIXTURES / "expected_RESULTS.md").read_text(encoding="utf-8")
    assert text == expected
    assert (tmp_path / "RESULTS.md").read_text(encoding="utf-8") == expected


def _cells():
    cells = []
    for path in sorted(FIXTURES.glob("*__seed*.json")):
        data = json.loads(path.read_text())
        if data["status"] in ("ok", "partial"):
            cells.append(data)
    return cells


def _row(text: str, heading: str, objective: str) -> list[str]:
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    for line in section.splitlines():
        if line.startswith(f"| {objective} |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no row {objective} under {heading}")


def test_report_numbers_equal_an_independent_computation(tmp_path):
    text = study.build_report([FIXTURES], tmp_path / "RESULTS.md", plots=False)
    cells = _cells()
    objectives = sorted({c["objective"] for c in cells})
    assert len(objectives) >= 4 and len({c["seed"] for c in cells}) >= 2  # the fixture is a real grid
    for objective in objectives:
        mine = [c for c in cells if c["objective"] == objective]
        # probe average: mean over the four tasks per seed, then mean ± sd over seeds
        averages = [statistics.fmean(c["probe"][t]["test"] for t in study.TASKS) for c in mine]
        expected = f"{statistics.fmean(averages):.3f} ± {statistics.stdev(averages):.3f}"
        assert _row(text, "### Linear probes", objective)[-1] == expected
        # natural-protocol perplexity on each set and the geometric mean over sets
        protocol = "ar_plan" if objective in ("ar", "dar-t2") else "masked_prefix"
        row = _row(text, "### Held-out perplexity, natural protocol", objective)
        assert row[2] == protocol.replace("_", " ")
        for column, name in zip(row[3:6], study.TEXT_SETS):
            ppl = [c["perplexity"]["sets"][name][protocol]["perplexity"] for c in mine]
            assert column == f"{statistics.fmean(ppl):.1f} ± {statistics.stdev(ppl):.1f}"
        geo = [math.exp(statistics.fmean(c["perplexity"]["sets"][n][protocol]["nll"] for n in study.TEXT_SETS))
               for c in mine]
        assert row[6] == f"{statistics.fmean(geo):.1f} ± {statistics.stdev(geo):.1f}"
    # C4's first comparison: the paired mean difference of the probe averages, mlm-0.15 - ar
    by = {(c["objective"], c["seed"]): c for c in cells}
    seeds = sorted(s for (o, s) in by if o == "ar" and ("mlm-0.15", s) in by)
    diffs = [statistics.fmean(by["mlm-0.15", s]["probe"][t]["test"] for t in study.TASKS)
             - statistics.fmean(by["ar", s]["probe"][t]["test"] for t in study.TASKS) for s in seeds]
    assert f"- probe average score, mlm-0.15 − ar: {statistics.fmean(diffs):+.4f} (95 % CI" in text
    # a partial cell (fine-tuning skipped for time) counts in the probe table but not in the fine-tuning tables
    partial = [c for c in cells if c["status"] == "partial"]
    assert partial, "the fixture holds a partial cell"
    for cell in partial:
        mine = [c for c in cells if c["objective"] == cell["objective"]]
        complete = [c for c in mine if all(t in c["finetune"]["full"] for t in study.TASKS)]
        assert len(complete) < len(mine)
        assert _row(text, "### Linear probes", cell["objective"])[1] == str(len(mine))
        row = _row(text, "### Full fine-tuning", cell["objective"])
        assert row[1] == str(len(complete))
        averages = [statistics.fmean(c["finetune"]["full"][t]["validation"] for t in study.TASKS) for c in complete]
        assert row[-1] == f"{statistics.fmean(averages):.3f} ± {statistics.stdev(averages):.3f}"


def test_report_lists_failures_cost_and_verdicts(tmp_path):
    text = study.build_report([FIXTURES], tmp_path / "RESULTS.md", plots_dir=tmp_path / "plots")
    failures = [json.loads(p.read_text()) for p in FIXTURES.glob("*__failed__*.json")]
    assert failures, "the fixture holds a failed cell"
    for f in failures:
        assert f"| {f['key']} | {f['run_label']} | {f['status']}" in text
    for c in _cells():
        if c["status"] == "partial":
            assert f"| {c['key']} | {c['run_label']} | {', '.join(c['finetune']['skipped'])} |" in text
    for claim in ("C1.", "C2.", "C3.", "C4."):
        line = next(l for l in text.splitlines() if l.startswith(f"**{claim}"))
        assert line.endswith((": holds.**", ": does not hold.**", ": cannot tell at this scale.**"))
    # cost: the cell-minutes of each run label are the sum of its cells' wall times
    cells = _cells() + failures
    for label in {c["run_label"] for c in cells}:
        minutes = sum(c["wall_seconds"] for c in cells if c["run_label"] == label) / 60
        assert any(l.startswith(f"| {label} |") and f"| {minutes:.1f} |" in l for l in text.splitlines())
    assert (tmp_path / "plots" / "ppl_by_prefix_tiny.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "probe_tiny.png").stat().st_size > 1000
    assert "](plots/ppl_by_prefix_tiny.png)" in text


def test_verdicts_follow_the_rule():
    def cmp(direction, n=3):
        return {"n": n, "called": direction != 0, "direction": direction}

    assert study.verdict([study.outcome(cmp(1), 1), study.outcome(cmp(-1), -1)]) == "holds"
    assert study.verdict([study.outcome(cmp(1), 1), study.outcome(cmp(0), 1)]) == "cannot tell at this scale"
    assert study.verdict([study.outcome(cmp(1), 1), study.outcome(cmp(1), -1)]) == "does not hold"
    assert study.verdict([study.outcome(cmp(1, n=1), 1)]) == "cannot tell at this scale"
    assert study.verdict([study.outcome(None, 1)]) == "cannot tell at this scale"


def test_report_refuses_cells_of_different_settings(tmp_path):
    for path in FIXTURES.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    cell = next(tmp_path.glob("tiny__ar__seed0.json"))
    data = json.loads(cell.read_text())
    data["settings_id"] = "another"
    cell.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="different settings"):
        study.build_report([tmp_path], tmp_path / "out.md", plots=False)


# ---------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------
# (resume of a finished grid: tests/test_study_runtime.py, on the new cells' JSON)


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


def test_committed_results_md_is_the_report_of_the_committed_gpu_json(tmp_path):
    # docs/RESULTS.md must be exactly what --report makes of docs/results/study/ (JSON and NOTES.md)
    results = ROOT / "docs" / "results" / "study"
    committed = ROOT / "docs" / "RESULTS.md"
    assert sorted(results.glob("*__seed*.json")), "the GPU grid's JSON is committed"
    out = tmp_path / "docs" / "RESULTS.md"  # the same layout, so the plot links come out the same
    text = study.build_report([results], out, plots_dir=tmp_path / "docs" / "results" / "study")
    assert text == committed.read_text(encoding="utf-8")
