"""The report of the seeded study: tables, verdicts, power and plots from the cells' JSON only.

    python study/study_report.py --results_dir docs/results/study18 --output docs/results/study18/RESULTS.md
    python study/study.py --report ...          # the same (study.py calls build_report / main here)

Reads every ``<preset>__<objective>__seed<s>.json`` (cells), ``...__failed__<run>.json`` (failures),
``run__<label>.json`` (one GPU call's summary) and ``sweep__<preset>__<objective>__lr<lr>.json`` (the learning-rate
sweep) in the folders given, and writes the markdown report and its PNG plots. The rule that calls a difference,
the power calculation and the paper's effect sizes (with the assumptions behind those the paper gives no number
for) are written at the top of the report itself (``RULE``, ``POWER_TEXT``, ``PAPER_EFFECTS``). The statistics
are in study_stats.py. Cells of the first grid (before issue 18) lack the per-example fields; their report
still builds, with every verdict marked as resting on the seed test alone.

Two rules decide which numbers enter a table or a test:

- a failed or timed-out cell (``...__failed__<run>.json``) whose JSON holds completed phases (``phase_seconds``)
  enters the tables and tests of those phases only (pretraining, perplexity, probes), never of the phase it was
  killed in; a cell that finished in another run enters with that run's JSON instead (``load_results``);
- the fine-tuning measure is the mean score over the tasks fine-tuned in every cell that fine-tuned any
  (``finetune_tasks``): when the time rule skipped a task in some cell, the task leaves the measure of every
  cell, and the test's label names the tasks kept. The probe average is always the four tasks'.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from study_stats import (POWER_METHOD, accuracy_metric, bootstrap_indices, holm, mean, paired_bootstrap,
                         paired_comparison, pearson_metric, power_paired_t, ratio_metric, sd, seeds_for_power)

OBJECTIVES = ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3", "gvp-k8", "mix-dar12-vmlm")
MASKED = ("mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3")
VMLM = "vmlm-0.15-0.3"
MIXTURE = "mix-dar12-vmlm"
TEXT_SETS = ("gutenberg", "bbc", "sotu", "brown")  # the order of the tables; a cell may hold a subset
TEXT_SET_NAMES = {"gutenberg": "Gutenberg", "bbc": "BBC News", "sotu": "State of the Union", "brown": "Brown"}
DOMAINS = (("Gutenberg (in-domain)", ("gutenberg",)), ("second domain (BBC + SOTU + Brown)", ("bbc", "sotu", "brown")))
TASKS = ("rotten_tomatoes", "trec", "vader_movie", "sms_spam")
SHORT_PREFIX_MAX = 15  # "short prefix": k <= 15 tokens visible
LONG_PREFIX_MIN = 64  # "long prefix": k >= 64
LEVEL = 0.05  # family-wise, two-sided
N_BOOT = 2000
BOOT_SEED = 0

# the effect each test is powered for: (value in the measure's unit, where it comes from)
PAPER_EFFECTS = {
    "C1": (0.019, "paper (a): dar (t = 2) +1.9 GLUE-average points over AR after fine-tuning. Assumption: the same "
                  "+0.019 on our four-task probe average and on the fine-tuning measure (0–1 scale; the paper gives no "
                  "probe number for dar)."),
    "C2": (None, "paper (a), Pile perplexity 59.6 (mask 0.15), 50.2 (0.3), 45.1 (variable): ln(50.2 / 45.1) = 0.107 "
                 "nats per token against 0.3 and ln(59.6 / 45.1) = 0.279 against 0.15. Assumption: the same "
                 "differences in nats at our scale."),
    "C3a": (0.107, "paper (a) Fig. 3 draws curves, no number. Assumption: a masked model's short-minus-long NLL gap "
                   "exceeds AR's by at least 0.107 nats (C2's smaller effect, taken as the smallest effect of "
                   "interest in NLL)."),
    "C3b": (0.107, "paper (a) Fig. 3, no number. Assumption: the variable ratio's gap is 0.107 nats smaller than "
                   "each fixed ratio's (its whole C2 advantage over mask 0.3 sitting in the gap)."),
    "C4": (0.019, "paper (a) §3.3 / Thm 4.1 is qualitative. Assumption: +0.019 on the probe average and on the "
                  "fine-tuning measure, C1's representation-quality scale."),
    "M": (None, "the mixture: margins, not paper effects. AR-level perplexity = AR-plan NLL within ln(1.05) = 0.0488 "
                "nats of ar's (perplexity within 5 %); masked-level probes = probe average at most 0.019 below "
                "vmlm-0.15-0.3's (C1's scale). Power is for a true difference of 0 (the margin away from the null)."),
}
C2_EFFECTS = {"mlm-0.15": math.log(59.6 / 45.1), "mlm-0.3": math.log(50.2 / 45.1)}
PPL_MARGIN = math.log(1.05)
PROBE_MARGIN = 0.019

RULE = (
    "**Rule for calling a difference.** Each test compares two objectives on one measure over the seeds both "
    "finished (same seed = same initial weights, data order and plans): the paired differences d give a paired "
    "t-test (two-sided). All the claims' tests of a preset (C1, C2, both halves of C3, C4 and the mixture's) form "
    "one family, and their p-values are Holm-adjusted. A difference is **called** when (1) its Holm-adjusted "
    "p-value is below 0.05 **and** (2) it survives the per-example bootstrap: the 95 % percentile interval of the "
    "seed-averaged difference, with the test examples (held-out passages for NLL) resampled, pooled over the "
    "seeds, excludes 0 on the same side. Condition (1) guards against seed noise and multiplicity, (2) against "
    "test-sample noise. A claim **holds** if every test it rests on is called in its direction, **does not hold** "
    "if any is called in the opposite direction, and otherwise we **cannot tell** — then with the power the "
    "design had for the paper's effect. Cells without per-example data (the first grid) cannot take the "
    "bootstrap: there, a call rests on (1) alone and is marked *seed test only*. The mixture's two questions are "
    "non-inferiority tests against a margin: the null is the margin, not 0, and the rule is the same.")
POWER_TEXT = (
    f"**Power.** For each test: the probability that the paired t-test over the n seeds it had rejects, if the "
    f"true difference is the paper's effect (table below) and the paired differences have the sd observed; "
    f"{POWER_METHOD}, df = n − 1. Given at the nominal level 0.05 and at 0.05 / m (m = the family's size: the "
    f"level Holm's first step uses, so a lower bound on the power under Holm); *seeds for 80 %* is the n that "
    f"reaches 0.8 at 0.05 / m with that sd. The bootstrap condition is not in the power (it rarely binds when the "
    f"seed test passes; the report shows both intervals). A claim of k tests needs all k: its power is at most the "
    f"smallest of theirs.")
PROTOCOL_TEXT = (
    "Protocols (DESIGN.md): *ar plan* = one forward with g[i] = i, the query stream at k sees x_<k; *masked prefix* "
    "= the prefix x_<k one bidirectional rank-0 group, x_k masked, nothing after k. Both score p(x_k | x_<k). The "
    "*natural* protocol of an objective is the package's default (`evaluation.perplexity.default_masked_mode`): "
    "ar plan for ar and dar-t2, masked prefix for the others. *NLL pooled over held-out sets* = the mean over the "
    "sets of each set's NLL per token (nats; each set weighs the same); *gap* = short-prefix NLL (k ≤ 15) minus "
    "long-prefix NLL (k ≥ 64). *Probe average* = the mean of the four tasks' test scores (accuracy, Pearson r for "
    "vader_movie). *Fine-tuning measure* = the mean score, at the learning rate picked on validation, of the tasks "
    "fine-tuned in every cell compared ({ft_tasks}); a task the time rule skipped in any cell leaves the measure "
    "of every cell. Scores are test scores (fine-tuning of the first grid: validation scores, it has no test "
    "score). Per-example bootstrap units: a held-out passage (resampled within its set), a test example of a task "
    "(within its task).")
PHASES = ("pretrain", "perplexity", "probe", "finetune")
# earlier studies kept beside the results folder: folder name -> what it was (a line at the top of the report)
EARLIER_STUDIES = {
    "study": "the previous study (the first GPU grid: BBC + SOTU + Brown, 8 M pretraining tokens per cell = 2 epochs "
             "of a 4 M-token corpus, 3 seeds)",
}


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def completed_phases(data: dict) -> list[str]:
    """The phases a cell's JSON holds and finished (timed in ``phase_seconds``): a phase killed midway (e.g. the
    fine-tuning saved task by task) is not one."""
    done = data.get("phase_seconds") or {}
    return [p for p in PHASES if p in data and p in done]


def salvage(failure: dict) -> dict | None:
    """A failed or timed-out cell reduced to its completed phases (None if it has none): it enters the tables and
    tests of those phases only. ``salvaged_phases`` names them; its status stays the failure's."""
    phases = completed_phases(failure)
    if not phases:
        return None
    out = {k: v for k, v in failure.items() if k not in PHASES or k in phases}
    out["salvaged_phases"] = phases
    return out


