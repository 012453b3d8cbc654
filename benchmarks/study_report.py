"""The report of the seeded study (benchmarks/study.py --report): tables, verdicts and plots from the cells' JSON only.

    python benchmarks/study_report.py --results_dir docs/results/study --output docs/RESULTS.md
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from study_stats import mean, paired_comparison, sd  # noqa: E402

OBJECTIVES = ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3", "gvp-k8")
TEXT_SETS = ("bbc", "sotu", "brown")
TEXT_SET_NAMES = {"bbc": "BBC News", "sotu": "State of the Union", "brown": "Brown"}
TASKS = ("rotten_tomatoes", "trec", "vader_movie", "sms_spam")
SHORT_PREFIX_MAX = 15  # "short prefix": k <= 15 tokens visible
LONG_PREFIX_MIN = 64  # "long prefix": k >= 64

# ---------------------------------------------------------------------------------------------
# report (from the JSON files only)
# ---------------------------------------------------------------------------------------------
def load_results(results_dirs) -> tuple[list[dict], list[dict], list[dict]]:
    cells, failures, runs = {}, [], {}
    for folder in map(Path, results_dirs):
        if not folder.is_dir():
            raise ValueError(f"--results_dir {folder} does not exist")
        for path in sorted(folder.glob("*.json")):
            data = json.loads(path.read_text())
            if path.name.startswith("run__"):
                runs[data["run_label"]] = data
            elif data.get("status") in ("ok", "partial"):
                cells[data["key"]] = data
            elif "status" in data:
                failures.append(data)
    return list(cells.values()), failures, list(runs.values())


def _pm(values, spec=".3f") -> str:
    values = [v for v in values if v is not None]
    if not values or any(math.isnan(v) for v in values):  # e.g. no token with a prefix that long
        return "–"
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(mean(values), spec)} ± {format(sd(values), spec)}"


def pooled_by_prefix(cell: dict, protocol: str) -> list[dict]:
    """Buckets of the three held-out sets pooled: token-weighted NLL per prefix-length bucket."""
    pooled = {}
    for name in TEXT_SETS:
        for b in cell["perplexity"]["sets"][name][protocol]["by_prefix_length"]:
            key = (b["prefix_length_min"], b["prefix_length_max"])
            tokens, total = pooled.get(key, (0, 0.0))
            pooled[key] = (tokens + b["num_tokens"], total + b["num_tokens"] * b["nll"])
    return [{"prefix_length_min": lo, "prefix_length_max": hi, "num_tokens": n, "nll": total / n}
            for (lo, hi), (n, total) in sorted(pooled.items())]


def prefix_nll(cell: dict, protocol: str, lo: int, hi: int) -> float:
    rows = [b for b in pooled_by_prefix(cell, protocol) if b["prefix_length_min"] >= lo and b["prefix_length_max"] <= hi]
    n = sum(b["num_tokens"] for b in rows)
    return sum(b["num_tokens"] * b["nll"] for b in rows) / n if n else float("nan")


def natural(cell):
    return cell["perplexity"]["natural_protocol"]


MEASURES = {
    # name: (function of a cell, higher is better)
    "nll_natural": (lambda c: mean([c["perplexity"]["sets"][n][natural(c)]["nll"] for n in TEXT_SETS]), False),
    "nll_masked_prefix": (lambda c: mean([c["perplexity"]["sets"][n]["masked_prefix"]["nll"] for n in TEXT_SETS]), False),
    "nll_short": (lambda c: prefix_nll(c, natural(c), 0, SHORT_PREFIX_MAX), False),
    "nll_long": (lambda c: prefix_nll(c, natural(c), LONG_PREFIX_MIN, 10**9), False),
    "probe_avg": (lambda c: mean([c["probe"][t]["test"] for t in TASKS]), True),
    "full_avg": (lambda c: mean([c["finetune"]["full"][t]["validation"] for t in TASKS]), True),
    "lora_avg": (lambda c: mean([c["finetune"]["lora"][t]["validation"] for t in TASKS]), True),
}


def by_objective(cells) -> dict[str, dict[int, dict]]:
    out = {}
    for c in cells:
        out.setdefault(c["objective"], {})[c["seed"]] = c
    return out


def _seeds_values(group, objective, fn) -> dict[int, float]:
    out = {}
    for seed, c in sorted(group.get(objective, {}).items()):
        try:
            out[seed] = fn(c)
        except KeyError:  # a partial cell: that fine-tuning run was skipped for time
            continue
    return out


def compare(group, a: str, b: str, fn) -> dict | None:
    """Paired comparison of objective a against b on the seeds both finished (a - b)."""
    va, vb = _seeds_values(group, a, fn), _seeds_values(group, b, fn)
    seeds = sorted(set(va) & set(vb))
    if not seeds or any(math.isnan(v) for v in [va[s] for s in seeds] + [vb[s] for s in seeds]):
        return None  # no pair, or a measure with no tokens (a prefix range beyond the block size)
    result = paired_comparison([va[s] for s in seeds], [vb[s] for s in seeds]).to_dict()
    result["seeds"] = seeds
    return result


def outcome(result: dict | None, expected: int) -> str:
    """supports / contradicts the claim's direction (expected: +1 if the claim says a - b > 0), or within spread."""
    if result is None:
        return "no data"
    if result["n"] < 2:
        return "fewer than 2 paired seeds"
    if not result["called"]:
        return "within seed spread"
    return "supports" if result["direction"] == expected else "contradicts"


