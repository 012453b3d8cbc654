"""The learning curves' report (issue 32): every claim's tests at every checkpoint, under the protocol's rule only.

    python study/study_curves_report.py --bundles docs/results/study32/curves__part1__p1c3.json.gz \\
        docs/results/study32/curves__part2__p2c4.json.gz --output docs/results/study32/RESULTS.md

Reads the bundles of the part commands (every record of a part; a later bundle repeats the earlier ones), applies
``rule_for_failed_or_killed_cells`` of ``study/study_protocol_curves.json`` (the excluded records and the
missing cells are listed), and runs the protocol's tests at each checkpoint: paired t over seeds, Holm within the
checkpoint, the bootstrap (NLL: passages resampled by document; probes and fine-tuning: by test example).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

from study_curves import PROTOCOL_PATH, load_protocol, read_bundle, tiny_protocol, tokens_tag
from study_stats import bootstrap_indices, holm, mean, paired_comparison, seeds_for_power

LEVEL, N_BOOT, BOOT_SEED = 0.05, 2000, 0
SETS = ("gutenberg", "bbc", "sotu", "brown")
CLASSIFICATION = ("rotten_tomatoes", "trec", "sms_spam")
REGRESSION = ("vader_movie",)
NOTE_STUDY18 = ("The previous study (issue 18) keeps its cells and its report in docs/results/study18 (RESULTS.md there). "
                "Its C2 verdict rests on a rule (C2 on the masked-prefix "
                "protocol, pooled over the held-out sets) written after its results; here C2's rule, under both "
                "masked protocols, was fixed in the protocol file before any result.")


# ---------------------------------------------------------------------------------------------
# records under the rule
# ---------------------------------------------------------------------------------------------
def _finite(x) -> bool:
    if isinstance(x, dict):
        return all(_finite(v) for v in x.values())
    if isinstance(x, list):
        return all(_finite(v) for v in x)
    return not isinstance(x, float) or math.isfinite(x)


def merge_bundles(paths) -> dict[str, list[dict]]:
    """name -> every distinct copy of that record across the bundles."""
    out: dict[str, list[dict]] = {}
    for path in paths:
        for name, record in read_bundle(Path(path))["records"].items():
            copies = out.setdefault(name, [])
            if record not in copies:
                copies.append(record)
    return out


def choose_runs(copies: dict[str, list[dict]], protocol: dict) -> tuple[dict[str, list[dict]], list[tuple[str, str]]]:
    """For records that name their ``cell_run``: each cell keeps the records of one run, its first complete one (every
    checkpoint and the fine-tuning), else its run with the most records; the other runs' records are excluded.
    Records without ``cell_run`` (issue 32's) pass unchanged."""
    from study_curves import cell_record_names

    flat = [(name, r) for name, records in copies.items() for r in records]
    if not any(r.get("cell_run") for _, r in flat):
        return copies, []
    by_cell: dict[str, dict[str, dict[str, dict]]] = {}
    for name, r in flat:
        by_cell.setdefault(r.get("key"), {}).setdefault(r.get("cell_run"), {})[name] = r
    # issue 42's protocols (explicit tests.rules) count a cell only whole: its checkpoints and its fine-tuning from
    # one run (rule_for_failed_or_killed_cells); issue 32's counted an unfinished cell at the checkpoints it reached
    whole_cells_only = "rules" in protocol.get("tests", {})
    kept, excluded = {}, []
    for key, runs in sorted(by_cell.items()):
        def finished(run):
            return max(r.get("finished_unix", 0) for r in runs[run].values())

        expected = set(cell_record_names(key, protocol))
        complete = [run for run, named in runs.items() if expected <= set(named)]
        if whole_cells_only and not complete:
            excluded += [(name, "its cell has no complete run (the protocol counts a cell only with every checkpoint "
                                "and its fine-tuning from one run)") for named in runs.values() for name in sorted(named)]
            continue
        chosen = (min(complete, key=finished) if complete else
                  max(runs, key=lambda run: (len(runs[run]), -finished(run))))
        for run, named in sorted(runs.items(), key=lambda kv: str(kv[0])):
            for name, r in sorted(named.items()):
                if run == chosen:
                    kept.setdefault(name, []).append(r)
                else:
                    excluded.append((name, f"run {run} of the cell, superseded by run {chosen} "
                                           f"({'its first complete run' if complete else 'the run with most records'})"))
    return kept, excluded


def apply_rule(copies: dict[str, list[dict]], protocol: dict) -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """The records that count (name -> record) and the excluded ones (name, reason)."""
    copies, excluded = choose_runs(copies, protocol)
    kept = {}
    for name, records in sorted(copies.items()):
        records = sorted(records, key=lambda r: r.get("finished_unix", math.inf))
        for extra in records[1:]:
            excluded.append((name, f"a second record of this checkpoint (command {extra.get('command_label')}): "
                                   "the first finished counts"))
        r = records[0]
        commit = str(r.get("code_commit") or "")
        if r.get("protocol_sha256") != protocol["sha256"]:
            excluded.append((name, f"protocol {str(r.get('protocol_sha256'))[:12]}, not this file's"))
        elif not commit or "dirty" in commit or "unknown" in commit:
            excluded.append((name, f"code commit {commit or 'missing'}"))
        elif "training_slice" in protocol and r.get("training_slice_sha256", {}).get("train") != {
                "train.jsonl.gz": protocol["training_slice"]["sha256"]["train.jsonl.gz"]}:
            excluded.append((name, "trained on another slice (or names none): training_slice_sha256 "
                                   f"{r.get('training_slice_sha256', {}).get('train')}"))
        elif not _finite({k: r.get(k) for k in ("perplexity", "probe", "finetune")}):
            excluded.append((name, "a non-finite number"))
        else:
            kept[name] = r
    return kept, excluded


def by_checkpoint(kept: dict[str, dict], protocol: dict) -> dict[int, dict[str, dict[int, dict]]]:
    """tokens -> objective -> seed -> record; the fine-tuning record joins the last checkpoint's."""
    out = {t: {} for t in protocol["checkpoint_tokens"]}
    last = protocol["checkpoint_tokens"][-1]
    for r in kept.values():
        if r.get("kind") != "finetune" and r["tokens"] in out:
            out[r["tokens"]].setdefault(r["objective"], {})[r["seed"]] = dict(r)
    for r in kept.values():
        target = out[last].get(r["objective"], {}).get(r["seed"]) if r.get("kind") == "finetune" else None
        if target is not None:
            target["finetune"] = r["finetune"]
    return out


# ---------------------------------------------------------------------------------------------
# measures: a value per record and its bootstrap replicates
# ---------------------------------------------------------------------------------------------
def _entry(r, name, protocol):
    return r["perplexity"]["sets"][name][protocol]


def _protocol_of(measure: str, objective: str) -> str:
    """ar's NLL and gap are always its ar plan's (its one natural protocol)."""
    wanted = measure.split("_", 1)[1]
    return "ar_plan" if objective == "ar" and measure.startswith("gap_") else wanted


def cluster_weights(documents, n_boot: int, seed: int) -> np.ndarray:
    """(n_boot, passages): how often each passage's document was drawn (documents resampled with replacement)."""
    docs = np.asarray(documents)
    ids = np.unique(docs)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(ids), size=(n_boot, len(ids)))
    counts = np.stack([np.bincount(d, minlength=len(ids)) for d in draws])
    return counts[:, np.searchsorted(ids, docs)]


