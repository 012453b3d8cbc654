"""An independent recompute of the C1 protocol's tests from its bundles (issue 42: "an independent recompute from the
bundle gives the same verdicts").

    python study/recompute_c1.py --bundles docs/results/study42/curves__part1__c1p1c*.json.gz

Written apart from the report: it reads the bundles with gzip + json only and imports nothing of study_curves_report,
study_stats or study_curves. From the protocol file (study/study_protocol_c1.json) it takes the test list
(``tests.list``), the descriptive probes (``tests.descriptive``), the seeds of each objective (``parts``), the
record rule (protocol SHA-256, clean commit, training slice, one run per cell) and the verdict rules
(``tests.rules_text``, ``tests.verdict``). Each task's test score is recomputed from the stored test predictions and
labels (accuracy, or Pearson r for vader_movie), never read from the stored score. Paired t from scipy.stats, Holm's
step-down in a few lines, the bootstrap over test examples within each task (``evaluation.bootstrap``: 2000
replicates, seed 0, the same draws for both sides and every seed; its random stream is this file's own, so the
interval may differ slightly from the report's, the call should not).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

PROTOCOL = Path(__file__).resolve().parent / "study_protocol_c1.json"
LEVEL = 0.05
# the protocol's evaluation.at_last_checkpoint: three classification tasks scored by accuracy, vader_movie by Pearson r
METRIC = {"rotten_tomatoes": "accuracy", "trec": "accuracy", "sms_spam": "accuracy", "vader_movie": "pearson"}
TASKS_OF = {"finetune_average": ("rotten_tomatoes", "trec", "sms_spam", "vader_movie"),
            "probe_classification": ("rotten_tomatoes", "trec", "sms_spam"),
            "probe_regression": ("vader_movie",)}


# ---------------------------------------------------------------------------------------------
# the records that count
# ---------------------------------------------------------------------------------------------
def read_records(paths) -> list[dict]:
    """Every distinct record of the bundles (a later bundle repeats the earlier ones' records)."""
    seen, out = set(), []
    for path in paths:
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            for name, record in json.load(handle)["records"].items():
                text = json.dumps(record, sort_keys=True)
                if (name, text) not in seen:
                    seen.add((name, text))
                    out.append(dict(record, _name=name))
    return out


def _all_finite(x) -> bool:
    if isinstance(x, dict):
        return all(_all_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_all_finite(v) for v in x)
    return not isinstance(x, float) or math.isfinite(x)


def counted_cells(records: list[dict], protocol: dict, sha256: str) -> tuple[dict, list[str]]:
    """(objective, seed) -> {"checkpoint": record, "finetune": record} for every cell that counts under
    ``rule_for_failed_or_killed_cells``: both records of one run (``cell_run``), finite, of this protocol, a clean
    commit and the training slice; of two complete runs the first finished. Also the reasons of the others."""
    last = protocol["checkpoint_tokens"][-1]
    train_sha = protocol["training_slice"]["sha256"]["train.jsonl.gz"]
    runs, dropped = {}, []
    for r in records:
        commit = str(r.get("code_commit") or "")
        slice_sha = (r.get("training_slice_sha256") or {}).get("train", {}).get("train.jsonl.gz")
        if r.get("protocol_sha256") != sha256:
            dropped.append(f"{r['_name']}: another protocol")
        elif not commit or "dirty" in commit or "unknown" in commit:
            dropped.append(f"{r['_name']}: commit {commit or 'missing'}")
        elif slice_sha != train_sha:
            dropped.append(f"{r['_name']}: another training slice")
        elif not _all_finite({k: r.get(k) for k in ("probe", "finetune")}):
            dropped.append(f"{r['_name']}: a non-finite number")
        elif r.get("tokens") == last:
            kind = "finetune" if r.get("kind") == "finetune" else "checkpoint"
            run = runs.setdefault((r["objective"], r["seed"]), {}).setdefault(r.get("cell_run"), {})
            if kind in run:  # a second copy of one record of a run: the first finished counts
                dropped.append(f"{r['_name']}: a second copy in run {r.get('cell_run')}")
                if r.get("finished_unix", 0) >= run[kind].get("finished_unix", 0):
                    continue
            run[kind] = r
    cells = {}
    for cell, by_run in sorted(runs.items()):
        complete = [run for run in by_run.values() if "checkpoint" in run and "finetune" in run
                    and set(run["finetune"]["finetune"]["full"]) >= set(METRIC)]
        if not complete:
            dropped.append(f"{cell[0]}/seed{cell[1]}: no run with its checkpoint and all four fine-tuned tasks")
            continue
        cells[cell] = min(complete, key=lambda run: max(x.get("finished_unix", 0) for x in run.values()))
        dropped += [f"{cell[0]}/seed{cell[1]}: run {k}, not its first complete one"
                    for k, run in by_run.items() if run is not cells[cell]]
    return cells, dropped


def seeds_of(protocol: dict, objective: str) -> set[int]:
    """Every seed the protocol runs for ``objective`` (its parts, optional blocks too)."""
    out = set()
    for part in protocol["parts"].values():
        for block in (part, part.get("optional") or {}):
            if objective in block.get("objectives", []):
                out |= set(block["seeds"])
    return out


# ---------------------------------------------------------------------------------------------
# scores from the predictions
# ---------------------------------------------------------------------------------------------
def task_score(entry: dict, task: str, rows: np.ndarray | None = None) -> np.ndarray:
    """The task's test score, from its predictions and labels; ``rows`` (replicates, examples) resamples them."""
    if entry["metric"] != METRIC[task]:
        raise ValueError(f"{task}: the record scores by {entry['metric']}, the protocol by {METRIC[task]}")
    pred, gold = np.asarray(entry["test_predictions"], float), np.asarray(entry["test_labels"], float)
    if rows is None:
        rows = np.arange(len(gold))[None, :]
    pred, gold = pred[rows], gold[rows]
    if METRIC[task] == "accuracy":
        return (pred == gold).mean(axis=1)
    if rows.shape[0] == 1:
        return np.array([stats.pearsonr(pred[0], gold[0])[0]])
    dp, dg = pred - pred.mean(axis=1, keepdims=True), gold - gold.mean(axis=1, keepdims=True)
    den = np.sqrt((dp ** 2).sum(axis=1) * (dg ** 2).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (dp * dg).sum(axis=1) / den, 0.0)


def source(cell: dict, measure: str) -> dict:
    return cell["finetune"]["finetune"]["full"] if measure == "finetune_average" else cell["checkpoint"]["probe"]


def measure_value(cell: dict, measure: str, draws: dict | None = None) -> np.ndarray:
    """Mean over the measure's tasks of each task's score (one value, or one per bootstrap replicate)."""
    entries = source(cell, measure)
    return np.mean([task_score(entries[t], t, None if draws is None else draws[t]) for t in TASKS_OF[measure]], axis=0)


def bootstrap_draws(cells: dict, n_boot: int, seed: int) -> dict[str, np.ndarray]:
    """Per task, (n_boot, examples) indices drawn with replacement: the same for every cell (every record holds the
    same test examples, checked here)."""
    rng = np.random.default_rng(seed)
    draws = {}
    for task in sorted(METRIC):
        sizes = {len(source(c, m)[task]["test_labels"]) for c in cells.values() for m in ("finetune_average", "probe_regression")}
        if len(sizes) != 1:
            raise ValueError(f"{task}: the records hold different numbers of test examples {sorted(sizes)}")
        n = sizes.pop()
        draws[task] = rng.choice(n, size=(n_boot, n), replace=True)
    return draws


# ---------------------------------------------------------------------------------------------
# tests, Holm, verdicts
# ---------------------------------------------------------------------------------------------
def holm_adjusted(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values in the input order (every p given, no NaN)."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    out, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        out[i] = running
    return out


def paired_test(cells, test, required: set[int] | None, draws=None) -> dict:
    claim, a, b, measure, expected, effect, null = test
    seeds = sorted(s for (o, s) in cells if o == a and (b, s) in cells)
    row = {"claim": claim, "a": a, "b": b, "measure": measure, "expected": expected, "null": null, "n": len(seeds),
           "seeds": seeds, "has_data": len(seeds) >= 2 and (required is None or required <= set(seeds))}
    if not row["has_data"]:
        return row
    diff = np.array([measure_value(cells[a, s], measure)[0] - measure_value(cells[b, s], measure)[0] for s in seeds])
    t = stats.ttest_1samp(diff, popmean=null)
    ci = t.confidence_interval(0.95)
    row.update(mean=float(diff.mean()), sd=float(diff.std(ddof=1)), low=float(ci.low), high=float(ci.high),
               p=float(t.pvalue))
    if draws is not None:
        reps = np.mean([measure_value(cells[a, s], measure, draws) - measure_value(cells[b, s], measure, draws)
                        for s in seeds], axis=0)
        row["boot_low"], row["boot_high"] = (float(x) for x in np.percentile(reps, [2.5, 97.5]))
    return row


def call(row: dict) -> None:
    """tests.call: Holm p < 0.05 and the bootstrap interval excludes the null on the mean's side."""
    if not row["has_data"]:
        row["called"], row["outcome"] = False, "no data"
        return
    side = np.sign(row["mean"] - row["null"])
    boot = (side > 0 and row["boot_low"] > row["null"]) or (side < 0 and row["boot_high"] < row["null"])
    row["called"] = bool(side != 0 and row["p_holm"] < LEVEL and boot)
    row["outcome"] = ("not called" if not row["called"] else "differs" if row["expected"] == 0 else
                      "supports" if side == row["expected"] else "contradicts")


def claim_verdict(outcomes: list[str]) -> str:
    """tests.verdict under tests.rules (family fixed, every seed, missing data 'cannot tell' both ways)."""
    if "differs" in outcomes:  # verdict_parameterisation: P, two-sided
        return "the forms differ"
    if "contradicts" in outcomes:  # no missing test can undo a call against
        return "does not hold"
    missing = outcomes.count("no data")
    if missing:
        return "no data" if missing == len(outcomes) else f"cannot tell ({missing} of {len(outcomes)} without data)"
    return "holds" if all(o == "supports" for o in outcomes) else "cannot tell"


def recompute(bundles, protocol_path: Path = PROTOCOL, n_boot: int | None = None, seed: int | None = None) -> dict:
    raw = Path(protocol_path).read_bytes()
    protocol = json.loads(raw)
    rules = protocol["tests"]["rules"]
    if rules != {"family": "fixed", "seeds": "all", "missing": "cannot tell both ways"}:
        raise SystemExit(f"recompute_c1: this recompute implements the fixed-family rules only, the protocol names {rules}")
    boot = protocol["evaluation"]["bootstrap"]  # "..., 2000 replicates, seed 0, ..."
    n_boot = n_boot or int(boot.split(" replicates")[0].split()[-1])
    seed = int(boot.split("seed ")[1].split(",")[0]) if seed is None else seed
    cells, dropped = counted_cells(read_records(bundles), protocol, hashlib.sha256(raw).hexdigest())
    draws = bootstrap_draws(cells, n_boot, seed)
    tests = []
    for t in protocol["tests"]["list"]:
        tests.append(paired_test(cells, t, seeds_of(protocol, t[1]) & seeds_of(protocol, t[2]), draws))
    # the family is the whole list: a test without data counts with p = 1 (tests.rules_text)
    adjusted = holm_adjusted([r["p"] if r["has_data"] else 1.0 for r in tests])
    for r, p in zip(tests, adjusted):
        r["p_holm"] = p if r["has_data"] else float("nan")
        call(r)
    verdicts = {c: claim_verdict([r["outcome"] for r in tests if r["claim"] == c])
                for c in dict.fromkeys(t[0] for t in protocol["tests"]["list"])}
    descriptive = [paired_test(cells, t, None) for t in protocol["tests"].get("descriptive", [])]
    stored = max(abs(task_score(e, t)[0] - e["test"]) for c in cells.values()
                 for m in ("finetune_average", "probe_regression") for t, e in source(c, m).items())
    return {"tests": tests, "verdicts": verdicts, "descriptive": descriptive, "cells": len(cells), "dropped": dropped,
            "n_boot": n_boot, "seed": seed, "max_difference_from_stored_scores": float(stored)}


def _f(x, spec="+.4f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(result: dict) -> str:
    lines = [f"{result['cells']} cells count; {len(result['dropped'])} records or runs dropped"
             + "".join(f"\n  dropped {d}" for d in result["dropped"]),
             f"recomputed task scores vs the records' stored scores: max |difference| "
             f"{result['max_difference_from_stored_scores']:.1e} (stored rounded to 5 decimals)", "",
             f"tests.list (one Holm family; bootstrap {result['n_boot']} replicates, seed {result['seed']})",
             "claim | test | n | mean diff [95 % t] | bootstrap 95 % | p | p (Holm) | called | verdict"]
    for r in result["tests"]:
        lines.append(f"{r['claim']} | {r['measure']}: {r['a']} - {r['b']} | {r['n']} | {_f(r.get('mean'))} "
                     f"[{_f(r.get('low'))}, {_f(r.get('high'))}] | [{_f(r.get('boot_low'))}, {_f(r.get('boot_high'))}] | "
                     f"{_f(r.get('p'), '.3g')} | {_f(r.get('p_holm'), '.3g')} | "
                     f"{'called' if r['called'] else 'not'} ({r['outcome']}) | {result['verdicts'][r['claim']]}")
    lines += ["", "tests.descriptive (no family, no verdict)", "claim | test | n | mean diff [95 % t] | p (unadjusted)"]
    for r in result["descriptive"]:
        lines.append(f"{r['claim']} | {r['measure']}: {r['a']} - {r['b']} | {r['n']} | {_f(r.get('mean'))} "
                     f"[{_f(r.get('low'))}, {_f(r.get('high'))}] | {_f(r.get('p'), '.3g')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundles", nargs="+", required=True)
    p.add_argument("--protocol", default=str(PROTOCOL))
    p.add_argument("--n_boot", type=int, default=None, help="default: the protocol's evaluation.bootstrap")
    args = p.parse_args(argv)
    print(table(recompute(args.bundles, Path(args.protocol), args.n_boot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
