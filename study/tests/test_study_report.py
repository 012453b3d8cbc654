"""The seeded study's statistics and report (study/study_stats.py, study/study_report.py).

Offline and fast: the statistics on hand-computed and simulated values; the report on synthetic cells of the
issue-18 schema (per-passage NLL, per-example probe and fine-tuning predictions, the sweep, run summaries), on the
smoke-grid fixtures, on the committed first GPU grid (the old schema, no per-example data) and on issue 18's GPU
grid, whose report is docs/results/study18/RESULTS.md.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest

import study_report as report
from study_stats import (accuracy_metric, bootstrap_indices, holm, mean, paired_bootstrap,
                         paired_comparison, pearson_metric, power_paired_t, ratio_metric, sd, seeds_for_power)

ROOT = Path(__file__).resolve().parents[2]

FIXTURES = ROOT / "study" / "tests" / "fixtures"
FIRST_GRID = ROOT / "docs" / "results" / "study"  # the first GPU grid (old schema)
GPU_RESULTS = ROOT / "docs" / "results" / "study18"  # issue 18's grid: RESULTS.md there is its report


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


def test_paired_t_matches_scipy_and_tests_a_margin():
    from scipy import stats

    a, b = [0.81, 0.79, 0.84, 0.80], [0.78, 0.77, 0.80, 0.79]
    r = paired_comparison(a, b)
    ref = stats.ttest_rel(a, b)
    assert r.t == pytest.approx(ref.statistic)
    assert r.p_t == pytest.approx(ref.pvalue)
    half = stats.t.ppf(0.975, 3) * r.sd_diff / 2
    assert (r.ci_low, r.ci_high) == pytest.approx((r.mean_diff - half, r.mean_diff + half))
    # against a margin: the one-sample t-test of d - margin
    m = paired_comparison(a, b, null=0.05)
    ref = stats.ttest_1samp([x - y - 0.05 for x, y in zip(a, b)], 0.0)
    assert m.p_t == pytest.approx(ref.pvalue) and m.null == 0.05
    with pytest.raises(ValueError, match="same seeds"):
        paired_comparison([1, 2], [1])


def test_the_old_called_field_and_the_sign_test():
    # paired_comparison's own `called` (interval excludes 0 and every difference has the same sign) is kept for
    # information; the report's rule is report.decide (Holm and the bootstrap)
    r = paired_comparison([5.0, 5.2, 5.1], [4.0, 4.1, 4.05])
    assert r.called and r.direction == 1 and r.p_t < 0.05
    r = paired_comparison([10.0, 10.0, 10.0, 10.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.1])
    assert r.ci_low > 0 and not r.same_sign and not r.called
    assert not paired_comparison([2.0], [1.0]).called
    assert paired_comparison([1, 2, 3], [0, 0, 0]).p_sign == pytest.approx(0.25)  # 2 * (1/2)^3
    assert paired_comparison([1, 2, 3, 4, 5, 6], [0] * 6).p_sign == pytest.approx(2 / 64)


def test_holm_against_a_hand_computed_example():
    # sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04 -> monotone: 0.06)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1; NaN (no test) keeps its place and does not count in the family
    out = holm([0.6, float("nan"), 0.02, 0.7])  # m = 3: 0.06, min(1, 1.2) = 1, max(1, 0.7) = 1
    assert math.isnan(out[1]) and [out[0], out[2], out[3]] == pytest.approx([1.0, 0.06, 1.0])
    assert holm([]) == []


def test_power_of_the_paired_t_test_against_known_values():
    # pwr::pwr.t.test(n = 8, d = 1, type = "paired") = 0.6808; n = 10: 0.8031 (G*Power gives the same)
    assert power_paired_t(1.0, 1.0, 8) == pytest.approx(0.6808, abs=5e-4)
    assert power_paired_t(1.0, 1.0, 10) == pytest.approx(0.8031, abs=5e-4)
    assert power_paired_t(0.5, 0.5, 10) == pytest.approx(0.8031, abs=5e-4)  # only d = effect / sd matters
    assert power_paired_t(-1.0, 1.0, 10) == pytest.approx(0.8031, abs=5e-4)
    assert power_paired_t(1.0, 1.0, 8, alpha=0.01) < power_paired_t(1.0, 1.0, 8)
    assert seeds_for_power(1.0, 1.0) == 10
    assert math.isnan(power_paired_t(1.0, float("nan"), 8)) and math.isnan(power_paired_t(1.0, 1.0, 1))
    # deep in the tail scipy's nct can give NaN; the power must stay a number
    assert power_paired_t(0.019, 0.004, 3) == pytest.approx(0.965, abs=2e-3)
    # and a simulation of the t-test itself agrees
    from scipy import stats

    rng = np.random.default_rng(0)
    d = rng.normal(1.0, 1.0, size=(20000, 8))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(8))
    assert np.mean(np.abs(t) > stats.t.ppf(0.975, 7)) == pytest.approx(0.6808, abs=0.015)


def test_bootstrap_is_seeded_and_covers_the_true_difference():
    rng = np.random.default_rng(1)
    n = 600
    labels = rng.integers(0, 3, n)
    # two classifiers with true accuracies 0.80 and 0.70 on the same examples
    covered, widths = 0, []
    for trial in range(40):
        ok_a, ok_b = rng.random(n) < 0.8, rng.random(n) < 0.7
        pa, pb = np.where(ok_a, labels, (labels + 1) % 3), np.where(ok_b, labels, (labels + 2) % 3)
        fa, fb = accuracy_metric(pa, labels), accuracy_metric(pb, labels)
        r = paired_bootstrap([lambda I: fa(I[0]) - fb(I[0])], [n], n_boot=400, seed=trial)
        assert r.estimate == pytest.approx(ok_a.mean() - ok_b.mean())
        covered += r.low <= 0.1 <= r.high
        widths.append(r.high - r.low)
    assert covered >= 34  # 95 % intervals: about 38 of 40
    assert 0.04 < mean(widths) < 0.1  # sd of the difference ~ sqrt(.16/600 + .21/600) = 0.025
    # seeded: the same seed, the same interval; another seed, another draw
    r1 = paired_bootstrap([lambda I: fa(I[0]) - fb(I[0])], [n], n_boot=300, seed=7)
    r2 = paired_bootstrap([lambda I: fa(I[0]) - fb(I[0])], [n], n_boot=300, seed=7)
    r3 = paired_bootstrap([lambda I: fa(I[0]) - fb(I[0])], [n], n_boot=300, seed=8)
    assert (r1.low, r1.high) == (r2.low, r2.high) and (r1.low, r1.high) != (r3.low, r3.high)
    assert [i.tolist() for i in bootstrap_indices([5, 3], 4, 2)] == [i.tolist() for i in bootstrap_indices([5, 3], 4, 2)]


def test_bootstrap_of_pearson_and_of_nll_per_token():
    rng = np.random.default_rng(2)
    y = rng.normal(size=800)
    pa, pb = y + rng.normal(scale=1.0, size=800), y + rng.normal(scale=2.0, size=800)
    fa, fb = pearson_metric(pa, y), pearson_metric(pb, y)
    r = paired_bootstrap([lambda I: fa(I[0]) - fb(I[0])], [800], n_boot=500, seed=0)
    true = 1 / math.sqrt(2) - 1 / math.sqrt(5)  # corr(y + e, y) = 1 / sqrt(1 + var e)
    assert r.estimate == pytest.approx(np.corrcoef(pa, y)[0, 1] - np.corrcoef(pb, y)[0, 1])
    assert r.low < true < r.high
    # NLL per token, passages resampled: ratio of sums, per set, sets averaged; two seeds pooled
    tokens = rng.integers(50, 150, size=40)
    seeds = []
    for _ in range(2):
        na, nb = tokens * (5.0 + rng.normal(0, 0.3, 40)), tokens * (5.2 + rng.normal(0, 0.3, 40))
        ga, gb = ratio_metric(na, tokens), ratio_metric(nb, tokens)
        seeds.append((na, nb, lambda I, ga=ga, gb=gb: ga(I[0]) - gb(I[0])))
    r = paired_bootstrap([s[2] for s in seeds], [40], n_boot=500, seed=0)
    direct = mean([s[0].sum() / tokens.sum() - s[1].sum() / tokens.sum() for s in seeds])
    assert r.estimate == pytest.approx(direct)
    assert r.low < -0.2 < r.high and r.high < 0 and r.excludes()


# ---------------------------------------------------------------------------------------------
# synthetic cells of the issue-18 schema
# ---------------------------------------------------------------------------------------------
SETS = ("gutenberg", "bbc")
N_PASSAGES, N_TEST = 24, 400
BUCKETS = [(0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 127)]


def make_cell(objective: str, seed: int, *, level=5.0, gap=1.0, probe=0.7, full=0.72, noise=0.01,
              preset="syn", run_label="syn-a", rng=None) -> dict:
    """One cell's JSON: NLL `level` at long prefixes and `level + gap` at short ones (natural protocol; the other
    protocol 0.01 worse), probe / fine-tuning accuracy about `probe` / `full`; seed-level noise of sd `noise`."""
    rng = rng or np.random.default_rng(seed)
    natural = "ar_plan" if objective in ("ar", "dar-t2", "mix-dar12-vmlm") else "masked_prefix"
    shift = rng.normal(0, noise)
    passage_rng = np.random.default_rng(1000 + seed)  # passage difficulty: shared by every objective of a seed
    tokens = passage_rng.integers(80, 160, N_PASSAGES)
    difficulty = passage_rng.normal(0, 0.3, N_PASSAGES)
    sets = {}
    for name in SETS:
        sets[name] = {}
        for protocol in ("masked_prefix", "ar_plan"):
            extra = 0.0 if protocol == natural else 0.01
            short_t, long_t = np.full(N_PASSAGES, 16), tokens - 64
            long_v = level + shift + extra + difficulty + rng.normal(0, 0.05, N_PASSAGES)
            short_v = long_v + gap + rng.normal(0, 0.05, N_PASSAGES)
            mid_t = tokens - short_t - long_t
            nll_sum = short_v * short_t + long_v * long_t + long_v * mid_t
            total = float(nll_sum.sum() / tokens.sum())
            short_nll, long_nll = float((short_v * short_t).sum() / short_t.sum()), float((long_v * long_t).sum() / long_t.sum())
            buckets = []
            for lo, hi in BUCKETS:
                n = int(N_PASSAGES * (hi - lo + 1)) if hi < 64 else int(long_t.sum())
                nll = short_nll if hi <= 15 else long_nll
                buckets.append({"prefix_length_min": lo, "prefix_length_max": hi, "num_tokens": n, "nll": nll,
                                "perplexity": math.exp(nll)})
            sets[name][protocol] = {
                "nll": total, "perplexity": math.exp(total), "num_tokens": int(tokens.sum()), "num_passages": N_PASSAGES,
                "by_prefix_length": buckets,
                "per_passage": {"nll_sum": nll_sum.tolist(), "tokens": tokens.tolist(),
                                "short_nll_sum": (short_v * short_t).tolist(), "short_tokens": short_t.tolist(),
                                "long_nll_sum": (long_v * long_t).tolist(), "long_tokens": long_t.tolist()}}

    def scored(task, accuracy):
        task_rng = np.random.default_rng(report.TASKS.index(task))  # the same test examples for every cell
        if task == "vader_movie":
            labels = task_rng.normal(size=N_TEST)
            r = min(0.95, max(0.05, accuracy - 0.4 + rng.normal(0, noise)))
            preds = r * labels + math.sqrt(1 - r * r) * rng.normal(size=N_TEST)
            score, metric = float(np.corrcoef(preds, labels)[0, 1]), "pearson"
        else:
            labels = task_rng.integers(0, 2, N_TEST)
            ok = rng.random(N_TEST) < accuracy + rng.normal(0, noise)
            preds = np.where(ok, labels, 1 - labels)
            score, metric = float(np.mean(preds == labels)), "accuracy"
        return {"metric": metric, "test": score, "validation": score, "test_predictions": preds.tolist(),
                "test_labels": labels.tolist()}

    probes = {t: {**scored(t, probe), "sizes": {s: {"used": N_TEST} for s in ("train", "validation", "test")}}
              for t in report.TASKS}
    full_ft = {t: {**scored(t, full), "lr_grid": [1e-4, 3e-4], "validation_by_lr": {"0.0001": 0.6, "0.0003": 0.7},
                   "learning_rate": 3e-4, "epochs": 1.0, "seconds": 3.0} for t in report.TASKS}
    return {
        "key": f"{preset}__{objective}__seed{seed}", "preset": preset, "objective": objective, "seed": seed,
        "status": "ok", "complete": True, "run_label": run_label, "settings_id": "synthetic", "git_commit": "abc1234",
        "started_utc": "2026-12-01T10:00:00Z", "finished_utc": "2026-12-01T10:05:00Z", "wall_seconds": 300.0,
        "versions": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0", "transformers": "5.17.0"},
        "settings": {"preset": preset, "block_size": 256, "steps": 100, "batch_size": 64, "warmup_fraction": 0.05,
                     "device": "cuda", "ppl_passage_chars": 1000, "ppl_passages": N_PASSAGES, "max_seq_length": 128,
                     "ft_train": 2000, "ft_epochs": 1.0, "ft_batch_size": 32, "ft_eval": None},
        "prep": {"vocab_size": 8192, "train_tokens": 10**6, "tokenizer_sha256": "feed",
                 "train_corpora": {"gutenberg": {"documents": 10, "characters": 10**6}},
                 "heldout_sizes": {n: {"passages": N_PASSAGES, "characters": 24000, "documents_in_split": 5} for n in SETS}},
        "pretrain": {"parameters": 8_000_000, "tokens": 6_400_000, "epochs": 1.0, "learning_rate": 1e-3,
                     "learning_rate_source": {"method": "sweep: lowest validation objective loss among runs that did "
                                                        "not diverge", "runs": []},
                     "tokens_per_second": 250_000.0},
        "perplexity": {"natural_protocol": natural, "sets": sets},
        "probe": probes,
        "finetune": {"full": full_ft, "skipped": []},
    }


# what each objective looks like in the main synthetic grid: every claim decidable, most called
PROFILE = {
    "ar": dict(level=5.0, gap=1.0, probe=0.70, full=0.72),
    "dar-t2": dict(level=5.2, gap=1.0, probe=0.70, full=0.72),
    "mlm-0.15": dict(level=5.8, gap=1.8, probe=0.80, full=0.82),
    "mlm-0.3": dict(level=5.7, gap=1.8, probe=0.80, full=0.82),
    "vmlm-0.15-0.3": dict(level=5.4, gap=1.4, probe=0.80, full=0.82),
    "mix-dar12-vmlm": dict(level=4.98, gap=1.0, probe=0.82, full=0.82),
}


def write_grid(folder: Path, profile: dict, seeds=range(3), preset="syn") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for objective, kw in profile.items():
        for seed in seeds:
            rng = np.random.default_rng([list(report.OBJECTIVES).index(objective) if objective in report.OBJECTIVES
                                         else 99, seed])
            cell = make_cell(objective, seed, rng=rng, preset=preset, **kw)
            (folder / f"{cell['key']}.json").write_text(json.dumps(cell))
    keys = [f"{preset}__{o}__seed{s}" for o in profile for s in seeds]
    (folder / "run__syn-a.json").write_text(json.dumps({
        "run_label": "syn-a", "wall_seconds": 540.0, "started_utc": "2026-12-01T09:59:00Z", "cells_ok": keys,
        "cells_failed": [], "cells_not_started": [], "machine": {"gpu_count": 1, "gpu_names": ["NVIDIA H100 80GB HBM3"]}}))
    for lr in (3e-4, 1e-3, 3e-3):  # the brief's flat layout (ar) and the cell worker's (mlm-0.15: under pretrain)
        loss = float("nan") if lr == 3e-3 else 5.0 + lr
        (folder / f"sweep__{preset}__ar__lr{lr:g}.json").write_text(json.dumps({
            "objective": "ar", "learning_rate": lr, "validation_loss": loss, "diverged": lr == 3e-3,
            "logged_losses": [7.0, 6.0], "settings": {"preset": preset}}))
        (folder / f"sweep__{preset}__mlm-0.15__lr{lr:g}.json").write_text(json.dumps({
            "key": f"sweep__{preset}__mlm-0.15__lr{lr:g}", "kind": "sweep", "preset": preset, "objective": "mlm-0.15",
            "learning_rate": lr, "status": "ok", "run_label": "syn-a", "wall_seconds": 60.0,
            "started_utc": "2026-12-01T09:59:30Z", "finished_utc": "2026-12-01T10:00:30Z",
            "pretrain": {"validation_loss": 6.0 + lr if lr < 3e-3 else 9.5, "logged_losses": [7.0, 6.0]},
            "diverged": lr == 3e-3, "diverged_reasons": ["final training loss above 1.5 x"] if lr == 3e-3 else []}))
    return folder


def _group(folder):
    cells, _, _ = report.load_results([folder])
    return report.by_objective(cells)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    folder = write_grid(tmp_path_factory.mktemp("syn") / "results", PROFILE)
    out = folder.parent / "docs" / "RESULTS.md"
    text = report.build_report([folder], out, plots_dir=folder.parent / "docs" / "plots", n_boot=300)
    return folder, text


def test_report_of_synthetic_new_schema_cells(synthetic):
    folder, text = synthetic
    # every claim's verdict, its interval and its power; C3 in two verdicts; the mixture's own verdict
    for key in ("C1", "C2", "C3a", "C3b", "C4", "M"):
        heading = next(l for l in text.splitlines() if l.startswith("#### ") and report.CLAIMS[key].split(" (")[0] in l)
        assert heading.endswith((": holds.", ": does not hold.", ": cannot tell.", ": both at once.", ": neither.",
                                 "only.")) or "cannot tell (" in heading
        section = text.split(heading, 1)[1].split("\n#### ", 1)[0]
        row = next(l for l in section.splitlines() if l.startswith("| ") and " − " in l)
        cols = [c.strip() for c in row.strip("|").split("|")]
        assert cols[3].startswith("[") and cols[4].startswith("[")  # the t interval and the bootstrap interval
        assert re_number(cols[9]) and re_number(cols[10])  # power at 0.05 and at 0.05/m
    assert text.count("#### C3,") == 2
    assert "| C3, second half | **" in text and "| mixture | **" in text
    # the per-domain lines (Gutenberg vs the second domain)
    assert "**Gutenberg (in-domain)**" in text and "**second domain (BBC + SOTU + Brown)**" in text
    # the sweep table: the chosen LR marked, a diverged run marked
    sweep = text.split("### Pretraining learning-rate sweep", 1)[1].split("\n### ", 1)[0]
    assert "| ar | 5.000 | **5.001** ✓ | diverged | 0.001 |" in sweep
    assert "| mlm-0.15 | 6.000 | **6.001** ✓ | 9.500 (diverged) | 0.001 |" in sweep
    assert "(sweep: lowest validation objective loss" in sweep
    # the GPU runs: machine, minutes, cells
    assert "| syn-a | 1 × NVIDIA H100 80GB HBM3 | – | 18 | 0 | 0 | 3 |" in text  # 3 sweep runs carry a run label
    assert "- `syn-a` (1 × NVIDIA H100 80GB HBM3, 9.0 min" in text and "syn ar s0,1,2" in text
    # plots: one per claim, linked, and the prefix / probe plots
    plots = folder.parent / "docs" / "plots"
    for key in ("C1", "C2", "C3a", "C3b", "C4", "M"):
        assert (plots / f"claim_{key}_syn.png").stat().st_size > 5000
        assert f"](plots/claim_{key}_syn.png)" in text
    assert (plots / "ppl_by_prefix_syn.png").is_file() and (plots / "probe_syn.png").is_file()
    assert "seed test only" not in text.split("## Preset", 1)[1].split("### Settings", 1)[0]
    # the rule's top-of-report statement, the power method, the summary table
    assert "Holm-adjusted" in text and "noncentral t" in text and "## Verdicts" in text


def test_verdicts_of_a_synthetic_grid_with_8_seeds(tmp_path):
    folder = write_grid(tmp_path, PROFILE, seeds=range(8))
    a = report.analyse(_group(folder), n_boot=300)
    v = {k: c["verdict"] for k, c in a["claims"].items()}
    # the profile: dar = ar on scores (cannot tell), vmlm beats both fixed ratios, masked gaps larger than AR's,
    # vmlm's gap smaller, masked models probe better, the mixture reaches both
    assert v == {"C1": "cannot tell", "C2": "holds", "C3a": "holds", "C3b": "holds", "C4": "holds", "M": "both at once"}
    assert all(t.result["bootstrap"] is not None for t in a["tests"])
    assert {t.result["family_size"] for t in a["tests"]} == {len(a["tests"])} == {17}


def re_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def test_report_numbers_equal_an_independent_computation(synthetic):
    folder, text = synthetic
    cells = [json.loads(p.read_text()) for p in sorted(folder.glob("syn__*.json"))]
    by = {(c["objective"], c["seed"]): c for c in cells}
    # C2, vmlm - mlm-0.3: the mean over seeds of the mean-over-sets masked-prefix NLL difference
    diffs = [mean([by["vmlm-0.15-0.3", s]["perplexity"]["sets"][n]["masked_prefix"]["nll"] for n in SETS])
             - mean([by["mlm-0.3", s]["perplexity"]["sets"][n]["masked_prefix"]["nll"] for n in SETS]) for s in range(3)]
    assert f"| held-out NLL (masked prefix, pooled over sets), vmlm-0.15-0.3 − mlm-0.3 | 3 | {mean(diffs):+.4f} |" in text
    # C4's probe test, vmlm - ar: the four-task average of the test scores
    diffs = [mean([by["vmlm-0.15-0.3", s]["probe"][t]["test"] for t in report.TASKS])
             - mean([by["ar", s]["probe"][t]["test"] for t in report.TASKS]) for s in range(3)]
    assert f"| probe average, vmlm-0.15-0.3 − ar | 3 | {mean(diffs):+.4f} |" in text
    # the fine-tuning table uses the test split
    assert "### Full fine-tuning (GLUE harness, test split)" in text


def _c3_verdicts(tmp_path, profile):
    folder = write_grid(tmp_path, profile, seeds=range(6))
    a = report.analyse(_group(folder), n_boot=200)
    short = {t.b: t.result for t in a["tests"] if t.claim == "C3b"}
    return a["claims"]["C3a"]["verdict"], a["claims"]["C3b"]["verdict"], short


def test_c3_tests_gaps_not_levels(tmp_path):
    base = {"ar": dict(level=5.0, gap=1.0), "mlm-0.15": dict(level=5.8, gap=1.8), "mlm-0.3": dict(level=5.8, gap=1.8)}
    # levels differ (vmlm 0.5 nats better at short AND long prefixes) but the gaps are the same: C3b cannot be called
    same_gap = {**base, "vmlm-0.15-0.3": dict(level=5.3, gap=1.8)}
    c3a, c3b, _ = _c3_verdicts(tmp_path / "a", same_gap)
    assert c3a == "holds" and c3b == "cannot tell"
    group = _group(tmp_path / "a")
    short = report.gap_measure(report._protocol("natural"), part="short")
    levels = paired_comparison([short.value(group["vmlm-0.15-0.3"][s]) for s in range(6)],
                               [short.value(group["mlm-0.15"][s]) for s in range(6)])
    assert levels.mean_diff < -0.4 and levels.p_t < 0.001  # the short-prefix levels do differ, clearly
    # the gaps differ (vmlm's 0.4 smaller) while the short-prefix levels are the same: C3b holds
    same_short = {**base, "vmlm-0.15-0.3": dict(level=6.2, gap=1.4)}
    c3a, c3b, _ = _c3_verdicts(tmp_path / "b", same_short)
    assert c3a == "holds" and c3b == "holds"
    group = _group(tmp_path / "b")
    levels = paired_comparison([short.value(group["vmlm-0.15-0.3"][s]) for s in range(6)],
                               [short.value(group["mlm-0.15"][s]) for s in range(6)])
    assert abs(levels.mean_diff) < 0.05
    # the gap widened instead: C3b does not hold
    wider = {**base, "vmlm-0.15-0.3": dict(level=5.4, gap=2.3)}
    assert _c3_verdicts(tmp_path / "c", wider)[1] == "does not hold"


def test_the_rule_needs_both_holm_and_the_bootstrap():
    def result(p, low, high, mean_diff=0.1, n=8, null=0.0):
        return {"n": n, "p_t": p, "mean_diff": mean_diff, "sd_diff": 0.1, "effect": 0.1, "null": null, "expected": 1,
                "bootstrap": None if low is None else {"low": low, "high": high}}

    rs = [result(0.001, 0.02, 0.2), result(0.001, -0.01, 0.2), result(0.04, 0.02, 0.2), result(0.001, None, None),
          result(0.001, 0.02, 0.2, mean_diff=-0.1), result(0.5, 0.1, 0.2, mean_diff=0.2, null=0.25)]
    report.decide(rs)
    assert [r["p_holm"] for r in rs][:3] == pytest.approx([0.006, 0.006, 0.08])
    assert [r["outcome"] for r in rs] == ["supports", "not called", "not called", "supports",
                                         # the bootstrap interval lies on the other side of the mean: not called
                                         "not called", "not called"]
    assert report.verdict(["supports", "supports"]) == "holds"
    assert report.verdict(["supports", "not called"]) == "cannot tell"
    assert report.verdict(["supports", "contradicts"]) == "does not hold"
    assert report.verdict([]) == "cannot tell"
    assert report.mixture_verdict("supports", "supports") == "both at once"
    assert report.mixture_verdict("contradicts", "contradicts") == "neither"
    assert report.mixture_verdict("supports", "not called").startswith("cannot tell (AR-level perplexity: reached")


def test_mixture_neither(tmp_path):
    profile = {"ar": dict(level=5.0, probe=0.70), "vmlm-0.15-0.3": dict(level=5.6, probe=0.85),
               "mix-dar12-vmlm": dict(level=5.5, probe=0.70)}
    folder = write_grid(tmp_path, profile, seeds=range(5))
    a = report.analyse(_group(folder), n_boot=200)
    assert a["claims"]["M"]["verdict"] == "neither"


# ---------------------------------------------------------------------------------------------
# the report of the old schema: the smoke fixtures and the committed first GPU grid
# ---------------------------------------------------------------------------------------------
def test_report_of_the_fixtures_is_the_expected_one(tmp_path):
    text = report.build_report([FIXTURES], tmp_path / "RESULTS.md", plots=False)
    assert text == (FIXTURES / "expected_RESULTS.md").read_text(encoding="utf-8")


def test_fixture_report_lists_failures_partial_cells_and_cost(tmp_path):
    text = report.build_report([FIXTURES], tmp_path / "RESULTS.md", plots_dir=tmp_path / "plots")
    failures = [json.loads(p.read_text()) for p in FIXTURES.glob("*__failed__*.json")]
    assert failures
    for f in failures:
        assert f"| {f['key']} | {f['run_label']} | {f['status']}" in text
    cells = [json.loads(p.read_text()) for p in FIXTURES.glob("*__seed*.json") if "__failed__" not in p.name]
    for c in cells:
        if c["status"] == "partial":
            assert f"| {c['key']} | {c['run_label']} | {', '.join(c['finetune']['skipped'])} |" in text
    for label in {c["run_label"] for c in cells + failures}:
        minutes = sum(c["wall_seconds"] for c in cells + failures if c["run_label"] == label) / 60
        assert any(l.startswith(f"| {label} |") and f"| {minutes:.1f} |" in l for l in text.splitlines())
    assert (tmp_path / "plots" / "ppl_by_prefix_tiny.png").stat().st_size > 1000
    assert "](plots/claim_C1_tiny.png)" in text


def test_report_refuses_cells_of_different_settings(tmp_path):
    for path in FIXTURES.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    cell = tmp_path / "tiny__ar__seed0.json"
    data = json.loads(cell.read_text())
    data["settings_id"] = "another"
    cell.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="different settings"):
        report.build_report([tmp_path], tmp_path / "out.md", plots=False)


def test_report_of_the_first_gpu_grid_builds(tmp_path):
    # the first grid has no per-example data: every verdict rests on the seed test and says so
    text = report.build_report([FIRST_GRID], tmp_path / "R.md", plots=False, n_boot=50)
    for key in ("C1", "C2", "C3a", "C3b", "C4"):
        assert f"#### {report.CLAIMS[key]}: " in text
    assert "seed test only (no per-example data)" in text
    assert "| gpu1 | NVIDIA H100 80GB HBM3 | complete | 6 |" in text
    assert "full fine-tuning average, dar-t2 − ar" in text  # every cell fine-tuned the four tasks


def test_report_of_the_committed_gpu_grid_is_its_results_md(tmp_path):
    # the same layout as the repository (docs/results/study18 with its RESULTS.md, the earlier docs/results/study),
    # so the plot links and the line on the earlier study come out the same
    results = tmp_path / "docs" / "results" / "study18"
    shutil.copytree(GPU_RESULTS, results, ignore=shutil.ignore_patterns("*.png", "NOTES.md"))
    if (GPU_RESULTS / "NOTES.md").is_file():
        shutil.copy(GPU_RESULTS / "NOTES.md", results)
    (tmp_path / "docs" / "results" / "study").mkdir()
    text = report.build_report([results], results / "RESULTS.md")
    assert text == (GPU_RESULTS / "RESULTS.md").read_text(encoding="utf-8")
    assert "[`docs/results/study/`](../study/)" in text and "--results_dir docs/results/study`" in text
    for label in ("sweep1", "grid1", "grid2", "grid3", "sweep2", "grid4"):  # every GPU call, its machine
        machine = "2 × NVIDIA H100 80GB HBM3" if label == "grid3" else "1 × NVIDIA H100 80GB HBM3"
        status = "running" if label == "grid3" else "complete"  # grid3 was cut at its limit
        assert f"| {label} | {machine} | {status} |" in text
    assert "no record small gvp-k8 s7" in text
    # rule 1: grid3's timed-out cells enter the probe / perplexity tests (8 seeds), not the fine-tuning ones (4)
    assert "| probe average, dar-t2 − ar | 8 |" in text
    assert "| full fine-tuning (rotten_tomatoes test accuracy), dar-t2 − ar | 4 |" in text
    assert "| held-out NLL (masked prefix, pooled over sets), vmlm-0.15-0.3 − mlm-0.3 | 8 |" in text
    assert "| full fine-tuning (rotten_tomatoes test accuracy), mlm-0.3 − ar | 4 |" in text
    assert "| small__dar-t2__seed4 | grid3 | timeout | killed at the --max_minutes limit (9.6 min) | pretrain, " \
           "perplexity, probe | pretrain, perplexity, probe |" in text
    assert "| small__mlm-0.3__seed2 | grid2 | failed (finished in grid4) | exit code 1 | pretrain | nothing |" in text
    # rule 2: the fine-tuning measure is rotten_tomatoes alone, named in the protocol text
    assert "fine-tuned in every cell compared (preset `small`: rotten_tomatoes alone)" in text


# ---------------------------------------------------------------------------------------------
# rule 1 (a failed cell's completed phases) and rule 2 (the fine-tuning tasks every cell has)
# ---------------------------------------------------------------------------------------------
def _failed(cell: dict, run_label="syn-b", killed_in="finetune") -> dict:
    """The cell as a timed-out one: killed in ``killed_in`` (its phases before that complete; the fine-tuning
    saved task by task, so a killed fine-tuning leaves a partial record without a phase time)."""
    order = ["pretrain", "perplexity", "probe", "finetune"]
    done = order[:order.index(killed_in)]
    out = {k: v for k, v in cell.items() if k not in order or k in done}
    if killed_in == "finetune":
        out["finetune"] = {"full": {"rotten_tomatoes": cell["finetune"]["full"]["rotten_tomatoes"]}}
    out.update(status="timeout", reason="killed at the --max_minutes limit", run_label=run_label, complete=False,
               phase_seconds={p: 1.0 for p in done}, measured_phases=[p for p in order if p in out])
    return out


def test_a_failed_cell_enters_the_tests_of_its_completed_phases_only(tmp_path):
    folder = write_grid(tmp_path / "r", PROFILE, seeds=range(4))
    path = folder / "syn__dar-t2__seed3.json"
    cell = json.loads(path.read_text())
    path.unlink()
    (folder / "syn__dar-t2__seed3__failed__syn-b.json").write_text(json.dumps(_failed(cell)))
    # a failure of a cell that finished in another run never enters: the finished one does
    other = json.loads((folder / "syn__ar__seed2.json").read_text())
    (folder / "syn__ar__seed2__failed__syn-0.json").write_text(json.dumps(_failed(other, "syn-0", "perplexity")))
    cells, failures, _ = report.load_results([folder])
    assert len(failures) == 2
    salvaged = [c for c in cells if c["status"] == "timeout"]
    assert [c["key"] for c in salvaged] == ["syn__dar-t2__seed3"]
    assert salvaged[0]["salvaged_phases"] == ["pretrain", "perplexity", "probe"]
    assert "finetune" not in salvaged[0]  # killed in it: its partial record is dropped
    assert next(c for c in cells if c["key"] == "syn__ar__seed2")["status"] == "ok"
    a = report.analyse(report.by_objective(cells), n_boot=100)
    c1 = {t.measure.name: t.result for t in a["claims"]["C1"]["tests"]}
    assert c1["score:probe"]["n"] == 4 and c1["score:probe"]["seeds"] == [0, 1, 2, 3]
    assert c1["score:full"]["n"] == 3 and c1["score:full"]["seeds"] == [0, 1, 2]
    text = report.build_report([folder], tmp_path / "R.md", plots=False, n_boot=100)
    assert "| syn__dar-t2__seed3 | syn-b | timeout | killed at the --max_minutes limit | pretrain, perplexity, probe, " \
           "finetune | pretrain, perplexity, probe |" in text
    assert "enters the tables and tests of those phases only" in text
    ppl = text.split("### Held-out perplexity, natural protocol", 1)[1].split("\n### ", 1)[0]
    probe = text.split("### Linear probes", 1)[1].split("\n### ", 1)[0]
    ft = text.split("### Full fine-tuning", 1)[1].split("\n## ", 1)[0]
    assert "| dar-t2 | 4 |" in ppl and "| dar-t2 | 4 |" in probe and "| dar-t2 | 3 |" in ft
    # the cost table counts it as failed, not as a finished cell
    assert "| syn-b | NVIDIA H100 80GB HBM3 | – | 0 | 0 | 1 |" in text


def test_a_failed_cell_killed_in_the_perplexity_enters_no_perplexity_table(tmp_path):
    folder = write_grid(tmp_path / "r", {"ar": PROFILE["ar"], "mlm-0.15": PROFILE["mlm-0.15"]}, seeds=range(3))
    path = folder / "syn__mlm-0.15__seed2.json"
    cell = json.loads(path.read_text())
    path.unlink()
    (folder / "syn__mlm-0.15__seed2__failed__syn-b.json").write_text(json.dumps(_failed(cell, killed_in="perplexity")))
    text = report.build_report([folder], tmp_path / "R.md", plots_dir=tmp_path / "plots", n_boot=50)
    ppl = text.split("### Held-out perplexity, natural protocol", 1)[1].split("\n### ", 1)[0]
    assert "| mlm-0.15 | 2 |" in ppl and "| ar | 3 |" in ppl
    assert "| syn__mlm-0.15__seed2 | syn-b | timeout | killed at the --max_minutes limit | pretrain | pretrain |" in text


def test_the_fine_tuning_measure_keeps_the_tasks_every_cell_fine_tuned(tmp_path):
    folder = write_grid(tmp_path / "r", PROFILE, seeds=range(3))
    for path in folder.glob("syn__*__seed*.json"):  # one cell fine-tuned rotten_tomatoes and trec, the rest all four
        cell = json.loads(path.read_text())
        if cell["key"] == "syn__mlm-0.3__seed1":
            for t in ("vader_movie", "sms_spam"):
                del cell["finetune"]["full"][t]
            cell["finetune"]["skipped"] = ["full/vader_movie", "full/sms_spam"]
            cell["status"] = "partial"
            path.write_text(json.dumps(cell))
    cells, _, _ = report.load_results([folder])
    assert report.finetune_tasks(cells) == ["rotten_tomatoes", "trec"]
    group = report.by_objective(cells)
    a = report.analyse(group, n_boot=100)
    full = [t for t in a["tests"] if t.measure.name.startswith("score:full")]
    assert full and all(t.label.startswith("full fine-tuning average (rotten_tomatoes, trec), ") for t in full)
    # every cell's value is the mean of those two tasks, so ar against mlm-0.3 keeps all 3 seeds
    c4 = next(t for t in full if t.a == "mlm-0.3")
    assert c4.result["n"] == 3
    for seed, d in zip(c4.result["seeds"], c4.result["diffs"]):
        mine = [report._ft_score(group[o][seed]["finetune"]["full"][t]) for o in ("mlm-0.3", "ar")
                for t in ("rotten_tomatoes", "trec")]
        assert d == pytest.approx((mine[0] + mine[1]) / 2 - (mine[2] + mine[3]) / 2)
    # one task alone: the label names it, its split and its metric
    assert report.score_label("full", ["rotten_tomatoes"], cells) == "full fine-tuning (rotten_tomatoes test accuracy)"
    assert report.score_label("full", report.TASKS, cells) == "full fine-tuning average"
    assert report.score_measure("probe", ["rotten_tomatoes"]).label == "probe average"  # probes: always four tasks
    text = report.build_report([folder], tmp_path / "R.md", plots=False, n_boot=100)
    assert "fine-tuned in every cell compared (preset `syn`: rotten_tomatoes, trec)" in text
    ft = text.split("### Full fine-tuning", 1)[1].split("\n## ", 1)[0]
    assert "| average (rotten_tomatoes, trec) |" in ft and "| mlm-0.3 | 3 |" in ft


def test_main_takes_the_report_flags(tmp_path, capsys):
    code = report.main(["--report", "--results_dir", str(FIXTURES), "--output", str(tmp_path / "R.md"), "--no_plots",
                        "--n_boot", "50"])
    assert code == 0 and (tmp_path / "R.md").read_text().startswith("# The seeded study")