def _ratio(num, den, w):
    num, den = np.asarray(num, float), np.asarray(den, float)
    if w is None:
        return num.sum() / den.sum() if den.sum() else float("nan")
    d = w @ den
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, (w @ num) / d, np.nan)


def nll_value(r, measure, w=None):
    """Mean over the sets of NLL per token (``nll_*``) or of short minus long NLL (``gap_*``)."""
    protocol = _protocol_of(measure, r["objective"])
    parts = []
    for name in SETS:
        pp = _entry(r, name, protocol)["per_passage"]
        ws = None if w is None else w[name]
        if measure.startswith("nll_"):
            parts.append(_ratio(pp["nll_sum"], pp["tokens"], ws))
        else:
            parts.append(_ratio(pp["short_nll_sum"], pp["short_tokens"], ws) - _ratio(pp["long_nll_sum"], pp["long_tokens"], ws))
    return sum(parts) / len(parts)


def _score(entry, idx=None):
    p, y = np.asarray(entry["test_predictions"], float), np.asarray(entry["test_labels"], float)
    if idx is None:
        idx = np.arange(len(y))[None, :]
    ps, ys = p[idx], y[idx]
    if entry["metric"] == "accuracy":
        return (ps == ys).mean(axis=1)
    ps, ys = ps - ps.mean(axis=1, keepdims=True), ys - ys.mean(axis=1, keepdims=True)
    den = np.sqrt((ps * ps).sum(axis=1) * (ys * ys).sum(axis=1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ps * ys).sum(axis=1) / den, 0.0)