def verdict(outcomes: list[str]) -> str:
    if outcomes and all(o == "supports" for o in outcomes):
        return "holds"
    if any(o == "contradicts" for o in outcomes):
        return "does not hold"
    return "cannot tell at this scale"


def _fmt_cmp(label: str, r: dict | None, spec: str, expected: int) -> str:
    if r is None:
        return f"- {label}: no paired values (no common seed, or no token in that prefix range) ({outcome(r, expected)})"
    if r["n"] < 2:
        return f"- {label}: {format(r['mean_diff'], '+' + spec)} (one seed; {outcome(r, expected)})"
    return (f"- {label}: {format(r['mean_diff'], '+' + spec)} (95 % CI {format(r['ci_low'], '+' + spec)} … "
            f"{format(r['ci_high'], '+' + spec)}, sd {format(r['sd_diff'], spec)}, n = {r['n']}, paired t p = "
            f"{r['p_t']:.3f}, sign p = {r['p_sign']:.2f}) → **{outcome(r, expected)}**")


def claims(group) -> list[tuple[str, str, list[str]]]:
    """(title, verdict, lines) for C1..C4."""
    out = []
    masked = ["mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3"]
    # C1
    lines, outs = [], []
    for measure, what in (("probe_avg", "probe average score"), ("full_avg", "full fine-tuning average"),
                          ("lora_avg", "LoRA fine-tuning average")):
        r = compare(group, "dar-t2", "ar", MEASURES[measure][0])
        outs.append(outcome(r, +1))
        lines.append(_fmt_cmp(f"{what}, dar-t2 − ar", r, ".4f", +1))
    out.append(("C1. Diversity-enhanced AR (dar, t = 2) represents better than AR (paper (a): +1.9 GLUE average "
                "after fine-tuning)", verdict(outs), lines))
    # C2
    lines, outs = [], []
    for other in ("mlm-0.15", "mlm-0.3"):
        r = compare(group, "vmlm-0.15-0.3", other, MEASURES["nll_masked_prefix"][0])
        outs.append(outcome(r, -1))
        lines.append(_fmt_cmp(f"held-out NLL (masked prefix, mean of the 3 sets), vmlm − {other}", r, ".4f", -1))
    out.append(("C2. Variable-length masking [0.15, 0.3] beats both fixed ratios on perplexity (paper (a): Pile "
                "ppl 59.6 at 0.15, 50.2 at 0.3, 45.1 variable)", verdict(outs), lines))
    # C3: (a) the masked models' disadvantage against AR is larger with short prefixes; (b) vmlm narrows it
    lines, outs = [], []
    short, long_ = MEASURES["nll_short"][0], MEASURES["nll_long"][0]
    for m in masked:
        r = compare(group, m, "ar", short)
        outs.append(outcome(r, +1))
        lines.append(_fmt_cmp(f"short-prefix NLL (k ≤ {SHORT_PREFIX_MAX}), {m} − ar", r, ".4f", +1))
        r = compare(group, m, "ar", lambda c: short(c) - long_(c))
        outs.append(outcome(r, +1))
        lines.append(_fmt_cmp(f"(short − long) NLL, {m} − ar (gap grows at short prefixes; long: k ≥ {LONG_PREFIX_MIN})",
                              r, ".4f", +1))
    for other in ("mlm-0.15", "mlm-0.3"):
        r = compare(group, "vmlm-0.15-0.3", other, short)
        outs.append(outcome(r, -1))
        lines.append(_fmt_cmp(f"short-prefix NLL, vmlm − {other} (the variable ratio narrows the gap)", r, ".4f", -1))
    lines.append(f"- the two halves: masked models worse than AR with short prefixes, by more than with long ones: "
                 f"**{verdict(outs[:6])}**; the variable ratio narrows that: **{verdict(outs[6:])}**.")
    out.append(("C3. Masked models are worst with short prefixes, and the variable ratio narrows that (paper (a) "
                "Fig. 3)", verdict(outs), lines))
    # C4
    lines, outs = [], []
    for m in masked:
        r = compare(group, m, "ar", MEASURES["probe_avg"][0])
        outs.append(outcome(r, +1))
        lines.append(_fmt_cmp(f"probe average score, {m} − ar", r, ".4f", +1))
    out.append(("C4. Masked pretraining probes better than AR (paper (a) §3.3, Thm 4.1)", verdict(outs), lines))
    return out