def finished(cells) -> list[dict]:
    """The cells that ran to their end (ok or partial), without the failed cells' completed phases."""
    return [c for c in cells if c["status"] in ("ok", "partial")]


def load_results(results_dirs) -> tuple[list[dict], list[dict], list[dict]]:
    """(cells, failures, runs) from the JSON in ``results_dirs`` (sweep files are read by ``load_sweeps``).

    ``cells``: the finished cells (ok, partial), then, for a key no finished cell has, the failed or timed-out
    cell reduced to its completed phases (``salvage``; of several failures, the one with the most phases).
    ``failures``: every failure as written."""
    cells, failures, runs, salvaged = {}, [], {}, {}
    for folder in map(Path, results_dirs):
        if not folder.is_dir():
            raise ValueError(f"--results_dir {folder} does not exist")
        for path in sorted(folder.glob("*.json")):
            if path.name.startswith("sweep__"):
                continue
            data = json.loads(path.read_text())
            if path.name.startswith("run__"):
                runs[data["run_label"]] = data
            elif data.get("status") in ("ok", "partial"):
                cells[data["key"]] = data
            elif "status" in data:
                failures.append(data)
                part = salvage(data)
                if part is not None and len(part["salvaged_phases"]) > len(
                        salvaged.get(data["key"], {}).get("salvaged_phases", [])):
                    salvaged[data["key"]] = part
    for key, part in salvaged.items():
        cells.setdefault(key, part)
    return list(cells.values()), failures, list(runs.values())


def load_sweeps(results_dirs) -> list[dict]:
    out = {}
    for folder in map(Path, results_dirs):
        for path in sorted(Path(folder).glob("sweep__*.json")):
            data = json.loads(path.read_text())
            data.setdefault("key", path.stem)
            out[path.stem] = data
    return list(out.values())


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def _pm(values, spec=".3f") -> str:
    values = [v for v in values if v is not None]
    if not values or any(math.isnan(v) for v in values):  # e.g. no token with a prefix that long
        return "–"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(mean(values), spec)} ± {format(sd(values), spec)}"


def _f(x, spec=".4f", sign=True) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return format(x, ("+" if sign else "") + spec)


def _p(p) -> str:
    if p is None or math.isnan(p):
        return "–"
    return "< 0.001" if p < 0.001 else f"{p:.3f}"


def sets_of(cell: dict) -> list[str]:
    present = cell["perplexity"]["sets"]
    return [n for n in TEXT_SETS if n in present] + sorted(n for n in present if n not in TEXT_SETS)


def natural(cell):
    return cell["perplexity"]["natural_protocol"]


def pooled_by_prefix(cell: dict, protocol: str) -> list[dict]:
    """Buckets of all held-out sets pooled: token-weighted NLL per prefix-length bucket."""
    pooled = {}
    for name in sets_of(cell):
        for b in cell["perplexity"]["sets"][name][protocol]["by_prefix_length"]:
            key = (b["prefix_length_min"], b["prefix_length_max"])
            tokens, total = pooled.get(key, (0, 0.0))
            pooled[key] = (tokens + b["num_tokens"], total + b["num_tokens"] * b["nll"])
    return [{"prefix_length_min": lo, "prefix_length_max": hi, "num_tokens": n, "nll": total / n}
            for (lo, hi), (n, total) in sorted(pooled.items()) if n]


def _bucket_nll(buckets, lo: int, hi: int) -> float:
    rows = [b for b in buckets if b["prefix_length_min"] >= lo and b["prefix_length_max"] <= hi]
    n = sum(b["num_tokens"] for b in rows)
    return sum(b["num_tokens"] * b["nll"] for b in rows) / n if n else float("nan")


def prefix_nll(cell: dict, protocol: str, lo: int, hi: int) -> float:
    return _bucket_nll(pooled_by_prefix(cell, protocol), lo, hi)


def by_objective(cells) -> dict[str, dict[int, dict]]:
    out = {}
    for c in cells:
        out.setdefault(c["objective"], {})[c["seed"]] = c
    return out


def _objectives_present(group) -> list[str]:
    return [o for o in OBJECTIVES if o in group] + sorted(o for o in group if o not in OBJECTIVES)


def c_metric(cells, where, task) -> str:
    for c in cells:
        entry = c["probe"].get(task) if where == "probe" else c.get("finetune", {}).get(where, {}).get(task)
        if entry:
            return entry["metric"]
    return "–"


def _ft_score(entry: dict) -> float:
    """A fine-tuning run's score: its test score (issue 18's cells), else its validation score (the first grid)."""
    return entry["test"] if entry.get("test") is not None else entry["validation"]


# ---------------------------------------------------------------------------------------------
# measures: a seed-level value per cell, and (when the cell has them) its per-example data for the bootstrap
# ---------------------------------------------------------------------------------------------
@dataclass
class Measure:
    name: str  # unique (cache key)
    label: str
    unit: str  # "nats" or "score"
    value: callable  # cell -> float (KeyError / TypeError: missing)
    sample: callable  # cell -> (sizes, fn(list of index matrices) -> values per replicate), or None


def _set_entry(cell, name, protocol):
    return cell["perplexity"]["sets"][name][protocol]


def _passages(cell, name, protocol):
    return _set_entry(cell, name, protocol).get("per_passage")


def _chosen_sets(cell, sets):
    """The held-out sets a measure reads: ``sets`` among the cell's (None: every set it has)."""
    names = [n for n in sets_of(cell) if sets is None or n in sets]
    if not names:
        raise KeyError("no such held-out set")
    return names


def nll_measure(protocol_of, sets=None, label="held-out NLL") -> Measure:
    """Mean over the held-out sets of each set's NLL per token (``sets``: a subset; None: every set the cell has)."""
    def value(c):
        return mean([_set_entry(c, n, protocol_of(c))["nll"] for n in _chosen_sets(c, sets)])

    def sample(c):
        per = [_passages(c, n, protocol_of(c)) for n in _chosen_sets(c, sets)]
        if any(p is None for p in per):
            return None
        fns = [ratio_metric(p["nll_sum"], p["tokens"]) for p in per]
        return [len(p["tokens"]) for p in per], lambda I: sum(f(i) for f, i in zip(fns, I)) / len(fns)

    tag = "all" if sets is None else "+".join(sets)
    return Measure(f"nll:{getattr(protocol_of, 'tag', '?')}:{tag}", label, "nats", value, sample)


def _short_long(c, name, protocol):
    entry = _set_entry(c, name, protocol)
    per = entry.get("per_passage")
    if per is not None and "short_nll_sum" in per:
        return (sum(per["short_nll_sum"]) / sum(per["short_tokens"]) if sum(per["short_tokens"]) else float("nan"),
                sum(per["long_nll_sum"]) / sum(per["long_tokens"]) if sum(per["long_tokens"]) else float("nan"))
    buckets = entry["by_prefix_length"]
    return _bucket_nll(buckets, 0, SHORT_PREFIX_MAX), _bucket_nll(buckets, LONG_PREFIX_MIN, 10**9)


def gap_measure(protocol_of, sets=None, part="gap") -> Measure:
    """part = "gap" (short - long), "short" or "long": mean over the sets of each set's value."""
    def one(short, long_):
        return {"gap": short - long_, "short": short, "long": long_}[part]

    def value(c):
        return mean([one(*_short_long(c, n, protocol_of(c))) for n in _chosen_sets(c, sets)])

    def sample(c):
        per = [_passages(c, n, protocol_of(c)) for n in _chosen_sets(c, sets)]
        if any(p is None or "short_nll_sum" not in p for p in per):
            return None
        fns = [(ratio_metric(p["short_nll_sum"], p["short_tokens"]), ratio_metric(p["long_nll_sum"], p["long_tokens"]))
               for p in per]
        return ([len(p["short_tokens"]) for p in per],
                lambda I: sum(one(s(i), l(i)) for (s, l), i in zip(fns, I)) / len(fns))

    labels = {"gap": f"NLL gap, short (k ≤ {SHORT_PREFIX_MAX}) − long (k ≥ {LONG_PREFIX_MIN})",
              "short": f"short-prefix NLL (k ≤ {SHORT_PREFIX_MAX})", "long": f"long-prefix NLL (k ≥ {LONG_PREFIX_MIN})"}
    tag = "all" if sets is None else "+".join(sets)
    return Measure(f"{part}:{getattr(protocol_of, 'tag', '?')}:{tag}", labels[part], "nats", value, sample)


def finetune_tasks(cells, where: str = "full") -> list[str]:
    """The tasks fine-tuned (mode ``where``) in every cell that fine-tuned any: the tasks of the fine-tuning
    measure (a failed cell without fine-tuning does not count; a task skipped for time in one cell drops out)."""
    have = [c for c in cells if any(_get(c, "finetune", where, t) for t in TASKS)]
    return [t for t in TASKS if have and all(_get(c, "finetune", where, t) for c in have)]