def score_value(r, measure, idx=None):
    """probe_classification / probe_regression / finetune_average: test scores, per-example resampling."""
    tasks = {"probe_classification": CLASSIFICATION, "probe_regression": REGRESSION,
             "finetune_average": CLASSIFICATION + REGRESSION}[measure]
    source = r["finetune"]["full"] if measure == "finetune_average" else r["probe"]
    values = [_score(source[t], None if idx is None else idx[t]) for t in tasks]
    out = sum(values) / len(values)
    return float(out[0]) if idx is None else out


def value(r, measure) -> float:
    return nll_value(r, measure) if measure[:4] in ("nll_", "gap_") else score_value(r, measure)


class Draws:
    """The bootstrap's resampling, drawn once per checkpoint: both sides and every seed see the same draws."""

    def __init__(self, record: dict, n_boot: int = N_BOOT, seed: int = BOOT_SEED):
        docs = record.get("perplexity_documents") or {}
        self.weights = {n: cluster_weights(docs[n], n_boot, seed + i) for i, n in enumerate(SETS) if n in docs}
        sizes = {t: len(record["probe"][t]["test_labels"]) for t in CLASSIFICATION + REGRESSION}
        mats = bootstrap_indices([sizes[t] for t in sizes], n_boot, seed)
        self.indices = dict(zip(sizes, mats))

    def replicates(self, r, measure):
        if measure[:4] in ("nll_", "gap_"):
            return nll_value(r, measure, self.weights)
        return score_value(r, measure, self.indices)


def _has(r, measure) -> bool:
    try:
        return math.isfinite(value(r, measure))
    except (KeyError, TypeError, ZeroDivisionError):
        return False


# ---------------------------------------------------------------------------------------------
# the verdict rules a protocol names
# ---------------------------------------------------------------------------------------------
# issue 32's rules, for a protocol that names none (study_protocol_curves.json): the Holm family is the tests that
# have data, a test runs on whatever seeds both sides have (at least 2), missing data rules out "holds" only
ISSUE32_RULES = {"family": "tests with data", "seeds": "at least 2", "missing": "rules out holds only"}
# issue 42's rules (tests.rules of study_protocol_c1.json): missing data cannot move a verdict
FIXED_RULES = {"family": "fixed", "seeds": "all", "missing": "cannot tell both ways"}


def rules_of(protocol: dict) -> dict:
    rules = {**ISSUE32_RULES, **protocol["tests"].get("rules", {})}
    allowed = {"family": ("tests with data", "fixed"), "seeds": ("at least 2", "all"),
               "missing": ("rules out holds only", "cannot tell both ways")}
    for key, value in rules.items():
        if key not in allowed or value not in allowed[key]:
            raise ValueError(f"protocol tests.rules: {key}={value!r} is not one of {allowed.get(key, sorted(allowed))}")
    return rules


def check_no_duplicate_tests(protocol: dict) -> None:
    """A test listed twice (same claim, sides and measure) would sit twice in its Holm family."""
    seen = set()
    for test in protocol["tests"]["list"]:
        key = tuple(test[:4])
        if key in seen:
            raise ValueError(f"protocol tests.list holds {list(key)} twice: drop one (a duplicate doubles its weight "
                             "in the Holm family)")
        seen.add(key)
    for a, b in protocol["tests"].get("same_quantity", []):
        if any(t[3] == b for t in protocol["tests"]["list"]) and any(t[3] == a for t in protocol["tests"]["list"]):
            raise ValueError(f"protocol tests.list tests both {a} and {b}, which the protocol says are the same "
                             "quantity: drop one")


def protocol_seeds(protocol: dict, objective: str) -> set[int]:
    """Every seed the protocol runs for ``objective`` (over its parts, optional blocks included)."""
    out = set()
    for part in protocol["parts"].values():
        for block in [part] + ([part["optional"]] if "optional" in part else []):
            if objective in block["objectives"]:
                out |= set(block["seeds"])
    return out