def _objectives_present(group) -> list[str]:
    return [o for o in OBJECTIVES if o in group] + sorted(o for o in group if o not in OBJECTIVES)


def _ppl_table(group, protocol_of) -> list[str]:
    lines = ["| objective | seeds | protocol | " + " | ".join(TEXT_SET_NAMES[n] for n in TEXT_SETS)
             + " | geometric mean |", "| --- | ---: | --- | " + " | ".join("---:" for _ in TEXT_SETS) + " | ---: |"]
    for o in _objectives_present(group):
        cells = list(group[o].values())
        protocols = sorted({protocol_of(c) for c in cells})
        row = [o, str(len(cells)), "/".join(p.replace("_", " ") for p in protocols)]
        for n in TEXT_SETS:
            row.append(_pm([c["perplexity"]["sets"][n][protocol_of(c)]["perplexity"] for c in cells], ".1f"))
        row.append(_pm([math.exp(mean([c["perplexity"]["sets"][n][protocol_of(c)]["nll"] for n in TEXT_SETS]))
                        for c in cells], ".1f"))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _has(cell, get) -> bool:
    try:
        [get(cell, t) for t in TASKS]
        return True
    except KeyError:
        return False


def _score_table(group, get, metric_of) -> list[str]:
    lines = ["| objective | seeds | " + " | ".join(f"{t} ({metric_of(t)})" for t in TASKS) + " | average |",
             "| --- | ---: | " + " | ".join("---:" for _ in TASKS) + " | ---: |"]
    for o in _objectives_present(group):
        cells = [c for c in group[o].values() if _has(c, get)]  # a partial cell lacks some fine-tuning
        row = [o, str(len(cells))] + [_pm([get(c, t) for c in cells]) for t in TASKS]
        row.append(_pm([mean([get(c, t) for t in TASKS]) for c in cells]))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _prefix_table(group) -> list[str]:
    lines = ["| objective | protocol | ppl, k ≤ 15 | ppl, 16 ≤ k < 64 | ppl, k ≥ 64 | tokens k ≤ 15 (per seed) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for o in _objectives_present(group):
        cells = list(group[o].values())
        p = natural(cells[0]).replace("_", " ")
        vals = [[math.exp(prefix_nll(c, natural(c), lo, hi)) for c in cells]
                for lo, hi in ((0, SHORT_PREFIX_MAX), (SHORT_PREFIX_MAX + 1, LONG_PREFIX_MIN - 1), (LONG_PREFIX_MIN, 10**9))]
        tokens = sum(b["num_tokens"] for b in pooled_by_prefix(cells[0], natural(cells[0]))
                     if b["prefix_length_max"] <= SHORT_PREFIX_MAX)
        lines.append(f"| {o} | {p} | " + " | ".join(_pm(v, ".1f") for v in vals) + f" | {tokens:,} |")
    return lines


def write_plots(group, preset: str, plots_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    paths = {"prefix": plots_dir / f"ppl_by_prefix_{preset}.png", "probe": plots_dir / f"probe_{preset}.png"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, o in enumerate(_objectives_present(group)):
        curves = [pooled_by_prefix(c, natural(c)) for c in group[o].values()]
        keys = sorted({(b["prefix_length_min"], b["prefix_length_max"]) for curve in curves for b in curve})
        x, mid, lo, hi = [], [], [], []
        for key in keys:
            ppl = [math.exp(b["nll"]) for curve in curves for b in curve
                   if (b["prefix_length_min"], b["prefix_length_max"]) == key]
            x.append(max(0.5, (key[0] + key[1]) / 2))
            mid.append(mean(ppl))
            lo.append(min(ppl))
            hi.append(max(ppl))
        ax.plot(x, mid, marker="o", ms=3, color=f"C{i}", label=f"{o} ({natural(group[o][min(group[o])]).replace('_', ' ')})")
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
        scores = [[c["probe"][t]["test"] for c in group[o].values()] for t in TASKS]
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


def _cost_lines(cells, failures, runs) -> list[str]:
    labels = sorted({c["run_label"] for c in cells} | {f["run_label"] for f in failures} | {r["run_label"] for r in runs})
    lines = ["| run | device | cells ok | cells partial | cells failed | finished, JSON lost | cell-minutes (sum of cell "
             "wall times) | call wall minutes (first cell start → last cell end) | driver wall minutes (prep included) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lost_all = []
    total_sum = total_span = 0.0
    for label in labels:
        mine = [c for c in cells if c["run_label"] == label] + [f for f in failures if f["run_label"] == label]
        ok = sum(c["status"] == "ok" for c in mine)
        partial = sum(c["status"] == "partial" for c in mine)
        cell_minutes = sum(c["wall_seconds"] for c in mine) / 60
        span = 0.0
        if mine:
            starts = [dt.datetime.strptime(c["started_utc"], "%Y-%m-%dT%H:%M:%SZ") for c in mine]
            ends = [dt.datetime.strptime(c["finished_utc"], "%Y-%m-%dT%H:%M:%SZ") for c in mine]
            span = (max(ends) - min(starts)).total_seconds() / 60
        devices = sorted({c["versions"]["device"] if "versions" in c else c.get("device", "–") for c in mine}) or ["–"]
        run = next((r for r in runs if r["run_label"] == label), None)
        driver = f"{run['wall_seconds'] / 60:.1f}" if run and "wall_seconds" in run else "–"
        # cells the call's summary lists as finished but whose JSON is not here (e.g. not returned by the device)
        lost = sorted(set(run.get("cells_ok", []) + run.get("cells_failed", [])) - {c["key"] for c in mine}) if run else []
        lost_all += [(label, k) for k in lost]
        total_sum += cell_minutes
        total_span += span
        lines.append(f"| {label} | {', '.join(devices)} | {ok} | {partial} | {len(mine) - ok - partial} | {len(lost)} "
                     f"| {cell_minutes:.1f} | {span:.1f} | {driver} |")
    ok_all = sum(c["status"] == "ok" for c in cells)
    lines.append(f"| all | | {ok_all} | {len(cells) - ok_all} | {len(failures)} | {len(lost_all)} | {total_sum:.1f} "
                 f"| {total_span:.1f} | |")
    driver_total = sum(r.get("wall_seconds", 0.0) for r in runs) / 60
    lines += ["", f"In all: {len(labels)} call(s); {driver_total:.1f} minutes of driver wall time (prep included; "
                  f"the device minutes the calls spent), {total_span:.1f} minutes from first cell start to last cell end, "
                  f"{total_sum:.1f} cell-minutes."]
    if lost_all:
        kept = {c["key"]: c["run_label"] for c in cells}
        lines += ["", f"{len(lost_all)} cell(s) finished in a call but their JSON never came back, so that call's "
                      "minutes bought nothing for them (the cell-minutes above count only the JSON kept): "
                      + ", ".join(f"{k} (lost from {label}" + (f", the kept one is from {kept[k]})" if k in kept else ")")
                                  for label, k in lost_all) + "."]
    return lines


def _settings_lines(cells) -> list[str]:
    s, c = cells[0]["settings"], cells[0]
    prep = c["prep"]
    corpora = ", ".join(f"{TEXT_SET_NAMES[k]} {prep['train_corpora'][k]['documents']:,} documents / "
                        f"{prep['train_corpora'][k]['characters']:,} characters" for k in TEXT_SETS)
    held = ", ".join(f"{TEXT_SET_NAMES[k]} {v['passages']} passages / {v['characters']:,} characters from "
                     f"{v['documents_in_split']} documents" for k, v in ((k, prep["heldout_sizes"][k]) for k in TEXT_SETS))
    ft_eval = "whole validation split" if not s["ft_eval"] else f"{s['ft_eval']} validation sentences (a fixed random sample)"
    probe_sizes = "; ".join(f"{t} {c['probe'][t]['sizes']['train']['used']}/{c['probe'][t]['sizes']['validation']['used']}/"
                            f"{c['probe'][t]['sizes']['test']['used']}" for t in TASKS)
    return [
        f"- Model: preset `{s['preset']}` ({c['pretrain']['parameters']:,} parameters), vocabulary "
        f"{prep['vocab_size']:,} (byte-level BPE trained on the training text), blocks of {s['block_size']} tokens.",
        f"- Pretraining: {s['steps']:,} steps × {s['batch_size']} blocks = {c['pretrain']['tokens']:,} tokens per cell "
        f"({c['pretrain']['epochs']:.2f} epochs of {prep['train_tokens']:,} tokens), AdamW lr {s['learning_rate']:g}, "
        f"cosine, warm-up {s['warmup_fraction']:.0%}, {'bf16 autocast' if s['device'] == 'cuda' else 'fp32'} on "
        f"{', '.join(sorted({x['versions']['device'] for x in cells}))}. Text: {corpora} (train splits).",
        f"- Held-out perplexity: the test splits cut into consecutive passages of at most {s['ppl_passage_chars']:,} "
        f"characters, {s['ppl_passages']} passages per set spread evenly over them, each scored from its start "
        f"({held}); windows of {s['block_size']}, stride {s['block_size'] // 2}; both protocols for every objective.",
        f"- Probes: logistic regression (ridge for vader_movie) on frozen mean-pooled features of the first "
        f"{s['max_seq_length']} tokens, C (alpha) chosen on validation, score on test; train/validation/test sizes: "
        f"{probe_sizes}.",
        f"- Fine-tuning (GLUE harness, `evaluation.glue.run`): {s['ft_train']} training sentences (a fixed random "
        f"sample), {s['ft_epochs']:g} epoch(s), batch {s['ft_batch_size']}, lr {s['ft_learning_rate']:g} (full) / "
        f"{s['lora_learning_rate']:g} (LoRA r = 8), scored on the "
        f"{ft_eval}.",
        f"- Package commit(s): {', '.join(sorted({x['git_commit'] for x in cells}))}; torch "
        f"{', '.join(sorted({x['versions']['torch'] for x in cells}))}, transformers "
        f"{', '.join(sorted({x['versions']['transformers'] for x in cells}))}; tokenizer sha256 "
        f"{', '.join(sorted({x['prep']['tokenizer_sha256'] for x in cells}))}.",
    ]


def build_report(results_dirs, output: Path, plots_dir: Path | None = None, plots: bool = True,
                 notes: Path | None = None) -> str:
    """The markdown report (written to ``output``) from the JSON in ``results_dirs``; ``notes`` (default:
    ``<first results dir>/NOTES.md`` if it exists), a hand-written reading of the numbers, is included verbatim."""
    cells, failures, runs = load_results(results_dirs)
    if not cells and not failures:
        raise ValueError(f"no cell JSON in {results_dirs}: run the grid first")
    presets = [p for p in dict.fromkeys(c["preset"] for c in cells)]
    order = {p: i for i, p in enumerate(("tiny", "mini", "small", "base", "large"))}
    presets.sort(key=lambda p: order.get(p, 99))
    plots_dir = Path(plots_dir) if plots_dir else Path(results_dirs[0])
    out = [
        "# The seeded study of the papers' claims",
        "",
        "Generated by `python benchmarks/study.py --report` from the JSON files of every cell (objective × preset × "
        "seed); do not edit by hand. Each cell pretrains one model and measures it; the numbers are mean ± sd over "
        "the seeds that finished.",
        "",
        "**Rule for calling a difference.** For two objectives, the paired differences d over the seeds both "
        "finished (same seed = same initial-weights seed, data order and plans) give a 95 % paired-t interval of the "
        "mean; a difference is called only if that interval excludes 0 and every d has the same sign (3 seeds: "
        "|mean d| > 2.48 sd(d)). A claim *holds* if every comparison it rests on is called in its direction, *does "
        "not hold* if any is called against it, and otherwise *cannot tell at this scale*. Perplexities are compared "
        "as mean NLL per token (nats; the log of the perplexity) averaged over the three held-out sets.",
        "",
        "Protocols (DESIGN.md): *ar plan* = one forward with g[i] = i, the query stream at k sees x_<k; *masked "
        "prefix* = the prefix x_<k one bidirectional rank-0 group, x_k masked, nothing after k. Both score "
        "p(x_k | x_<k). The *natural* protocol of an objective is the package's default "
        "(`evaluation.perplexity.default_masked_mode`): ar plan for ar and dar-t2, masked prefix for the others.",
    ]
    for preset in presets:
        mine = [c for c in cells if c["preset"] == preset]
        ids = sorted({c["settings_id"] for c in mine})
        if len(ids) > 1:
            raise ValueError(f"preset {preset}: cells with different settings ({ids}) in {results_dirs}; "
                             "keep each grid's JSON in its own folder")
        group = by_objective(mine)
        out += ["", f"## Preset `{preset}`", "", "### Settings", ""] + _settings_lines(mine)
        out += ["", "### Held-out perplexity, natural protocol (lower is better)", ""] + _ppl_table(group, natural)
        out += ["", "### Held-out perplexity, masked-prefix protocol (every objective)", ""]
        out += _ppl_table(group, lambda c: "masked_prefix")
        out += ["", "### Held-out perplexity, AR plan (every objective; the natural one for ar and dar-t2)", ""]
        out += _ppl_table(group, lambda c: "ar_plan")
        out += ["", "### Perplexity by prefix length (natural protocol, three sets pooled)", ""] + _prefix_table(group)
        out += ["", "### Linear probes (test split; accuracy, Pearson r for vader_movie)", ""]
        out += _score_table(group, lambda c, t: c["probe"][t]["test"], lambda t: c_metric(mine, "probe", t))
        out += ["", "### Full fine-tuning (GLUE harness, validation split)", ""]
        out += _score_table(group, lambda c, t: c["finetune"]["full"][t]["validation"], lambda t: c_metric(mine, "full", t))
        out += ["", "### LoRA fine-tuning (GLUE harness, validation split)", ""]
        out += _score_table(group, lambda c, t: c["finetune"]["lora"][t]["validation"], lambda t: c_metric(mine, "lora", t))
        if plots:
            paths = write_plots(group, preset, plots_dir)
            rel = {k: os.path.relpath(v, output.parent) for k, v in paths.items()}
            out += ["", f"![perplexity against prefix length, {preset}]({rel['prefix']})", "",
                    f"![linear probes, {preset}]({rel['probe']})"]
        out += ["", "### The claims", ""]
        for title, v, lines in claims(group):
            out += [f"**{title}: {v}.**", ""] + lines + [""]
    notes = Path(notes) if notes else Path(results_dirs[0]) / "NOTES.md"
    if notes.is_file():
        out += [f"## Reading the results (hand-written: {notes.name} beside the JSON)", "",
                notes.read_text(encoding="utf-8").strip(), ""]
    out += ["## Cost", "", "GPU time per GPU call (run label), from the cells' JSON: the cells of one call run in "
            "parallel on one GPU, so the call's wall time, not the sum of cell times, is what the lease spends.", ""]
    out += _cost_lines(cells, failures, runs)
    out += ["", "## Partial cells (fine-tuning runs skipped to end before the time limit)", ""]
    partial = sorted((c for c in cells if c["status"] == "partial"), key=lambda c: c["key"])
    if partial:
        out += ["| cell | run | skipped |", "| --- | --- | --- |"]
        out += [f"| {c['key']} | {c['run_label']} | {', '.join(c['finetune']['skipped'])} |" for c in partial]
    else:
        out.append("None.")
    out += ["", "## Failed cells (not in the tables)", ""]
    if failures:
        out += ["| cell | run | status | reason | measured before it stopped | minutes |",
                "| --- | --- | --- | --- | --- | ---: |"]
        for f in sorted(failures, key=lambda f: (f["run_label"], f["key"])):
            later = " (finished in a later run)" if any(c["key"] == f["key"] for c in cells) else ""
            out.append(f"| {f['key']} | {f['run_label']} | {f['status']}{later} | {f.get('reason') or '–'} "
                       f"| {', '.join(f.get('measured_phases') or []) or 'nothing'} | {f['wall_seconds'] / 60:.1f} |")
    else:
        out.append("None.")
    text = "\n".join(out) + "\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    return text


def c_metric(cells, where, task) -> str:
    for c in cells:
        entry = c["probe"].get(task) if where == "probe" else c["finetune"][where].get(task)
        if entry:
            return entry["metric"]
    return "–"