def score_label(where: str, tasks=TASKS, cells=()) -> str:
    """The measure's name; a fine-tuning measure over fewer than the four tasks names them."""
    if where == "probe":
        return "probe average"
    mode = {"full": "full fine-tuning", "lora": "LoRA fine-tuning"}[where]
    tasks = tuple(tasks)
    if tasks == TASKS:
        return f"{mode} average"
    if not tasks:
        return f"{mode} (no task fine-tuned in every cell)"
    if len(tasks) == 1:
        t = tasks[0]
        split = "test" if any(_get(c, "finetune", where, t, "test") is not None for c in cells) else "validation"
        return f"{mode} ({t} {split} {c_metric(cells, where, t)})"
    return f"{mode} average ({', '.join(tasks)})"


def score_measure(where: str, tasks=TASKS, label: str | None = None) -> Measure:
    """The four-task average of the probes (``probe``), or the average of a fine-tuning mode (``full``, ``lora``)
    over ``tasks`` (``finetune_tasks``): test scores (fine-tuning: the validation score where a cell of the first
    grid has no test score)."""
    tasks = tuple(TASKS if where == "probe" else tasks)

    def entries(c):
        if not tasks:
            raise KeyError("no task")
        if where == "probe":
            return [c["probe"][t] for t in tasks]
        return [c["finetune"][where][t] for t in tasks]

    def value(c):
        es = entries(c)
        return mean([e["test"] if where == "probe" else _ft_score(e) for e in es])

    def sample(c):
        es = entries(c)
        if any(e.get("test_predictions") is None or e.get("test_labels") is None for e in es):
            return None
        fns = [(pearson_metric if e["metric"] == "pearson" else accuracy_metric)(e["test_predictions"], e["test_labels"])
               for e in es]
        return [len(e["test_labels"]) for e in es], lambda I: sum(f(i) for f, i in zip(fns, I)) / len(fns)

    tag = "" if tasks == TASKS else ":" + "+".join(tasks)
    return Measure(f"score:{where}{tag}", label or score_label(where, tasks), "score", value, sample)


def _protocol(name):
    fn = (lambda c: natural(c)) if name == "natural" else (lambda c: name)
    fn.tag = name
    return fn


# ---------------------------------------------------------------------------------------------
# tests and claims
# ---------------------------------------------------------------------------------------------
@dataclass
class Test:
    claim: str  # "C1", "C2", "C3a", "C3b", "C4", "M"
    a: str
    b: str
    measure: Measure
    expected: int  # +1: the claim says a - b > null; -1: < null
    effect: float  # the effect (absolute, in the measure's unit) the power is computed for
    null: float = 0.0
    label: str = ""
    result: dict = field(default_factory=dict)


CLAIMS = {
    "C1": "C1. Diversity-enhanced AR (dar, t = 2) represents better than AR (paper (a): +1.9 GLUE average after "
          "fine-tuning)",
    "C2": "C2. Variable-length masking [0.15, 0.3] beats both fixed ratios on held-out perplexity (paper (a): Pile "
          "ppl 59.6 at 0.15, 50.2 at 0.3, 45.1 variable)",
    "C3a": "C3, first half. Masked models are worst at short prefixes: their short-minus-long NLL gap exceeds AR's "
           "(paper (a) Fig. 3)",
    "C3b": "C3, second half. The variable ratio narrows that gap: its short-minus-long NLL gap is smaller than each "
           "fixed ratio's (paper (a) Fig. 3)",
    "C4": "C4. Masked pretraining probes (and fine-tunes) better than AR (paper (a) §3.3, Thm 4.1)",
    "M": f"The mixture `{MIXTURE}`: AR-level perplexity (AR plan) and masked-level probes at once?",
}


SHORT_TITLES = {"C1": "C1: dar-t2 vs ar, representation quality", "C2": "C2: the variable ratio beats both fixed ratios (NLL)",
                "C3a": "C3, first half: masked models' short-long gap exceeds AR's",
                "C3b": "C3, second half: the variable ratio narrows the gap",
                "C4": "C4: masked pretraining probes / fine-tunes better than AR",
                "M": f"{MIXTURE}: AR-level perplexity and masked-level probes"}


def claim_tests(ft_tasks=TASKS, cells=()) -> list[Test]:
    """The family's tests; the fine-tuning ones over ``ft_tasks`` (``finetune_tasks`` of the compared cells)."""
    probe = score_measure("probe")
    full = score_measure("full", ft_tasks, score_label("full", ft_tasks, cells))
    masked_prefix, natural_p, ar_plan = _protocol("masked_prefix"), _protocol("natural"), _protocol("ar_plan")
    nll_mp = nll_measure(masked_prefix, label="held-out NLL (masked prefix, pooled over sets)")
    gap = gap_measure(natural_p)
    out = [Test("C1", "dar-t2", "ar", probe, +1, PAPER_EFFECTS["C1"][0]),
           Test("C1", "dar-t2", "ar", full, +1, PAPER_EFFECTS["C1"][0])]
    out += [Test("C2", VMLM, m, nll_mp, -1, C2_EFFECTS[m]) for m in ("mlm-0.15", "mlm-0.3")]
    out += [Test("C3a", m, "ar", gap, +1, PAPER_EFFECTS["C3a"][0]) for m in MASKED]
    out += [Test("C3b", VMLM, m, gap, -1, PAPER_EFFECTS["C3b"][0]) for m in ("mlm-0.15", "mlm-0.3")]
    out += [Test("C4", m, "ar", probe, +1, PAPER_EFFECTS["C4"][0]) for m in MASKED]
    out += [Test("C4", m, "ar", full, +1, PAPER_EFFECTS["C4"][0]) for m in MASKED]
    nll_ar = nll_measure(ar_plan, label="held-out NLL (AR plan, pooled over sets)")
    out += [Test("M", MIXTURE, "ar", nll_ar, -1, PPL_MARGIN, null=PPL_MARGIN,
                 label=f"AR-level perplexity: NLL (AR plan) {MIXTURE} − ar below the margin +{PPL_MARGIN:.4f}"),
            Test("M", MIXTURE, VMLM, probe, +1, PROBE_MARGIN, null=-PROBE_MARGIN,
                 label=f"masked-level probes: probe average {MIXTURE} − {VMLM} above the margin −{PROBE_MARGIN:.3f}")]
    for t in out:
        t.label = t.label or f"{t.measure.label}, {t.a} − {t.b}"
    return out


class _Draws:
    """Bootstrap replicates of a measure per cell, computed once: every test that uses the measure on the same
    examples reuses them (the index matrices are shared, so the resampling is paired across objectives)."""

    def __init__(self, n_boot: int, seed: int):
        self.n_boot, self.seed = n_boot, seed
        self.indices, self.values = {}, {}

    def sizes_and_fn(self, measure: Measure, cell: dict):
        try:
            got = measure.sample(cell)
        except (KeyError, TypeError):
            return None
        return got

    def idx(self, sizes):
        key = tuple(sizes)
        if key not in self.indices:
            self.indices[key] = bootstrap_indices(sizes, self.n_boot, self.seed)
        return self.indices[key]

    def fn(self, measure: Measure, cell: dict, sizes, raw):
        key = (measure.name, cell["key"])

        def cached(I):
            if I is self.indices.get(tuple(sizes)):
                if key not in self.values:
                    self.values[key] = raw(I)
                return self.values[key]
            return raw(I)

        return cached


def _seed_values(group, objective, measure: Measure) -> dict[int, float]:
    out = {}
    for seed, c in sorted(group.get(objective, {}).items()):
        try:
            v = measure.value(c)
        except (KeyError, TypeError):  # a partial cell (fine-tuning skipped), or a field the cell's schema lacks
            continue
        if v is not None and not math.isnan(v):
            out[seed] = v
    return out