# ---------------------------------------------------------------------------------------------
# tests at one checkpoint
# ---------------------------------------------------------------------------------------------
def run_test(group, test, draws: Draws | None, required_seeds: set[int] | None = None) -> dict:
    """One paired test. ``required_seeds``: the test counts only with every one of them on both sides (else it
    has no data, and ``missing_seeds`` names what is missing)."""
    claim, a, b, measure, expected, effect, null = test
    A, B = group.get(a, {}), group.get(b, {})
    seeds = sorted(s for s in set(A) & set(B) if _has(A[s], measure) and _has(B[s], measure))
    out = {"claim": claim, "a": a, "b": b, "measure": measure, "expected": expected, "effect": effect, "null": null,
           "seeds": seeds, "n": len(seeds), "p": float("nan")}
    if required_seeds is not None and not set(required_seeds) <= set(seeds):
        out["missing_seeds"] = sorted(set(required_seeds) - set(seeds))
        return out
    if len(seeds) < 2:
        return out
    pc = paired_comparison([value(A[s], measure) for s in seeds], [value(B[s], measure) for s in seeds], null=null)
    out.update(mean=pc.mean_diff, sd=pc.sd_diff, low=pc.ci_low, high=pc.ci_high, p=pc.p_t)
    if draws is not None:
        reps = np.mean([draws.replicates(A[s], measure) - draws.replicates(B[s], measure) for s in seeds], axis=0)
        reps = reps[~np.isnan(reps)]
        out["boot_low"], out["boot_high"] = (float(q) for q in np.quantile(reps, [0.025, 0.975]))
    return out


def _has_data(r) -> bool:
    return r["n"] >= 2 and "missing_seeds" not in r


def decide(results: list[dict], rules: dict = ISSUE32_RULES) -> None:
    """Holm over the checkpoint's tests (the family the rules name), then study18's rule (in place)."""
    fixed = rules["family"] == "fixed"
    adjusted = holm([r["p"] for r in results], fixed_family=fixed)
    m = len(results) if fixed else max(1, sum(not math.isnan(p) for p in adjusted))
    for r, p in zip(results, adjusted):
        r["p_holm"], r["family"] = p, m
        side = 0 if not _has_data(r) or r["mean"] == r["null"] else (1 if r["mean"] > r["null"] else -1)
        boot_ok = "boot_low" not in r or (side > 0 and r["boot_low"] > r["null"]) or (side < 0 and r["boot_high"] < r["null"])
        r["called"] = bool(side and not math.isnan(p) and p < LEVEL and boot_ok)
        r["outcome"] = ("no data" if not _has_data(r) else "not called" if not r["called"] else
                        "differs" if r["expected"] == 0 else "supports" if side == r["expected"] else "contradicts")
        if _has_data(r) and not r["called"]:
            r["seeds_paper"] = seeds_for_power(r["effect"], r["sd"], 0.8, LEVEL / m)
            r["seeds_observed"] = seeds_for_power(abs(r["mean"] - r["null"]), r["sd"], 0.8, LEVEL / m)


def verdict(outcomes: list[str], rules: dict = ISSUE32_RULES) -> str:
    """A claim's verdict from its tests' outcomes.

    With ``missing: cannot tell both ways`` (and a fixed family, every seed required) a test without data could
    still go either way, so it rules out "holds" and "does not hold" alike, except where the present tests already
    decide: a call against (or a difference) stays a call whatever the missing test shows, since filling it in can
    only lower the other tests' Holm p-values. Without those rules (issue 32's) "does not hold" was reachable from
    a family that a missing test had shrunk, which more data could undo."""
    if any(o == "differs" for o in outcomes):  # a two-sided test of no predicted direction (P: dar's two forms)
        return "the forms differ"
    if rules["missing"] == "cannot tell both ways":
        if any(o == "contradicts" for o in outcomes):
            return "does not hold"
        missing = sum(o == "no data" for o in outcomes)
        if missing:
            return "no data" if missing == len(outcomes) else f"cannot tell ({missing} of {len(outcomes)} without data)"
        return "holds" if outcomes and all(o == "supports" for o in outcomes) else "cannot tell"
    if outcomes and all(o == "supports" for o in outcomes):
        return "holds"
    if any(o == "contradicts" for o in outcomes):
        return "does not hold"
    return "cannot tell" if any(o != "no data" for o in outcomes) else "no data"


