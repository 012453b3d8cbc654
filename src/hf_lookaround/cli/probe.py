"""``hf-lookaround probe``: a linear probe on frozen features of a checkpoint (DESIGN.md, "Linear probing")."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np
import torch

from ..data.subsets import seeded_sample
from ..evaluation import probing
from ..hub.load import load_checkpoint
from .common import resolve_device
from ..evaluation.probing import (
    FEATURES,
    POOLINGS,
    count_truncated,
    extract_features,
    linear_probe,
    linear_probe_layers,
    max_length_for,
)

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lookaround probe", description=probing.__doc__.split("\n\n")[0])
    p.add_argument("--model_name_or_path", required=True)
    p.add_argument("--tokenizer_name", default=None)
    p.add_argument("--dataset", default=None, help="a directory with {train,validation,test}.jsonl|csv, or a datasets name")
    p.add_argument("--dataset_config_name", default=None)
    p.add_argument("--task_name", default=None, help="a name for the results (default: the dataset's folder name)")
    p.add_argument("--train_file", default=None)
    p.add_argument("--validation_file", default=None)
    p.add_argument("--test_file", default=None)
    p.add_argument("--label_column", default="label")
    p.add_argument("--pooling", choices=POOLINGS, default="mean")
    p.add_argument("--features", choices=FEATURES, default="content_last_layer",
                   help="prediction_state: the state that predicts, in the checkpoint's own training layout (a "
                        "two-stream checkpoint's query stream); content_last_layer: the content stream's last layer "
                        "under --attention_pattern (docs/evaluation.md)")
    p.add_argument("--all_layers", action="store_true",
                   help="also probe the same state after the embeddings and after every layer (results: 'layers')")
    p.add_argument(
        "--attention_pattern",
        choices=("pretrained", "causal", "bidirectional"),
        default="pretrained",
        help="pretrained = config.default_attention (LookAround models only for the others; "
             "--features content_last_layer only)",
    )
    p.add_argument("--max_length", type=int, default=None, help="default: the model's max positions")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--max_train_samples", type=int, default=None, help="a random sample of train (seeded by --seed)")
    p.add_argument("--max_eval_samples", type=int, default=None,
                   help="caps validation and test (a random sample of each, seeded by --seed)")
    p.add_argument("--validation_fraction", type=float, default=0.1, help="held out of train when there is no validation split")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--device", default=None)
    return p


def _split_xy(ds, key1, key2, label_column, labels):
    texts = list(ds[key1])  # datasets returns lazy Column objects; tokenizers want lists
    pairs = list(ds[key2]) if key2 else None
    y = list(ds[label_column]) if label_column in ds.column_names else None
    if y is not None and not labels.is_regression:
        index = {v: i for i, v in enumerate(labels.values)}
        unknown = sorted({v for v in y if v not in index}, key=str)
        if unknown:
            raise ValueError(f"labels {unknown} do not occur in the train split (train labels: {labels.values})")
        y = [index[v] for v in y]
    return texts, pairs, (np.asarray(y) if y is not None else None)


def _labeled_splits(args):
    """train, validation (held out of train when the data has none) and test, each cut to its --max_*_samples."""
    from hf_lookaround.evaluation.tasks import load_labeled_splits

    raw = load_labeled_splits(
        task_name=None,
        dataset=args.dataset,
        dataset_config_name=args.dataset_config_name,
        train_file=args.train_file,
        validation_file=args.validation_file,
        test_file=args.test_file,
        label_column=args.label_column,
    )
    if "validation" not in raw:
        logger.info("no validation split: holding out %.0f%% of train to choose C", 100 * args.validation_fraction)
        parts = raw["train"].train_test_split(test_size=args.validation_fraction, seed=args.seed)
        raw["train"], raw["validation"] = parts["train"], parts["test"]
    caps = {"train": ("--max_train_samples", args.max_train_samples),
            "validation": ("--max_eval_samples", args.max_eval_samples),
            "test": ("--max_eval_samples", args.max_eval_samples)}
    for split, (flag, cap) in caps.items():
        if split in raw:
            raw[split] = seeded_sample(raw[split], cap, args.seed, what=f"{split} examples", flag=flag,
                                       label_column=args.label_column)
    return raw


def _task_name(task_name: str | None, dataset: str | None) -> str | None:
    """--task_name, else the data's folder name: .../classification/trec/train.jsonl -> trec."""
    if task_name or not dataset:
        return task_name
    path = Path(dataset.rstrip("/"))
    return path.parent.name if path.is_file() else path.name


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from transformers import AutoModel

    from hf_lookaround.data.tokenization import auto_tokenizer

    import hf_lookaround  # noqa: F401  (registers the Auto classes)
    from hf_lookaround.evaluation.tasks import detect_sentence_columns, label_info

    raw = _labeled_splits(args)
    labels = label_info(raw, label_column=args.label_column)
    key1, key2 = detect_sentence_columns(raw["train"], label_column=args.label_column)
    logger.info("sentence column(s): %s; %s", (key1, key2), "regression" if labels.is_regression else f"{labels.num_labels} classes")

    device = resolve_device(args.device)
    model = load_checkpoint(AutoModel, args.model_name_or_path, "hf-lookaround probe", kinds=("text", "other"))
    tokenizer = auto_tokenizer(args.tokenizer_name or args.model_name_or_path)
    model.to(device)
    pattern = None if args.attention_pattern == "pretrained" else args.attention_pattern
    if pattern is not None and args.features != "content_last_layer":
        raise SystemExit(f"--attention_pattern {pattern} applies to --features content_last_layer; "
                         f"{args.features} is read in the checkpoint's own training layout: drop one of them")
    max_length = max_length_for(model, tokenizer, args.max_length, args.features)

    feats, ys, truncated = {}, {}, {}
    for split in ("train", "validation", "test"):
        if split not in raw or (split == "test" and args.label_column not in raw[split].column_names):
            continue
        texts, pairs, ys[split] = _split_xy(raw[split], key1, key2, args.label_column, labels)
        truncated[split] = count_truncated(tokenizer, texts, max_length, pairs)
        feats[split] = extract_features(model, tokenizer, texts, args.pooling, pattern, args.batch_size, max_length,
                                        pairs, features=args.features, all_layers=args.all_layers)

    task_type = "regression" if labels.is_regression else "classification"
    probe = linear_probe_layers if args.all_layers else linear_probe
    result = probe(feats["train"], ys["train"], feats["validation"], ys["validation"], feats.get("test"),
                   ys.get("test"), task_type=task_type, seed=args.seed)
    layers = None
    if args.all_layers:  # the last table is the single one: the main result
        layers, result = result, {k: v for k, v in result[-1].items() if k != "layer"}
    dataset = args.dataset or args.train_file
    task = _task_name(args.task_name, dataset)
    effective_pattern = pattern or getattr(model.config, "default_attention", None)
    report = {
        "task": task,
        "dataset": dataset,
        **result,
        "model": args.model_name_or_path,
        "pooling": args.pooling,
        "features": args.features,
        "attention_pattern": effective_pattern if args.features == "content_last_layer" else "training_layout",
        "max_length": max_length,
        "num_truncated": truncated,
        "num_examples": {s: int(len(y)) for s, y in ys.items()},
        **({"layers": layers} if layers is not None else {}),
    }
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_results.json").write_text(json.dumps(report, indent=2) + "\n")
    shown = {k: report[k] for k in report if k.startswith(("test_", "validation_")) and k != "validation_scores"}
    print(json.dumps(shown), f"\nwrote {out / 'probe_results.json'}")
    return 0