def evaluate(group, test: Test, draws: _Draws) -> dict:
    """The seed test, the bootstrap and the power of one test (before Holm)."""
    va, vb = _seed_values(group, test.a, test.measure), _seed_values(group, test.b, test.measure)
    seeds = sorted(set(va) & set(vb))
    r = {"seeds": seeds, "n": len(seeds), "diffs": [va[s] - vb[s] for s in seeds], "null": test.null,
         "expected": test.expected, "effect": test.effect, "bootstrap": None, "bootstrap_note": "no data"}
    if not seeds:
        r.update(mean_diff=float("nan"), sd_diff=float("nan"), ci_low=float("nan"), ci_high=float("nan"),
                 p_t=float("nan"))
        return r
    pc = paired_comparison([va[s] for s in seeds], [vb[s] for s in seeds], null=test.null)
    r.update(mean_diff=pc.mean_diff, sd_diff=pc.sd_diff, ci_low=pc.ci_low, ci_high=pc.ci_high, p_t=pc.p_t, t=pc.t)
    # the per-example bootstrap: every paired seed must carry the examples, the same number on both sides
    fns, sizes = [], None
    for s in seeds:
        ca, cb = group[test.a][s], group[test.b][s]
        ga, gb = draws.sizes_and_fn(test.measure, ca), draws.sizes_and_fn(test.measure, cb)
        if ga is None or gb is None:
            r["bootstrap_note"] = "seed test only (no per-example data)"
            break
        if list(ga[0]) != list(gb[0]) or (sizes is not None and list(ga[0]) != sizes):
            r["bootstrap_note"] = "seed test only (the cells were scored on different examples)"
            break
        sizes = list(ga[0])
        fa, fb = draws.fn(test.measure, ca, sizes, ga[1]), draws.fn(test.measure, cb, sizes, gb[1])
        fns.append(lambda I, fa=fa, fb=fb: fa(I) - fb(I))
    else:
        boot = paired_bootstrap(fns, sizes, n_boot=draws.n_boot, seed=draws.seed, null=test.null,
                                indices=draws.idx(sizes))
        r["bootstrap"] = boot.to_dict()
        r["bootstrap_note"] = ""
    return r


def _power(r: dict, alpha: float) -> float:
    return power_paired_t(r["effect"], r["sd_diff"], r["n"], alpha) if r["n"] >= 2 else float("nan")


def decide(results: list[dict]) -> None:
    """Holm over the family, then the rule (in place): adds p_holm, called, direction, outcome, power."""
    adjusted = holm([r["p_t"] if r["n"] >= 2 else float("nan") for r in results])
    m = sum(not math.isnan(p) for p in adjusted)
    for r, p in zip(results, adjusted):
        r["p_holm"], r["family_size"] = p, m
        r["power_nominal"] = _power(r, LEVEL)
        r["power_family"] = _power(r, LEVEL / max(m, 1))
        r["seeds_for_80"] = seeds_for_power(r["effect"], r["sd_diff"], 0.8, LEVEL / max(m, 1)) if r["n"] >= 2 else None
        side = (1 if r["mean_diff"] > r["null"] else -1) if r["n"] and r["mean_diff"] != r["null"] else 0
        seed_ok = r["n"] >= 2 and not math.isnan(p) and p < LEVEL
        boot = r["bootstrap"]
        if boot is None:
            boot_ok = True  # seed test only
        else:
            boot_ok = (boot["low"] > r["null"] and side > 0) or (boot["high"] < r["null"] and side < 0)
        r["called"] = bool(seed_ok and boot_ok and side != 0)
        r["direction"] = side if r["called"] else 0
        r["outcome"] = outcome(r, r["expected"])


def outcome(result: dict | None, expected: int) -> str:
    """supports / contradicts the claim's direction (expected: +1 if the claim says a - b > null), or not called."""
    if result is None or not result.get("n"):
        return "no data"
    if result["n"] < 2:
        return "fewer than 2 paired seeds"
    if not result["called"]:
        return "not called"
    return "supports" if result["direction"] == expected else "contradicts"


def verdict(outcomes: list[str]) -> str:
    if outcomes and all(o == "supports" for o in outcomes):
        return "holds"
    if any(o == "contradicts" for o in outcomes):
        return "does not hold"
    return "cannot tell"


def mixture_verdict(ppl: str, probe: str) -> str:
    """The mixture's answer from its two tests' outcomes (ppl: AR-level perplexity, probe: masked-level probes)."""
    if ppl == "no data" and probe == "no data":
        return "no data"
    if ppl == "supports" and probe == "supports":
        return "both at once"
    if ppl == "contradicts" and probe == "contradicts":
        return "neither"
    if ppl == "supports" and probe == "contradicts":
        return "AR-level perplexity only"
    if ppl == "contradicts" and probe == "supports":
        return "masked-level probes only"
    say = {"supports": "reached", "contradicts": "not reached", "not called": "cannot tell"}
    return (f"cannot tell (AR-level perplexity: {say.get(ppl, ppl)}; masked-level probes: "
            f"{say.get(probe, probe)})")


def analyse(group, n_boot: int = N_BOOT, boot_seed: int = BOOT_SEED) -> dict:
    """Every claim's tests (evaluated, Holm-adjusted, decided) and verdicts, plus per-domain secondary results."""
    draws = _Draws(n_boot, boot_seed)
    cells = [c for o in group.values() for c in o.values()]
    ft_tasks = finetune_tasks(cells)
    tests = [t for t in claim_tests(ft_tasks, cells) if t.a in group and t.b in group]
    for t in tests:
        t.result = evaluate(group, t, draws)
    decide([t.result for t in tests])
    claims = {}
    for key in CLAIMS:
        mine = [t for t in tests if t.claim == key]
        if not mine:
            continue
        outs = [t.result["outcome"] for t in mine]
        v = mixture_verdict(*outs) if key == "M" and len(mine) == 2 else verdict(outs)
        claims[key] = {"title": CLAIMS[key], "verdict": v, "tests": mine}
    # per domain (secondary: not in the family, raw p): C2's and C3's tests restricted to each domain
    domains = []
    present = {n for c in cells if "perplexity" in c for n in sets_of(c)}
    if sum(any(n in present for n in sets) for _, sets in DOMAINS) > 1:
        for name, sets in DOMAINS:
            if not any(n in present for n in sets):
                continue
            rows = []
            for t in tests:
                if t.claim == "C2":
                    m = nll_measure(_protocol("masked_prefix"), sets, "held-out NLL (masked prefix)")
                elif t.claim in ("C3a", "C3b"):
                    m = gap_measure(_protocol("natural"), sets)
                else:
                    continue
                sub = Test(t.claim, t.a, t.b, m, t.expected, t.effect, t.null, f"{m.label}, {t.a} − {t.b}")
                sub.result = evaluate(group, sub, draws)
                rows.append(sub)
            domains.append((name, rows))
    return {"claims": claims, "tests": tests, "domains": domains, "finetune_tasks": ft_tasks}


# ---------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------
def _interval(lo, hi) -> str:
    if lo is None or math.isnan(lo):
        return "–"
    return f"[{_f(lo)}, {_f(hi)}]"


def _boot_text(r) -> str:
    b = r["bootstrap"]
    if b is None:
        return r["bootstrap_note"] or "–"
    return _interval(b["low"], b["high"])


def _power_text(x) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.2f}"