def analyse(checkpoints: dict, protocol: dict, n_boot: int = N_BOOT) -> dict[int, list[dict]]:
    rules = rules_of(protocol)
    check_no_duplicate_tests(protocol)
    out = {}
    for tokens, group in checkpoints.items():
        any_record = next((r for o in group.values() for r in o.values()), None)
        draws = Draws(any_record, n_boot) if any_record is not None else None
        results = []
        for t in protocol["tests"]["list"]:
            required = protocol_seeds(protocol, t[1]) & protocol_seeds(protocol, t[2]) if rules["seeds"] == "all" else None
            results.append(run_test(group, t, draws, required))
        decide(results, rules)
        out[tokens] = results
    return out


def direction_changes(series: list[dict]) -> str:
    """How the sign of the effect moves with tokens: "no", "yes (called both ways)" or "sign only"."""
    called = {r["outcome"] for r in series if r["outcome"] in ("supports", "contradicts")}
    if len(called) == 2:
        return "yes (called both ways)"
    signs = {np.sign(r["mean"] - r["null"]) for r in series if _has_data(r)}
    return "sign only (not called both ways)" if len(signs) > 1 else "no"


# ---------------------------------------------------------------------------------------------
# markdown and plots
# ---------------------------------------------------------------------------------------------
def _f(x, spec="+.4f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _test_label(r) -> str:
    return f"{r['measure']}: {r['a']} − {r['b']}" + (f" (null {r['null']:+g})" if r["null"] else "")


def claim_lines(claim: str, analysis: dict, rules: dict = ISSUE32_RULES) -> list[str]:
    lines = [f"### {claim}", "", "| test | tokens | n | mean diff [95 % t] | bootstrap 95 % | p (Holm) | outcome | "
             "seeds for 80 % (paper / observed effect) |", "| --- | --- | ---: | --- | --- | ---: | --- | --- |"]
    verdicts = []
    for tokens, results in analysis.items():
        mine = [r for r in results if r["claim"] == claim]
        verdicts.append(f"{tokens_tag(tokens)}: **{verdict([r['outcome'] for r in mine], rules)}**")
        for r in mine:
            boot = f"[{_f(r.get('boot_low'))}, {_f(r.get('boot_high'))}]" if "boot_low" in r else "–"
            need = f"{r.get('seeds_paper') or '–'} / {r.get('seeds_observed') or '–'}" if "seeds_paper" in r else ""
            if "missing_seeds" in r:
                need = "seeds missing: " + ", ".join(map(str, r["missing_seeds"]))
            lines.append(f"| {_test_label(r)} | {tokens_tag(tokens)} | {r['n']} | {_f(r.get('mean'))} "
                         f"[{_f(r.get('low'))}, {_f(r.get('high'))}] | {boot} | {_f(r.get('p_holm'), '.3g')} | "
                         f"{r['outcome']} | {need} |")
    lines += ["", "Verdict by tokens seen: " + ", ".join(verdicts) + "."]
    tests = {(r["a"], r["b"], r["measure"]) for rs in analysis.values() for r in rs if r["claim"] == claim}
    for a, b, m in sorted(tests):
        series = [next(r for r in rs if (r["a"], r["b"], r["measure"]) == (a, b, m)) for rs in analysis.values()]
        lines.append(f"- {m}, {a} − {b}: direction changes with tokens: {direction_changes(series)}.")
    return lines + [""]


def summary_lines(protocol: dict, analysis: dict) -> list[str]:
    rules = rules_of(protocol)
    """One row per claim: its verdict at each checkpoint, the last one's being the verdict of record."""
    tags = [tokens_tag(t) for t in analysis]
    lines = ["## Verdicts", "", f"The verdict of record is the last checkpoint's ({tags[-1]} tokens); the earlier ones "
             "are the learning curve. Each claim's tests, intervals and the seeds an undecided test would need are "
             "in its section below.", "", "| claim | " + " | ".join(tags) + " |",
             "| --- |" + " --- |" * len(tags)]
    for claim in dict.fromkeys(t[0] for t in protocol["tests"]["list"]):
        row = [verdict([r["outcome"] for r in results if r["claim"] == claim], rules) for results in analysis.values()]
        lines.append(f"| {claim} | " + " | ".join(row[:-1] + [f"**{row[-1]}**"]) + " |")
    return lines + [""]


def descriptive_lines(protocol: dict, checkpoints: dict) -> list[str]:
    """The protocol's descriptive tests (``tests.descriptive``): paired t over the seeds both sides have, no Holm
    family, no verdict."""
    tests = protocol["tests"].get("descriptive", [])
    if not tests:
        return []
    lines = ["## Descriptive tests (no family, no verdict)", "", protocol["tests"].get("descriptive_note", ""), "",
             "| claim | test | tokens | n | mean diff [95 % t] | p (unadjusted) |", "| --- | --- | --- | ---: | --- | ---: |"]
    for tokens, group in checkpoints.items():
        for t in tests:
            r = run_test(group, t, None)
            lines.append(f"| {t[0]} | {_test_label(r)} | {tokens_tag(tokens)} | {r['n']} | {_f(r.get('mean'))} "
                         f"[{_f(r.get('low'))}, {_f(r.get('high'))}] | {_f(r.get('p'), '.3g')} |")
    return lines + [""]


def reanalysis_lines(protocol: dict, checkpoints: dict, n_boot: int) -> list[str]:
    """Issue 32's records under issue 42's rules (fixed family, every seed, missing data moves nothing) without the
    full-length tests, which repeat the masked-prefix ones (equal per passage): written after these results, so
    descriptive; the verdicts of record stay the ones above."""
    tests = [t for t in protocol["tests"]["list"] if not t[3].endswith("_full_length")]
    variant = dict(protocol, tests=dict(protocol["tests"], list=tests, rules=FIXED_RULES))
    analysis = analyse(checkpoints, variant, n_boot)
    tags = [tokens_tag(t) for t in analysis]
    lines = ["### The same records under issue 42's rules (written after these results: descriptive)", "",
             f"A fixed Holm family of the protocol's {len(tests)} tests without the {len(protocol['tests']['list']) - len(tests)} "
             "full-length ones (equal per passage to the masked-prefix ones), every one of the 8 seeds required, and a "
             "test without data ruling out both 'holds' and 'does not hold' unless a present test is already called "
             "against the claim.", "", "| claim | " + " | ".join(tags) + " |", "| --- |" + " --- |" * len(tags)]
    for claim in dict.fromkeys(t[0] for t in tests):
        row = [verdict([r["outcome"] for r in results if r["claim"] == claim], FIXED_RULES) for results in analysis.values()]
        lines.append(f"| {claim} | " + " | ".join(row) + " |")
    return lines + [""]


def plot_claim(claim: str, analysis: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tests = sorted({(r["a"], r["b"], r["measure"]) for rs in analysis.values() for r in rs if r["claim"] == claim})
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (a, b, m) in enumerate(tests):
        xs, ys, lo, hi = [], [], [], []
        for tokens, rs in analysis.items():
            r = next(r for r in rs if (r["a"], r["b"], r["measure"]) == (a, b, m))
            if _has_data(r):
                xs.append(tokens / 1e6 * (1 + 0.02 * i))
                ys.append(r["mean"])
                lo.append(r["mean"] - r["low"])
                hi.append(r["high"] - r["mean"])
        if xs:
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=f"{m}: {a} − {b}")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("pretraining tokens seen (M)")
    ax.set_ylabel("paired difference, mean over seeds (95 % t interval)")
    ax.set_title(f"{claim} against tokens seen")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _throughput_lines(kept: dict) -> list[str]:
    # every checkpoint's record repeats its cell's segments so far: each segment counts once
    segments = {(r["objective"], r["seed"], s.get("from_step"), s.get("to_step"), s.get("command_label")):
                s["tokens_per_second"] for r in kept.values() for s in r.get("pretrain_segments", [])
                if s.get("tokens_per_second")}
    rates = list(segments.values())
    if not rates:
        return []
    return [f"Pretraining throughput per process: mean {mean(rates):,.0f} tokens/s over {len(rates)} distinct segments "
            f"({min(rates):,.0f}–{max(rates):,.0f}).", ""]


def read_summaries(paths) -> list[dict]:
    """Each bundle's command summary, in the order given (a later command's last)."""
    return [s for s in (read_bundle(Path(p)).get("summary") for p in paths) if s]


def _exit_reason(code) -> str:
    if code is None:
        return "no exit code in the bundle (its command recorded none)"
    if code == 0:
        return "its worker exited 0, paused for time (left for a next command that did not come)"
    if code in (-9, 137):
        return f"its worker was killed at the command's limit (exit {code})"
    return f"its worker failed (exit {code})"


def unfinished_reasons(protocol: dict, checkpoints: dict, summaries: list[dict]) -> dict[str, str]:
    """'objective/seedN' -> why the cell lacks its last checkpoint or its fine-tuning: the last command that ran it
    (from the bundles' summaries), its worker's exit code, the fine-tuning tasks it had done and its log's last line."""
    last = checkpoints[protocol["checkpoint_tokens"][-1]]
    out = {}
    for part in protocol["parts"].values():
        for objective in part["objectives"]:
            for seed in part["seeds"]:
                record = last.get(objective, {}).get(seed)
                if record is not None and "finetune" in record:
                    continue
                what = "no fine-tuning record" if record is not None else "no record of the last checkpoint"
                suffix = f"__{objective}__seed{seed}"
                ran = [sm for sm in summaries if any(k.endswith(suffix) for k in sm.get("cells_to_run", []))]
                if not ran:
                    out[f"{objective}/seed{seed}"] = f"{what}; no returned bundle's command ran it"
                    continue
                sm = ran[-1]
                key = next(k for k in sm["cells_to_run"] if k.endswith(suffix))
                state = sm.get("unfinished_state", {}).get(key, {})
                parts = [what, f"last run by command {sm.get('command_label')} ({sm.get('minutes')} of its "
                               f"{sm.get('minutes_limit')} min)",
                         _exit_reason(sm.get("cell_exit_codes", {}).get(key))]
                if state.get("finetune_tasks_done"):
                    parts.append("fine-tuned: " + ", ".join(sorted(state["finetune_tasks_done"])))
                if state.get("log_tail"):
                    parts.append(f"log: `{state['log_tail'][-1].strip()}`")
                out[f"{objective}/seed{seed}"] = "; ".join(parts)
    return out


def _coverage_lines(protocol, checkpoints, excluded, summaries=()) -> list[str]:
    lines = ["## Records the rule excluded, and cells missing at each checkpoint", ""]
    lines += [f"- excluded `{name}`: {why}" for name, why in excluded] or ["- no record excluded"]
    cells = {(o, s) for p in protocol["parts"].values() for o in p["objectives"] for s in p["seeds"]}
    for tokens, group in checkpoints.items():
        missing = sorted(f"{o}/seed{s}" for o, s in cells if s not in group.get(o, {}))
        lines.append(f"- {tokens_tag(tokens)}: {len(cells) - len(missing)} of {len(cells)} cells count"
                     + (f"; missing: {', '.join(missing)}" if missing else ""))
    last = checkpoints[protocol["checkpoint_tokens"][-1]]
    tuned = {o: sorted(s for s, r in seeds.items() if "finetune" in r) for o, seeds in last.items()}
    lines.append("- fine-tuning at the last checkpoint (all four tasks): " + ", ".join(
        f"{o} {len(tuned.get(o, []))} of {sum(1 for c in cells if c[0] == o)}"
        for o in dict.fromkeys(o for part in protocol["parts"].values() for o in part["objectives"])))
    reasons = unfinished_reasons(protocol, checkpoints, list(summaries))
    if reasons:
        lines += ["", "Cells without their last checkpoint or fine-tuning, and why (from the bundles' summaries):", ""]
        lines += [f"- {cell}: {why}" for cell, why in reasons.items()]
    return lines + [""]


def _second_scorer_lines(protocol, kept: dict) -> list[str]:
    """Per cell, how the second scorer (``--second_scorer``) agreed with the package; nothing without its records."""
    scored = [r for r in kept.values() if "second_scorer" in r]
    if not scored:
        return []
    tolerance = max(r["second_scorer"].get("agreement", 0.0) for r in scored)
    lines = ["## The second scorer (lm-evaluation-harness)", "",
             "Each checkpoint's AR-protocol held-out passages scored by lm-evaluation-harness (rolling "
             "log-likelihood) and by the package's `ar_perplexity` on the same passages and windows; a set agrees "
             f"where the total NLLs differ by at most {tolerance:.1%}.", "",
             "| cell | checkpoints scored | max relative difference | disagreements (set × checkpoint) |",
             "| --- | --- | --- | --- |"]
    order = list(dict.fromkeys(o for part in protocol["parts"].values() for o in part["objectives"]))
    cells = sorted({(r["objective"], r["seed"]) for r in scored},
                   key=lambda c: (order.index(c[0]) if c[0] in order else len(order), c[0], c[1]))
    for objective, seed in cells:
        entries = [r["second_scorer"] for r in scored if (r["objective"], r["seed"]) == (objective, seed)]
        done = [e for e in entries if "skipped" not in e]
        skipped = sorted({e["skipped"].split(":")[0] for e in entries if "skipped" in e})
        sets = [s for e in done for s in e["sets"].values()]
        worst = f"{max(s['relative_difference'] for s in sets):.1e}" if sets else "–"
        wrong = str(sum(not s["agrees"] for s in sets)) if sets else "–"
        note = f" (skipped {len(entries) - len(done)}: {'; '.join(skipped)})" if skipped else ""
        lines.append(f"| {objective}/seed{seed} | {len(done)} of {len(entries)}{note} | {worst} | {wrong} |")
    return lines + [""]


def build_report(bundles, output: Path, plots_dir: Path | None, protocol_path: Path = PROTOCOL_PATH,
                 n_boot: int = N_BOOT, dry_run: dict | None = None) -> dict:
    """``dry_run``: {"tokens": [...], "objectives": [...], "seeds": [...]} of a CPU dry run (the driver's --tiny)."""
    protocol = load_protocol(protocol_path)
    if dry_run:
        protocol = dict(tiny_protocol(protocol, dry_run["tokens"]), sha256=protocol["sha256"])
        protocol["parts"] = {"dry": {"objectives": dry_run["objectives"], "seeds": dry_run["seeds"]}}
        protocol.pop("training_slice", None)  # a dry run trains on synthetic text
    kept, excluded = apply_rule(merge_bundles(bundles), protocol)
    checkpoints = by_checkpoint(kept, protocol)
    analysis = analyse(checkpoints, protocol, n_boot)
    issue32 = protocol.get("issue") == 32
    title = "# The study's learning curves (issue 32)" if issue32 else f"# The study {protocol['name']} (issue {protocol['issue']})"
    rules = "" if issue32 else " Missing data: " + protocol["tests"]["rules_text"] + "."
    lines = [title, "",
             f"Generated by `study/study_curves_report.py` from {len(bundles)} bundle(s) under the protocol "
             f"`study/{Path(protocol_path).name}` (SHA-256 `{protocol['sha256'][:16]}…`); do not edit by hand.",
             "", *([NOTE_STUDY18, ""] if issue32 else []),
             "Rule: " + protocol["tests"]["call"] + ". " + protocol["tests"]["family"] + rules, "",
             "Code commits of the counted records: " + ", ".join(sorted({r["code_commit"] for r in kept.values()})) + ".",
             ""]
    lines += _throughput_lines(kept)
    lines += _coverage_lines(protocol, checkpoints, excluded, read_summaries(bundles))
    lines += _second_scorer_lines(protocol, kept)
    lines += summary_lines(protocol, analysis)
    if issue32:
        lines += reanalysis_lines(protocol, checkpoints, n_boot)
    for claim in dict.fromkeys(t[0] for t in protocol["tests"]["list"]):
        lines += claim_lines(claim, analysis, rules_of(protocol))
        if plots_dir is not None:
            Path(plots_dir).mkdir(parents=True, exist_ok=True)
            path = plot_claim(claim, analysis, Path(plots_dir) / f"curve_{claim}.png")
            link = os.path.relpath(path, Path(output).parent).replace(os.sep, "/")
            lines += [f"![{claim} against tokens seen]({link})", ""]
    lines += descriptive_lines(protocol, checkpoints)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"analysis": analysis, "excluded": excluded, "checkpoints": checkpoints}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundles", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--plots_dir", default=None, help="default: the output's folder; --no_plots: none")
    p.add_argument("--no_plots", action="store_true")
    p.add_argument("--protocol", default=str(PROTOCOL_PATH))
    p.add_argument("--n_boot", type=int, default=N_BOOT)
    p.add_argument("--dry_run", nargs=3, metavar=("TOKENS", "OBJECTIVES", "SEEDS"), default=None,
                   help="a CPU dry run's sizes, comma-separated: e.g. 1024,2048 ar,mlm-0.15 0,1")
    args = p.parse_args(argv)
    plots = None if args.no_plots else Path(args.plots_dir or Path(args.output).parent)
    dry = None
    if args.dry_run:
        t, o, s = (x.split(",") for x in args.dry_run)
        dry = {"tokens": [int(x) for x in t], "objectives": o, "seeds": [int(x) for x in s]}
    build_report(args.bundles, Path(args.output), plots, Path(args.protocol), args.n_boot, dry)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