def test_table(tests: list[Test], with_claim: bool = False) -> list[str]:
    head = (("| claim | verdict " if with_claim else "") + "| test | n | effect (mean d) | 95 % t interval | "
            "bootstrap 95 % | p (t) | p (Holm) | outcome | effect powered for | power at 0.05 | power at 0.05/m "
            "| seeds for 80 % |")
    cols = head.count("|") - 1
    lines = [head, "|" + " --- |" * cols]
    for t in tests:
        r = t.result
        effect = t.null + t.expected * t.effect if t.null == 0 else t.null
        row = [t.label, str(r["n"]), _f(r["mean_diff"]), _interval(r["ci_low"], r["ci_high"]), _boot_text(r),
               _p(r["p_t"]), _p(r.get("p_holm")), f"**{r.get('outcome', '–')}**",
               _f(effect) + (" (margin)" if t.null else ""), _power_text(r.get("power_nominal")),
               _power_text(r.get("power_family")), str(r.get("seeds_for_80") or "–")]
        if with_claim:
            row = [t.claim, ""] + row
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary_lines(analysis: dict) -> list[str]:
    lines = ["| claim | verdict | tests called in its direction | against | smallest power at 0.05/m (paper's effect) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for key, claim in analysis["claims"].items():
        outs = [t.result["outcome"] for t in claim["tests"]]
        powers = [t.result.get("power_family") for t in claim["tests"]]
        powers = [p for p in powers if p is not None and not math.isnan(p)]
        seed_only = any(t.result["bootstrap"] is None and t.result["n"] >= 2 for t in claim["tests"])
        v = claim["verdict"] + (" (seed test only)" if seed_only else "")
        lines.append(f"| {claim['title'].split('.')[0] if key != 'M' else 'mixture'} | **{v}** | "
                     f"{outs.count('supports')} of {len(outs)} | {outs.count('contradicts')} | "
                     f"{_power_text(min(powers)) if powers else '–'} |")
    return lines


def claim_section(key: str, claim: dict, plot_rel: str | None) -> list[str]:
    tests = claim["tests"]
    out = [f"#### {claim['title']}: {claim['verdict']}.", ""]
    out += test_table(tests) + [""]
    for t in tests:
        r = t.result
        if r["n"] >= 2:
            out.append(f"- {t.label}: per seed " + ", ".join(f"s{s} {_f(d)}" for s, d in zip(r["seeds"], r["diffs"]))
                       + (f"; {r['bootstrap_note']}" if r["bootstrap_note"] else ""))
    seeds = sorted({n for t in tests for n in [t.result["n"]]})
    v = claim["verdict"]
    if v.startswith("cannot tell") or v == "no data":
        weakest = [t for t in tests if t.result.get("outcome") != "supports"]
        parts = [f"{t.label}: power {_power_text(t.result.get('power_family'))} at 0.05/m "
                 f"({_power_text(t.result.get('power_nominal'))} at 0.05), "
                 f"{t.result.get('seeds_for_80') or '–'} seeds for 80 %" for t in weakest]
        out += ["", f"Cannot tell with n = {'/'.join(map(str, seeds))} seeds. The tests not called in the claim's "
                    f"direction had: " + "; ".join(parts) + "."]
    if plot_rel:
        out += ["", f"![{key}: paired differences per seed]({plot_rel})"]
    return out + [""]


def domain_lines(analysis: dict) -> list[str]:
    out = []
    for name, rows in analysis["domains"]:
        out += [f"**{name}** (secondary: raw p, outside the Holm family)", "",
                "| claim | test | n | effect | 95 % t interval | bootstrap 95 % | p (t) |",
                "| --- | --- | ---: | ---: | --- | --- | ---: |"]
        for t in rows:
            r = t.result
            out.append(f"| {t.claim} | {t.label} | {r['n']} | {_f(r['mean_diff'])} | "
                       f"{_interval(r['ci_low'], r['ci_high'])} | {_boot_text(r)} | {_p(r['p_t'])} |")
        out.append("")
    return out


def _with(group, phase) -> dict[str, list[dict]]:
    """objective -> its cells that hold ``phase`` (a failed cell enters with its completed phases only)."""
    out = {o: [c for c in group[o].values() if phase in c] for o in _objectives_present(group)}
    return {o: cs for o, cs in out.items() if cs}


def _ppl_table(group, protocol_of) -> list[str]:
    sets = [n for n in TEXT_SETS if any(n in sets_of(c) for cs in _with(group, "perplexity").values() for c in cs)]
    lines = ["| objective | seeds | protocol | " + " | ".join(TEXT_SET_NAMES.get(n, n) for n in sets)
             + " | geometric mean |", "| --- | ---: | --- | " + " | ".join("---:" for _ in sets) + " | ---: |"]
    for o, cells in _with(group, "perplexity").items():
        protocols = sorted({protocol_of(c) for c in cells})
        row = [o, str(len(cells)), "/".join(p.replace("_", " ") for p in protocols)]
        for n in sets:
            row.append(_pm([c["perplexity"]["sets"][n][protocol_of(c)]["perplexity"] for c in cells
                            if n in c["perplexity"]["sets"]], ".1f"))
        row.append(_pm([math.exp(mean([c["perplexity"]["sets"][n][protocol_of(c)]["nll"] for n in sets_of(c)]))
                        for c in cells], ".1f"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _score_table(group, get, metric_of, tasks=TASKS) -> list[str]:
    """One column per task (the cells that have it), and the average over ``tasks`` (the tasks every cell has)."""
    def one(c, t):
        try:
            return get(c, t)
        except (KeyError, TypeError):
            return None

    tasks = tuple(tasks)
    average = "average" if tasks == TASKS else f"average ({', '.join(tasks) or 'no common task'})"
    lines = ["| objective | seeds | " + " | ".join(f"{t} ({metric_of(t)})" for t in TASKS) + f" | {average} |",
             "| --- | ---: | " + " | ".join("---:" for _ in TASKS) + " | ---: |"]
    for o in _objectives_present(group):
        cells = [c for c in group[o].values() if any(one(c, t) is not None for t in TASKS)]
        if not cells:
            continue
        row = [o, str(len(cells))] + [_pm([one(c, t) for c in cells]) for t in TASKS]
        row.append(_pm([mean([one(c, t) for t in tasks]) for c in cells if tasks and all(one(c, t) is not None
                                                                                      for t in tasks)]))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _prefix_table(group) -> list[str]:
    lines = ["| objective | protocol | ppl, k ≤ 15 | ppl, 16 ≤ k < 64 | ppl, k ≥ 64 | tokens k ≤ 15 (per seed) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for o, cells in _with(group, "perplexity").items():
        p = natural(cells[0]).replace("_", " ")
        vals = [[math.exp(prefix_nll(c, natural(c), lo, hi)) for c in cells]
                for lo, hi in ((0, SHORT_PREFIX_MAX), (SHORT_PREFIX_MAX + 1, LONG_PREFIX_MIN - 1), (LONG_PREFIX_MIN, 10**9))]
        tokens = sum(b["num_tokens"] for b in pooled_by_prefix(cells[0], natural(cells[0]))
                     if b["prefix_length_max"] <= SHORT_PREFIX_MAX)
        lines.append(f"| {o} | {p} | " + " | ".join(_pm(v, ".1f") for v in vals) + f" | {tokens:,} |")
    return lines


def _lr_text(lr) -> str:
    return f"{lr:g}"


def _sweep_field(s: dict, name: str):
    """A sweep run's field, top level first, then under ``pretrain`` (the cell worker's record)."""
    value = s.get(name)
    return _get(s, "pretrain", name) if value is None else value


def _sweep_lr(s: dict):
    lr = _sweep_field(s, "learning_rate")
    if lr is None and "__lr" in s.get("key", ""):
        try:
            lr = float(s["key"].split("__lr", 1)[1].split("__", 1)[0])
        except ValueError:
            lr = None
    return None if lr is None else float(lr)


def _source_text(source) -> str:
    if isinstance(source, dict):
        return str(source.get("method") or "recorded")
    return str(source)


def sweep_lines(sweeps: list[dict], cells: list[dict], preset: str) -> list[str]:
    """Objective x learning rate -> validation loss; the learning rate the grid's cells used in bold, diverged marked."""
    def preset_of(s):
        return s.get("preset") or _get(s, "settings", "preset") or (s["key"].split("__") + ["", ""])[1]

    mine = [s for s in sweeps if preset_of(s) == preset and s.get("objective") and _sweep_lr(s) is not None]
    if not mine:
        return []
    lrs = sorted({_sweep_lr(s) for s in mine})
    objectives = [o for o in OBJECTIVES if any(s["objective"] == o for s in mine)]
    objectives += sorted({s["objective"] for s in mine} - set(objectives))
    chosen = {}
    for c in cells:
        lr = _get(c, "pretrain", "learning_rate")
        if lr is not None:
            chosen.setdefault(c["objective"], set()).add(float(lr))
    sources = sorted({_source_text(_get(c, "pretrain", "learning_rate_source")) for c in cells
                      if _get(c, "pretrain", "learning_rate_source")})
    lines = ["| objective | " + " | ".join(f"lr {_lr_text(lr)}" for lr in lrs) + " | chosen |",
             "| --- | " + " | ".join("---:" for _ in lrs) + " | ---: |"]
    for o in objectives:
        row = [o]
        for lr in lrs:
            runs = [s for s in mine if s["objective"] == o and math.isclose(_sweep_lr(s), lr)]
            runs.sort(key=lambda s: s.get("status", "ok") != "ok")  # a finished run before a failed one
            if not runs:
                row.append("–")
                continue
            s = runs[0]
            loss = _sweep_field(s, "validation_loss")
            finite = isinstance(loss, (int, float)) and math.isfinite(loss)
            if s.get("status", "ok") != "ok":
                text = s.get("status", "failed")
            elif s.get("diverged"):
                text = f"{loss:.3f} (diverged)" if finite else "diverged"
            else:
                text = f"{loss:.3f}" if finite else "–"
            if any(math.isclose(lr, x) for x in chosen.get(o, ())):
                text = f"**{text}** ✓"
            row.append(text)
        row.append(", ".join(_lr_text(x) for x in sorted(chosen.get(o, ()))) or "–")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Validation loss of the objective's own loss after each sweep run's pretraining; ✓ (bold): the "
                  "learning rate the grid's cells used" + (f" ({'; '.join(sources)})" if sources else "")
              + "; *diverged*: non-finite losses, or a final training loss above the first logged one or above 1.5 × "
                "the best rate's (the sweep's rule)."]
    return lines


def _get(d, *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _settings_lines(cells) -> list[str]:
    c = cells[0]
    s, prep, pre = c["settings"], c.get("prep", {}), c.get("pretrain", {})
    corpora = ", ".join(f"{TEXT_SET_NAMES.get(k, k)} {v.get('documents', 0):,} documents / {v.get('characters', 0):,} "
                        f"characters" for k, v in (prep.get("train_corpora") or {}).items() if isinstance(v, dict))
    one = prep.get("train_corpus")
    if not corpora and isinstance(one, dict):  # issue 18's cells: one training corpus
        corpora = f"{TEXT_SET_NAMES.get(one.get('name'), one.get('name', '?'))} {one.get('documents', 0):,} documents"
    held = ", ".join(f"{TEXT_SET_NAMES.get(k, k)} {v.get('passages', '?')} passages / {v.get('characters', 0):,} "
                     f"characters from {v.get('documents_in_split', '?')} documents"
                     for k, v in (prep.get("heldout_sizes") or {}).items() if isinstance(v, dict))
    ft_eval = "whole validation split" if not s.get("ft_eval") else f"{s['ft_eval']} validation sentences (a fixed random sample)"
    probe_sizes = "; ".join(f"{t} {_get(c, 'probe', t, 'sizes', 'train', 'used', default='?')}/"
                            f"{_get(c, 'probe', t, 'sizes', 'validation', 'used', default='?')}/"
                            f"{_get(c, 'probe', t, 'sizes', 'test', 'used', default='?')}" for t in TASKS)
    lrs = sorted({(x["objective"], x.get("pretrain", {}).get("learning_rate", x["settings"].get("learning_rate")))
                  for x in cells}, key=lambda p: (OBJECTIVES.index(p[0]) if p[0] in OBJECTIVES else 99, p[0]))
    lr_text = ("AdamW lr " + ", ".join(f"{o} {lr:g}" for o, lr in lrs if lr is not None)
               if len({lr for _, lr in lrs}) > 1 else f"AdamW lr {lrs[0][1]:g}" if lrs and lrs[0][1] else "AdamW")
    speeds = [x["pretrain"]["tokens_per_second"] for x in cells if _get(x, "pretrain", "tokens_per_second")]
    ft_split = "test split (model chosen on validation)" if any(
        _get(x, "finetune", "full", t, "test") is not None for x in cells for t in TASKS) else ft_eval
    lines = [
        f"- Model: preset `{s.get('preset', c['preset'])}` ({pre.get('parameters', 0):,} parameters), vocabulary "
        f"{prep.get('vocab_size', s.get('vocab_size', 0)):,} (byte-level BPE trained on the training text), blocks of "
        f"{s.get('block_size', '?')} tokens.",
        f"- Pretraining: {s.get('steps', 0):,} steps × {s.get('batch_size', '?')} blocks = {pre.get('tokens', 0):,} "
        f"tokens per cell ({pre.get('epochs', float('nan')):.2f} epochs of {prep.get('train_tokens', 0):,} tokens), "
        f"{lr_text}, cosine, warm-up {s.get('warmup_fraction', 0):.0%}, "
        f"{'bf16 autocast' if s.get('device') == 'cuda' else 'fp32'} on "
        f"{', '.join(sorted({_get(x, 'versions', 'device', default='?') for x in cells}))}"
        + (f", {mean(speeds):,.0f} tokens/s per cell (mean; {min(speeds):,.0f}–{max(speeds):,.0f})" if speeds else "")
        + f". Text: {corpora} (train splits).",
        f"- Held-out perplexity: test-split passages of at most {s.get('ppl_passage_chars', '?')} characters, "
        f"{s.get('ppl_passages', '?')} per set spread evenly, each scored from its start ({held}); windows of "
        f"{s.get('block_size', '?')}, stride {s.get('block_size', 2) // 2}; both protocols for every objective.",
        f"- Probes: logistic regression (ridge for vader_movie) on frozen mean-pooled features of the first "
        f"{s.get('max_seq_length', '?')} tokens, C (alpha) chosen on validation, score on test; train/validation/test "
        f"sizes: {probe_sizes}.",
        f"- Fine-tuning (GLUE harness, `evaluation.glue.run`): "
        f"{'the whole train split' if s.get('ft_train', '?') is None else str(s.get('ft_train', '?')) + ' training sentences'}, "
        f"{s.get('ft_epochs', 0):g} epoch(s), batch {s.get('ft_batch_size', '?')}, scored on the {ft_split}"
        + (f"; full fine-tuning lr {s['ft_learning_rate']:g}" if s.get("ft_learning_rate") else "")
        + (f", LoRA lr {s['lora_learning_rate']:g} (r = 8)" if s.get("lora_learning_rate") else "") + ".",
        f"- Package commit(s): {', '.join(sorted({str(x.get('git_commit')) for x in cells}))}; torch "
        f"{', '.join(sorted({str(_get(x, 'versions', 'torch')) for x in cells}))}, transformers "
        f"{', '.join(sorted({str(_get(x, 'versions', 'transformers')) for x in cells}))}; tokenizer sha256 "
        f"{', '.join(sorted({str(prep.get('tokenizer_sha256')) for x in cells for prep in [x.get('prep', {})]}))}.",
    ]
    grids = [_get(x, "finetune", "full", t, "lr_grid") for x in cells for t in TASKS]
    grids = sorted({tuple(g) for g in grids if g})
    if grids:
        lines.append("- Fine-tuning learning rate chosen per run on validation from " +
                     "; ".join("{" + ", ".join(f"{v:g}" for v in g) + "}" for g in grids) + ".")
    return lines


def _compact_cells(keys) -> str:
    """small__ar__seed0, small__ar__seed1 -> 'small ar s0,1'."""
    groups = {}
    other = []
    for k in keys:
        parts = k.split("__")
        if len(parts) == 3 and parts[2].startswith("seed"):
            groups.setdefault((parts[0], parts[1]), []).append(int(parts[2][4:]))
        else:
            other.append(k)
    items = [f"{p} {o} s{','.join(map(str, sorted(s)))}" for (p, o), s in sorted(groups.items())]
    return "; ".join(items + sorted(other)) or "–"


def _machine(run: dict | None, mine: list[dict]) -> str:
    m = (run or {}).get("machine")
    if isinstance(m, dict) and m.get("gpu_names"):
        return f"{m.get('gpu_count', '?')} × {', '.join(m['gpu_names'])}"
    if isinstance(m, str):
        return m
    devices = sorted({_get(c, "versions", "device") or c.get("device") or "–" for c in mine})
    return ", ".join(devices) or "–"


def _flag_values(command: str, flag: str) -> list[str]:
    """The values after ``flag`` in a recorded command line (up to the next flag)."""
    words = (command or "").split()
    if flag not in words:
        return []
    out = []
    for w in words[words.index(flag) + 1:]:
        if w.startswith("--"):
            break
        out.append(w)
    return out


def unrecorded_cells(run: dict) -> list[str]:
    """Cells a call was asked for (its command's --cells, or --presets x --objectives x --seeds) that its summary
    names in no list (done before, ok, failed, not started): a call cut at its limit loses them."""
    cmd = run.get("command", "")
    if "--sweep" in cmd.split():
        return []
    wanted = _flag_values(cmd, "--cells")
    if not wanted:
        presets, objectives, seeds = (_flag_values(cmd, f) for f in ("--presets", "--objectives", "--seeds"))
        wanted = [f"{p}__{o}__seed{s}" for p in presets for o in objectives for s in seeds]
    named = set()
    for k in ("cells_done_before", "cells_ok", "cells_failed", "cells_not_started"):
        named |= set(run.get(k) or [])
    return [k for k in wanted if k not in named]


def _cost_lines(cells, failures, runs, sweeps=()) -> list[str]:
    sweeps = [s for s in sweeps if s.get("run_label")]
    labels = sorted({c["run_label"] for c in cells} | {f["run_label"] for f in failures} | {r["run_label"] for r in runs}
                    | {s["run_label"] for s in sweeps})
    lines = ["| run | machine | summary status | cells ok | cells partial | cells failed | sweep runs | finished, JSON lost "
             "| no record | cell-minutes (sum of cell wall times) | call wall minutes (first cell start → last cell end) "
             "| driver wall minutes (prep included) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lost_all, unrecorded_all = [], []
    total_sum = total_span = 0.0
    for label in labels:
        mine = [c for c in cells if c["run_label"] == label] + [f for f in failures if f["run_label"] == label]
        swept = [s for s in sweeps if s["run_label"] == label]
        ok = sum(c["status"] == "ok" for c in mine)
        partial = sum(c["status"] == "partial" for c in mine)
        timed = mine + swept
        cell_minutes = sum(c.get("wall_seconds") or 0.0 for c in timed) / 60
        span = 0.0
        stamps = [c for c in timed if c.get("started_utc") and c.get("finished_utc")]
        if stamps:
            starts = [dt.datetime.strptime(c["started_utc"], "%Y-%m-%dT%H:%M:%SZ") for c in stamps]
            ends = [dt.datetime.strptime(c["finished_utc"], "%Y-%m-%dT%H:%M:%SZ") for c in stamps]
            span = (max(ends) - min(starts)).total_seconds() / 60
        run = next((r for r in runs if r["run_label"] == label), None)
        driver = f"{run['wall_seconds'] / 60:.1f}" if run and "wall_seconds" in run else "–"
        # cells the call's summary lists as finished but whose JSON is not here (e.g. not returned by the device)
        kept = {c["key"] for c in mine} | {s["key"] for s in swept}
        lost = sorted(set(run.get("cells_ok", []) + run.get("cells_failed", [])) - kept) if run else []
        lost_all += [(label, k) for k in lost]
        unrecorded = unrecorded_cells(run) if run else []
        unrecorded_all += [(label, k) for k in unrecorded]
        total_sum += cell_minutes
        total_span += span
        status = (run or {}).get("status", "–")
        lines.append(f"| {label} | {_machine(run, mine)} | {status} | {ok} | {partial} | {len(mine) - ok - partial} "
                     f"| {len(swept)} | {len(lost)} | {len(unrecorded)} | {cell_minutes:.1f} | {span:.1f} | {driver} |")
    ok_all = sum(c["status"] == "ok" for c in cells)
    lines.append(f"| all | | | {ok_all} | {len(cells) - ok_all} | {len(failures)} | {len(sweeps)} | {len(lost_all)} "
                 f"| {len(unrecorded_all)} | {total_sum:.1f} | {total_span:.1f} | |")
    driver_total = sum(r.get("wall_seconds", 0.0) for r in runs) / 60
    lines += ["", f"In all: {len(labels)} call(s); {driver_total:.1f} minutes of driver wall time (prep included; "
                  f"the device minutes the calls spent), {total_span:.1f} minutes from first cell start to last cell end, "
                  f"{total_sum:.1f} cell-minutes."]
    if runs:
        lines += ["", "Cells per call (from the `run__*.json` summaries; *not started*: left for lack of time):", ""]
        for r in sorted(runs, key=lambda r: r["run_label"]):
            mine = [c for c in cells if c["run_label"] == r["run_label"]]
            parts = [f"ok {_compact_cells(r.get('cells_ok', []))}"]
            if r.get("cells_failed"):
                parts.append(f"failed {_compact_cells(r['cells_failed'])}")
            if r.get("cells_not_started"):
                parts.append(f"not started {_compact_cells(r['cells_not_started'])}")
            if unrecorded_cells(r):
                parts.append(f"no record {_compact_cells(unrecorded_cells(r))}")
            minutes = f"{r['wall_seconds'] / 60:.1f} min" if "wall_seconds" in r else "– min"
            cut = "; summary left `running`: the call was cut at its time limit" if r.get("status") == "running" else ""
            lines.append(f"- `{r['run_label']}` ({_machine(r, mine)}, {minutes}, started {r.get('started_utc', '?')}{cut}): "
                         + "; ".join(parts) + ".")
    if unrecorded_all:
        lines += ["", f"{len(unrecorded_all)} cell(s) a call was asked for have no record at all (not in its summary, no "
                      "JSON): the call was cut at its time limit before they were written: "
                      + ", ".join(f"{k} ({label})" for label, k in unrecorded_all) + "."]
    if lost_all:
        kept = {c["key"]: c["run_label"] for c in cells}
        lines += ["", f"{len(lost_all)} cell(s) finished in a call but their JSON never came back, so that call's "
                      "minutes bought nothing for them (the cell-minutes above count only the JSON kept): "
                      + ", ".join(f"{k} (lost from {label}" + (f", the kept one is from {kept[k]})" if k in kept else ")")
                                  for label, k in lost_all) + "."]
    return lines


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(group, preset: str, plots_dir: Path) -> dict[str, Path]:
    plt = _pyplot()
    plots_dir.mkdir(parents=True, exist_ok=True)
    paths = {"prefix": plots_dir / f"ppl_by_prefix_{preset}.png", "probe": plots_dir / f"probe_{preset}.png"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, o in enumerate(_objectives_present(group)):
        mine = [c for c in group[o].values() if "perplexity" in c]
        if not mine:
            continue
        curves = [pooled_by_prefix(c, natural(c)) for c in mine]
        keys = sorted({(b["prefix_length_min"], b["prefix_length_max"]) for curve in curves for b in curve})
        x, mid, lo, hi = [], [], [], []
        for key in keys:
            ppl = [math.exp(b["nll"]) for curve in curves for b in curve
                   if (b["prefix_length_min"], b["prefix_length_max"]) == key]
            x.append(max(0.5, (key[0] + key[1]) / 2))
            mid.append(mean(ppl))
            lo.append(min(ppl))
            hi.append(max(ppl))
        ax.plot(x, mid, marker="o", ms=3, color=f"C{i}", label=f"{o} ({natural(mine[0]).replace('_', ' ')})")
        ax.fill_between(x, lo, hi, color=f"C{i}", alpha=0.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix length k (tokens visible before the target)")
    ax.set_ylabel("held-out perplexity p(x_k | x_<k)")
    ax.set_title(f"{preset}: perplexity against prefix length (line: mean of seeds, band: min–max)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["prefix"], dpi=110)
    plt.close(fig)

    objectives = _objectives_present(group)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(objectives))
    for i, o in enumerate(objectives):
        scores = [[c["probe"][t]["test"] for c in group[o].values() if "probe" in c] for t in TASKS]
        if not scores[0]:
            continue
        ax.bar([j + i * width for j in range(len(TASKS))], [mean(s) for s in scores], width,
               yerr=[sd(s) if len(s) > 1 else 0 for s in scores], capsize=2, color=f"C{i}", label=o)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(TASKS))],
                  [f"{t}\n({'pearson' if t == 'vader_movie' else 'accuracy'})" for t in TASKS])
    ax.set_ylabel("linear probe, test")
    ax.set_ylim(0, 1)
    ax.set_title(f"{preset}: linear probes on frozen features (error bars: sd over seeds)", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(paths["probe"], dpi=110)
    plt.close(fig)
    return paths


def plot_claim(key: str, claim: dict, preset: str, path: Path) -> Path:
    """One row per test: the paired difference of each seed (dots), their mean with the 95 % t interval (black),
    the per-example bootstrap interval (orange), 0 / the margin (grey line) and the effect powered for (green)."""
    plt = _pyplot()
    tests = claim["tests"]
    share = len({(t.measure.unit, t.null) for t in tests}) == 1  # one scale: the tests compare at a glance
    height = 0.9 + 1.0 * len(tests)
    fig, axes = plt.subplots(len(tests), 1, figsize=(7.5, height), squeeze=False, sharex=share)
    for ax, t in zip(axes[:, 0], tests):
        r = t.result
        ax.axvline(t.null, color="0.4", lw=1, label="margin" if t.null else "no difference")
        target = t.null + t.expected * t.effect if t.null == 0 else None
        if target is not None:
            ax.axvline(target, color="C2", lw=1, ls="--", label="effect powered for")
        if r["n"]:
            jitter = [0.12 * ((i % 5) - 2) / 2 for i in range(r["n"])]
            ax.scatter(r["diffs"], jitter, s=14, color="C0", zorder=3, label="seeds (paired d)")
            if r["n"] >= 2:
                ax.errorbar([r["mean_diff"]], [0.45], xerr=[[r["mean_diff"] - r["ci_low"]], [r["ci_high"] - r["mean_diff"]]],
                            fmt="o", color="k", ms=4, capsize=3, label="mean, 95 % t interval")
            b = r["bootstrap"]
            if b is not None and not math.isnan(b["low"]):
                ax.errorbar([b["estimate"]], [-0.45], xerr=[[b["estimate"] - b["low"]], [b["high"] - b["estimate"]]],
                            fmt="s", color="C1", ms=4, capsize=3, label="per-example bootstrap 95 %")
        ax.set_ylim(-0.8, 0.8)
        ax.set_yticks([])
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{t.label} — {r.get('outcome', '–')} (Holm p {_p(r.get('p_holm'))})", fontsize=7, loc="left")
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    for ax in axes[:, 0]:
        ax.tick_params(axis="x", labelbottom=True)
    if handles:
        fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=len(handles), frameon=False)
    fig.suptitle(f"{preset} — {SHORT_TITLES.get(key, key)}: {claim['verdict']}", fontsize=8)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def build_report(results_dirs, output: Path, plots_dir: Path | None = None, plots: bool = True,
                 notes: Path | None = None, n_boot: int = N_BOOT, boot_seed: int = BOOT_SEED) -> str:
    """The markdown report (written to ``output``) from the JSON in ``results_dirs``; ``notes`` (default:
    ``<first results dir>/NOTES.md`` if it exists), a hand-written reading of the numbers, is included verbatim."""
    results_dirs = [results_dirs] if isinstance(results_dirs, (str, Path)) else list(results_dirs)
    output = Path(output)
    cells, failures, runs = load_results(results_dirs)
    sweeps = load_sweeps(results_dirs)
    if not cells and not failures:
        raise ValueError(f"no cell JSON in {results_dirs}: run the grid first")
    presets = [p for p in dict.fromkeys(c["preset"] for c in cells)]
    order = {p: i for i, p in enumerate(("tiny", "mini", "small", "base", "large"))}
    presets.sort(key=lambda p: order.get(p, 99))
    plots_dir = Path(plots_dir) if plots_dir else Path(results_dirs[0])

    def rel(path: Path) -> str:
        return os.path.relpath(path, output.parent).replace(os.sep, "/")

    here = {Path(d).resolve() for d in results_dirs}
    earlier = [(name, Path(results_dirs[0]).parent / name) for name in EARLIER_STUDIES]
    earlier = [(name, path) for name, path in earlier if path.is_dir() and path.resolve() not in here]

    analyses = {}
    for preset in presets:
        mine = [c for c in cells if c["preset"] == preset]
        ids = sorted({c["settings_id"] for c in mine})
        if len(ids) > 1:
            raise ValueError(f"preset {preset}: cells with different settings ({ids}) in {results_dirs}; "
                             "keep each grid's JSON in its own folder")
        analyses[preset] = analyse(by_objective(mine), n_boot, boot_seed)
    ft_text = "; ".join(f"preset `{p}`: " + (", ".join(a["finetune_tasks"]) + (" alone" if len(a["finetune_tasks"]) == 1
                                                                              else "") if a["finetune_tasks"] else "none")
                        for p, a in analyses.items())
    out = [
        "# The seeded study of the papers' claims",
        "",
        "Generated by `python study/study.py --report` (study/study_report.py) from the JSON files of every "
        "cell (objective × preset × seed); do not edit by hand. Each cell pretrains one model and measures it; "
        "tables give mean ± sd over the seeds that measured the table's phase.",
        "",
    ]
    for name, path in earlier:
        link = rel(path)
        parts = Path(path).resolve().parts  # shown as from the repository root (docs/...)
        shown = "/".join(parts[len(parts) - 1 - parts[::-1].index("docs"):]) if "docs" in parts else link
        out += [f"Earlier: {EARLIER_STUDIES[name]}: its cells are in [`{shown}/`]({link}/); its report is "
                f"reproducible with `python study/study.py --report --results_dir {shown}` (with `--output` "
                f"elsewhere).", ""]
    out += [
        RULE,
        "",
        POWER_TEXT,
        "",
        PROTOCOL_TEXT.format(ft_tasks=ft_text),
        "",
        "**Effects powered for** (the paper's, or an assumption where it gives no number):",
        "",
    ]
    for key, (_, text) in PAPER_EFFECTS.items():
        out.append(f"- {('mixture' if key == 'M' else key)}: {text}")
    out += ["", "## Verdicts", ""]
    for preset in presets:
        out += [f"Preset `{preset}` ({len({c['seed'] for c in cells if c['preset'] == preset})} seeds; family of "
                f"{max([t.result.get('family_size', 0) for t in analyses[preset]['tests']] or [0])} tests):", ""]
        out += summary_lines(analyses[preset]) + [""]
    for preset in presets:
        mine = [c for c in cells if c["preset"] == preset]
        group = by_objective(mine)
        analysis = analyses[preset]
        out += [f"## Preset `{preset}`", "", "### The claims", ""]
        for key, claim in analysis["claims"].items():
            plot_rel = None
            if plots:
                plot_rel = rel(plot_claim(key, claim, preset, plots_dir / f"claim_{key}_{preset}.png"))
            out += claim_section(key, claim, plot_rel)
        if analysis["domains"]:
            out += ["### C2 and C3 per domain", ""] + domain_lines(analysis)
        out += ["### Settings", ""] + _settings_lines(mine)
        sweep = sweep_lines(sweeps, mine, preset)
        if sweep:
            out += ["", "### Pretraining learning-rate sweep (validation loss)", ""] + sweep
        out += ["", "### Held-out perplexity, natural protocol (lower is better)", ""] + _ppl_table(group, natural)
        out += ["", "### Held-out perplexity, masked-prefix protocol (every objective)", ""]
        out += _ppl_table(group, lambda c: "masked_prefix")
        out += ["", "### Held-out perplexity, AR plan (every objective; the natural one for ar and dar-t2)", ""]
        out += _ppl_table(group, lambda c: "ar_plan")
        out += ["", "### Perplexity by prefix length (natural protocol, all sets pooled, token-weighted)", ""]
        out += _prefix_table(group)
        out += ["", "### Linear probes (test split; accuracy, Pearson r for vader_movie)", ""]
        out += _score_table(group, lambda c, t: c["probe"][t]["test"], lambda t: c_metric(mine, "probe", t))
        has_test = any(_get(c, "finetune", "full", t, "test") is not None for c in mine for t in TASKS)
        out += ["", "### Full fine-tuning (GLUE harness, " + ("test split)" if has_test else "validation split)"), ""]
        ft_tasks = analysis["finetune_tasks"]
        if tuple(ft_tasks) != TASKS:
            out += [f"The average and the tests use the tasks fine-tuned in every cell: {', '.join(ft_tasks) or 'none'} "
                    "(the other tasks' columns: the cells that fine-tuned them).", ""]
        out += _score_table(group, lambda c, t: _ft_score(c["finetune"]["full"][t]), lambda t: c_metric(mine, "full", t),
                            ft_tasks)
        if any(_get(c, "finetune", "lora", t) for c in mine for t in TASKS):
            out += ["", "### LoRA fine-tuning (GLUE harness)", ""]
            out += _score_table(group, lambda c, t: _ft_score(c["finetune"]["lora"][t]),
                                lambda t: c_metric(mine, "lora", t), finetune_tasks(mine, "lora"))
        if plots:
            paths = write_plots(group, preset, plots_dir)
            out += ["", f"![perplexity against prefix length, {preset}]({rel(paths['prefix'])})", "",
                    f"![linear probes, {preset}]({rel(paths['probe'])})"]
    notes = Path(notes) if notes else Path(results_dirs[0]) / "NOTES.md"
    if notes.is_file():
        out += ["", f"## Reading the results (hand-written: {notes.name} beside the JSON)", "",
                notes.read_text(encoding="utf-8").strip()]
    out += ["", "## GPU runs and cost", "", "Every GPU call (run label): the machine, its minutes and its cells. The "
            "cells of one call run in parallel on one machine, so the call's wall time, not the sum of cell times, is "
            "what the lease spends.", ""]
    out += _cost_lines(finished(cells), failures, runs, sweeps)
    out += ["", "## Partial cells (fine-tuning runs skipped to end before the time limit)", ""]
    partial = sorted((c for c in cells if c["status"] == "partial"), key=lambda c: c["key"])
    if partial:
        out += ["| cell | run | skipped |", "| --- | --- | --- |"]
        out += [f"| {c['key']} | {c['run_label']} | {', '.join(c['finetune'].get('skipped', []))} |" for c in partial]
    else:
        out.append("None.")
    out += ["", "## Failed cells", ""]
    if failures:
        out += ["A failed or timed-out cell whose JSON holds completed phases enters the tables and tests of those "
                "phases only (pretraining, perplexity, probes), never of the phase it was killed in (column *in the "
                "tables and tests*; the tests' n count it); a cell that finished in another run enters with that "
                "run's JSON alone.", "",
                "| cell | run | status | reason | measured before it stopped | in the tables and tests | minutes |",
                "| --- | --- | --- | --- | --- | --- | ---: |"]
        done = {c["key"]: c for c in finished(cells)}
        used = {(c["key"], c["run_label"]): c for c in cells if c["status"] not in ("ok", "partial")}
        for f in sorted(failures, key=lambda f: (f["run_label"], f["key"])):
            later = f" (finished in {done[f['key']]['run_label']})" if f["key"] in done else ""
            part = used.get((f["key"], f["run_label"]))
            entered = ", ".join(part["salvaged_phases"]) if part else "nothing"
            out.append(f"| {f['key']} | {f['run_label']} | {f['status']}{later} | {f.get('reason') or '–'} "
                       f"| {', '.join(f.get('measured_phases') or []) or 'nothing'} | {entered} "
                       f"| {f.get('wall_seconds', 0) / 60:.1f} |")
    else:
        out.append("None.")
    text = "\n".join(out) + "\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    return text


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Rebuild docs/results/study18/RESULTS.md and the plots of the seeded study from its JSON.")
    p.add_argument("--report", action="store_true", help="accepted for study.py's flags (this module only reports)")
    p.add_argument("--results_dir", nargs="+", default=["docs/results/study"], help="cell JSON folder(s)")
    p.add_argument("--output", default="docs/results/study18/RESULTS.md", help="the markdown file")
    p.add_argument("--notes", default=None,
                   help="hand-written markdown to include (default: NOTES.md in the first --results_dir)")
    p.add_argument("--no_plots", action="store_true", help="tables only, no PNG")
    p.add_argument("--plots_dir", default=None, help="where the PNGs go (default: the first --results_dir)")
    p.add_argument("--n_boot", type=int, default=N_BOOT, help="bootstrap replicates")
    p.add_argument("--boot_seed", type=int, default=BOOT_SEED, help="the bootstrap's random seed")
    return p


def main(argv: list[str] | None = None) -> int:
    args, unknown = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if unknown:
        print(f"[study_report] ignored (not report flags): {' '.join(unknown)}", file=sys.stderr)
    build_report(args.results_dir, Path(args.output), args.plots_dir, plots=not args.no_plots, notes=args.notes,
                 n_boot=args.n_boot, boot_seed=args.boot_seed)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
