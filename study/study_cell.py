"""One cell of the seeded study, in its own process: pretrain, then held-out perplexity, probes, fine-tuning.

``run_cell(spec_path)`` reads a spec JSON (written by ``study_grid``) and writes its result JSON after every
phase (``complete: false`` until the end), so a cell killed at the time limit still leaves what it measured.
Two kinds of spec:

- ``kind: "cell"``: pretrain ``settings.tokens`` at ``learning_rate`` (tokens/s recorded), then
  - perplexity ``p(x_k | x_<k)`` of every held-out set with both protocols, with per-passage NLL sums
    (all tokens, short prefixes k <= 15, long prefixes k >= 64) for bootstrap intervals;
  - linear probes on frozen mean-pooled features (test predictions and labels kept);
  - fine-tuning (``--ft_modes``, default full) of every task on its whole train split for ``ft_epochs``, at each
    learning rate of ``ft_lrs`` (``lora_lrs``); the rate is selected on the validation split, the test score
    (and test predictions) reported at that rate only.
- ``kind: "sweep"``: pretraining and the validation objective loss only (the learning-rate sweep).

The package is used through its public API, imported inside the functions that need it (the driver and the
report start without torch). The Trainer comes from the package's one training assembly (``build_trainer``, as ``hf-lookaround pretrain`` builds it), with the unread-content policy off: the
recorded cells trained every batch whole. A cell whose settings hold ``drop_unread_content: true`` applies the
command's policy instead (the same loss up to float rounding; a different computation, so its numbers are new ones).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from study_common import (
    HELDOUT_SETS,
    LONG_PREFIX_MIN,
    MODE_OF_PROTOCOL,
    PREFIX_BUCKETS,
    PROTOCOLS,
    SHORT_PREFIX_MAX,
    STUDY_OBJECTIVES,
    TASKS,
    round_sig,
    versions,
    write_json,
)


def _training_args(out_dir, seed, device, pretraining: bool = False, **extra):
    """The Trainer's arguments; ``pretraining``: the pretrain command's own class (``LookAroundTrainingArguments``)."""
    import torch
    from transformers import TrainingArguments

    from hf_lookaround.training.pretraining import LookAroundTrainingArguments

    cls = LookAroundTrainingArguments if pretraining else TrainingArguments
    return cls(
        output_dir=str(out_dir), seed=seed, data_seed=seed, report_to="none", save_strategy="no",
        eval_strategy="no", disable_tqdm=True, use_cpu=device == "cpu", dataloader_num_workers=0,
        bf16=device == "cuda" and torch.cuda.is_bf16_supported(), **extra,
    )


# ---------------------------------------------------------------------------------------------
# pretraining
# ---------------------------------------------------------------------------------------------
def objective_arguments(kwargs: dict):
    """``ObjectiveArguments(**kwargs)``, with a clear error when the installed package lacks the objective."""
    from hf_lookaround import PLAN_NAMES
    from hf_lookaround.training.pretraining import ObjectiveArguments

    name = kwargs.get("objective")
    if name not in PLAN_NAMES:
        raise ValueError(f"objective {name!r} is not in this version of hf_lookaround (its objectives: "
                         f"{list(PLAN_NAMES)}); update the package to run this cell")
    try:
        return ObjectiveArguments(**kwargs)
    except TypeError as err:
        raise ValueError(f"this version of hf_lookaround cannot configure {kwargs}: {err}") from err


def pretrain(spec, tokenizer, log, save_model: bool = True):
    """Pretrain one model; returns ``(model, checkpoint folder or None, info)``."""
    import datasets

    # the module, not its names: the assembly test replaces ``pretraining.build_trainer``
    from hf_lookaround.training import pretraining as P
    s, prep, seed, lr = spec["settings"], spec["prep"], spec["seed"], spec["learning_rate"]
    if spec["objective"] not in STUDY_OBJECTIVES:
        raise ValueError(f"unknown study objective {spec['objective']!r}; the study's objectives: {list(STUDY_OBJECTIVES)}")
    objective_args = objective_arguments(STUDY_OBJECTIVES[spec["objective"]])
    model_args = P.ModelArguments(preset=s["preset"])
    config = P.build_config(model_args, objective_args, tokenizer, s["block_size"])
    train_blocks = datasets.load_from_disk(prep["train_blocks"])
    val_blocks = datasets.load_from_disk(prep["val_blocks"])
    steps = s["steps"]
    args = _training_args(
        Path(spec["cell_dir"]) / "pretrain", seed, spec["device"], pretraining=True, max_steps=steps,
        per_device_train_batch_size=s["batch_size"], per_device_eval_batch_size=s["batch_size"],
        learning_rate=lr, lr_scheduler_type="cosine",
        warmup_steps=max(1, int(s["warmup_fraction"] * steps)), weight_decay=0.01, adam_beta2=0.98,
        max_grad_norm=1.0, logging_steps=max(1, steps // 25),
        # the recorded study trained every batch whole: the unread-content policy stays off unless a cell asks for it
        drop_unread_content=s.get("drop_unread_content", False),
    )
    # the package's one training assembly (the initial weights of this seed, its collators, the Trainer)
    trainer = P.build_trainer(config, model_args, objective_args, args, tokenizer, train_blocks, val_blocks,
                              block_size=s["block_size"])
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    metrics = trainer.evaluate()
    tokens = steps * s["batch_size"] * s["block_size"]
    history = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in history]
    info = {
        "objective": objective_args.objective, "objective_arguments": STUDY_OBJECTIVES[spec["objective"]],
        "plan_params": objective_args.plan_params(), "steps": steps, "tokens": tokens,
        "epochs": steps * s["batch_size"] / len(train_blocks), "learning_rate": lr,
        "learning_rate_source": spec.get("learning_rate_source"),
        "train_seconds": seconds, "tokens_per_second": tokens / seconds, "train_loss": result.training_loss,
        "logged_losses": losses, "logged_steps": [h.get("step") for h in history],
        "validation_loss": metrics.get("eval_loss"),
        "objective_perplexity_val": metrics.get("eval_objective_perplexity"),
        "validation_blocks": len(val_blocks), "parameters": trainer.model.num_parameters(),
    }
    log(f"pretrained {steps} steps (lr {lr:g}) in {seconds:.0f} s, {info['tokens_per_second']:,.0f} tokens/s, final "
        f"logged loss {losses[-1] if losses else float('nan'):.3f}, validation loss {info['validation_loss']}")
    ckpt = None
    if save_model:
        ckpt = Path(spec["cell_dir"]) / "pretrained"
        trainer.save_model(str(ckpt))
        tokenizer.save_pretrained(str(ckpt))
    return trainer.model, ckpt, round_sig(info)


# ---------------------------------------------------------------------------------------------
# held-out perplexity, with per-passage sums
# ---------------------------------------------------------------------------------------------
def scored_tokens_per_text(tokenizer, texts) -> list[int]:
    """How many tokens the perplexity protocols score in each text (in order): all of them after a BOS, or all
    but the first without one (the package's ``encode_documents``)."""
    from hf_lookaround.evaluation.perplexity import encode_documents

    out = []
    for text in texts:
        try:
            docs, _, _ = encode_documents(tokenizer, [text])
            out.append(len(docs[0]) - 1)
        except ValueError:  # nothing to score in this text
            out.append(0)
    return out


def per_passage(nlls, prefix_lengths, counts) -> dict:
    """NLL sums and token counts per passage: all tokens, short prefixes (k <= 15), long prefixes (k >= 64)."""
    import numpy as np

    nlls, prefix = np.asarray(nlls, dtype=np.float64), np.asarray(prefix_lengths)
    if int(sum(counts)) != nlls.size:
        raise ValueError(f"per-passage token counts sum to {sum(counts)}, the protocol scored {nlls.size}")
    bounds = np.cumsum([0] + list(counts))
    out = {k: [] for k in ("nll_sum", "tokens", "short_nll_sum", "short_tokens", "long_nll_sum", "long_tokens")}
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        x, k = nlls[lo:hi], prefix[lo:hi]
        short, long_ = k <= SHORT_PREFIX_MAX, k >= LONG_PREFIX_MIN
        out["nll_sum"].append(float(x.sum()))
        out["tokens"].append(int(hi - lo))
        out["short_nll_sum"].append(float(x[short].sum()))
        out["short_tokens"].append(int(short.sum()))
        out["long_nll_sum"].append(float(x[long_].sum()))
        out["long_tokens"].append(int(long_.sum()))
    return out


def perplexity(model, tokenizer, spec, log) -> dict:
    from hf_lookaround.evaluation import perplexity as M
    s = spec["settings"]
    heldout = json.loads(Path(spec["prep"]["heldout"]).read_text())
    model.eval()
    natural = {"two_stream": "ar_plan", "two_stream_prefix": "masked_prefix"}[M.default_masked_mode(model)]
    out = {"natural_protocol": natural, "sets": {}}
    for name in HELDOUT_SETS:
        out["sets"][name] = {}
        counts = scored_tokens_per_text(tokenizer, heldout[name])
        for protocol in PROTOCOLS:
            r = M.masked_perplexity(model, tokenizer, heldout[name], max_length=s["block_size"],
                                    stride=s["block_size"] // 2, batch_size=s["eval_batch_size"],
                                    mode=MODE_OF_PROTOCOL[protocol])
            out["sets"][name][protocol] = round_sig({
                "perplexity": r.perplexity, "nll": r.mean_nll, "bits_per_byte": r.bits_per_byte,
                "num_tokens": r.num_tokens, "num_bytes": int(r.num_bytes), "num_passages": len(heldout[name]),
                "by_prefix_length": M.bucket_by_prefix_length(r.nlls, r.prefix_lengths, PREFIX_BUCKETS),
                "per_passage": per_passage(r.nlls, r.prefix_lengths, counts),
            })
        log(f"perplexity {name}: " + ", ".join(f"{p} {out['sets'][name][p]['perplexity']:.1f}" for p in PROTOCOLS))
    return out


# ---------------------------------------------------------------------------------------------
# linear probes
# ---------------------------------------------------------------------------------------------
def _class_ids(values, classes):
    index = {v: i for i, v in enumerate(classes)}
    return [index[v] for v in values]


def probes(model, tokenizer, spec, log) -> dict:
    from hf_lookaround.evaluation import probing as pr
    from hf_lookaround.evaluation import tasks as T

    s, out = spec["settings"], {}
    features = spec.get("features", "content_last_layer")  # the protocol's named state (study18's: the content's)
    for task in TASKS:
        raw = T.load_labeled_splits(dataset=spec["prep"]["task_dirs"][task])
        labels = T.label_info(raw)
        key1, _ = T.detect_sentence_columns(raw["train"])
        caps = {"train": s["probe_train"], "validation": s["probe_eval"], "test": s["probe_eval"]}
        feats, ys, sizes, truncated = {}, {}, {}, {}
        for split, cap in caps.items():
            ds = raw[split]
            ds = ds.select(range(min(cap, len(ds)))) if cap else ds
            texts = list(ds[key1])
            ys[split] = list(ds["label"])
            sizes[split] = {"used": len(texts), "available": len(raw[split])}
            truncated[split] = pr.count_truncated(tokenizer, texts, s["max_seq_length"])
            feats[split] = pr.extract_features(model, tokenizer, texts, pooling="mean", batch_size=s["eval_batch_size"],
                                               max_length=s["max_seq_length"], features=features)
        task_type = "regression" if labels.is_regression else "classification"
        r = pr.linear_probe(feats["train"], ys["train"], feats["validation"], ys["validation"], feats["test"],
                            ys["test"], task_type=task_type, seed=spec["seed"], return_predictions=True)
        metric = "accuracy" if task_type == "classification" else "pearson"
        preds = [p.item() if hasattr(p, "item") else p for p in r["test_predictions"]]
        if task_type == "classification":  # class ids: the index of the label among the sorted train labels
            test_predictions, test_labels = _class_ids(preds, labels.values), _class_ids(ys["test"], labels.values)
        else:
            test_predictions, test_labels = [float(p) for p in preds], [float(y) for y in ys["test"]]
        out[task] = round_sig({
            "metric": metric, "test": r[f"test_{metric}"], "validation": r[f"validation_{metric}"],
            "hyperparameter": {"C" if metric == "accuracy" else "alpha": r.get("C", r.get("alpha"))},
            "sizes": sizes, "num_truncated": truncated, "pooling": "mean",
            **({"features": features} if "features" in spec else {}),
            "test_predictions": test_predictions, "test_labels": test_labels,
        })
        log(f"probe {task}: test {metric} {out[task]['test']:.4f}")
    return out


# ---------------------------------------------------------------------------------------------
# fine-tuning: the learning rate selected on validation, the test score at that rate
# ---------------------------------------------------------------------------------------------
def select_learning_rate(validation_by_lr: dict) -> float:
    """The learning rate with the best validation score (ties: the smaller rate). Test scores never enter."""
    usable = {float(lr): v for lr, v in validation_by_lr.items() if v is not None and not math.isnan(v)}
    if not usable:
        raise ValueError(f"no learning rate has a validation score: {validation_by_lr}")
    return max(sorted(usable), key=lambda lr: (usable[lr], -lr))


def score(metric: str, predictions, labels) -> float:
    """Accuracy, or Pearson r for regression, of ``predictions`` against ``labels``."""
    import numpy as np

    p, y = np.asarray(predictions, dtype=float), np.asarray(labels, dtype=float)
    if len(p) != len(y) or not len(y):
        raise ValueError(f"{len(p)} predictions for {len(y)} labels")
    if metric == "accuracy":
        return float((p == y).mean())
    if p.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(p, y)[0, 1])


def _read_predictions(folder: Path, labels) -> list:
    rows = (folder / "predict_results_test.txt").read_text().splitlines()[1:]
    values = [row.split("\t", 1)[1] for row in rows if row.strip()]
    if labels.is_regression:
        return [float(v) for v in values]
    return [labels.names.index(v) for v in values]


def finetune_one(ckpt, spec, task, mode, lr, log) -> dict:
    from hf_lookaround.evaluation import glue as G
    from hf_lookaround.evaluation import tasks as T

    s = spec["settings"]
    folder = Path(spec["cell_dir"]) / "finetune" / f"{task}-{mode}-lr{lr:g}"
    task_dir = spec["prep"]["task_dirs"][task]
    model_args = G.ModelArguments(model_name_or_path=str(ckpt), use_lora=mode == "lora",
                                  features=spec.get("features"))  # None: the config's (content_last_layer)
    data_args = G.DataTrainingArguments(dataset_name=task_dir, max_seq_length=s["max_seq_length"],
                                        max_train_samples=s["ft_train"], max_eval_samples=s["ft_eval"])
    available = spec["prep"]["task_sizes"][task]["train"]
    steps = math.ceil(min(s["ft_train"] or available, available) / s["ft_batch_size"] * s["ft_epochs"])
    training_args = _training_args(
        folder, spec["seed"], spec["device"], do_train=True, do_eval=True, do_predict=True,
        num_train_epochs=s["ft_epochs"], per_device_train_batch_size=s["ft_batch_size"],
        per_device_eval_batch_size=s["eval_batch_size"], learning_rate=lr, weight_decay=0.01,
        warmup_steps=max(1, int(0.1 * steps)), logging_strategy="no",
    )
    start = time.perf_counter()
    metrics = G.run(model_args, data_args, training_args)
    seconds = time.perf_counter() - start
    metric = "accuracy" if "eval_accuracy" in metrics else "pearson"
    raw = T.load_labeled_splits(dataset=task_dir)
    labels = T.label_info(raw)
    gold = list(raw["test"]["label"])
    test_labels = [float(y) for y in gold] if labels.is_regression else _class_ids(gold, labels.values)
    predictions = _read_predictions(folder, labels)
    shutil.rmtree(folder, ignore_errors=True)  # the fine-tuned models are not needed after their scores
    log(f"fine-tune {mode} {task} lr {lr:g}: validation {metric} {metrics[f'eval_{metric}']:.4f} ({seconds:.0f} s)")
    # the test score from the predictions (the harness reports none for a test split with negative labels)
    return {"metric": metric, "validation": metrics[f"eval_{metric}"], "test": score(metric, predictions, test_labels),
            "test_predictions": predictions, "test_labels": test_labels, "seconds": seconds, "steps": steps,
            "train_samples": metrics.get("train_samples")}


def finetune(ckpt, spec, log, save) -> dict:
    """Every mode of ``ft_modes`` and every task, at each rate of the grid; a task's whole grid is skipped (named
    in ``skipped``) when it would not end before the call's deadline (the longest task so far x 1.5 + 15 s)."""
    s = spec["settings"]
    out = {mode: {} for mode in s["ft_modes"]}
    out["skipped"] = []
    longest = 0.0
    for mode in s["ft_modes"]:
        grid = [float(lr) for lr in (s["lora_lrs"] if mode == "lora" else s["ft_lrs"])]
        for task in TASKS:
            if time.time() + 1.5 * longest + 15 > spec["deadline_unix"]:
                out["skipped"].append(f"{mode}/{task}")
                log(f"fine-tune {mode} {task}: skipped, its learning-rate grid would not end before the time limit")
                continue
            start = time.perf_counter()
            runs = {lr: finetune_one(ckpt, spec, task, mode, lr, log) for lr in grid}
            best = select_learning_rate({lr: r["validation"] for lr, r in runs.items()})
            chosen = runs[best]
            seconds = time.perf_counter() - start
            longest = max(longest, seconds)
            out[mode][task] = round_sig({
                "metric": chosen["metric"], "lr_grid": grid,
                "validation_by_lr": {f"{lr:g}": r["validation"] for lr, r in runs.items()},
                "learning_rate": best, "validation": chosen["validation"], "test": chosen["test"],
                "test_predictions": chosen["test_predictions"], "test_labels": chosen["test_labels"],
                "epochs": s["ft_epochs"], "train_samples": chosen["train_samples"], "steps_per_run": chosen["steps"],
                "seconds": seconds, "selected_on": "validation",
            })
            save(out)
            log(f"fine-tune {mode} {task}: lr {best:g} selected on validation ({chosen['validation']:.4f}), "
                f"test {chosen['test']}")
    return out


# ---------------------------------------------------------------------------------------------
# the worker
# ---------------------------------------------------------------------------------------------
def run_cell(spec_path: str) -> int:
    """Worker: one spec (a grid cell or a sweep run), its result file rewritten after every phase."""
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

    result = {"complete": False, "phase_seconds": {}, "versions": versions(), "kind": spec["kind"]}

    def save(**measures):
        result.update(measures)
        if spec["device"] == "cuda":
            result["peak_gpu_memory_gib"] = round_sig(torch.cuda.max_memory_allocated() / 2**30, 4)
        write_json(Path(spec["result_path"]), result)

    def phase(name, fn, *args, **kwargs):
        t = time.perf_counter()
        value = fn(*args, **kwargs)
        result["phase_seconds"][name] = round_sig(time.perf_counter() - t)
        return value

    tokenizer = AutoTokenizer.from_pretrained(spec["prep"]["tokenizer"])
    sweep = spec["kind"] == "sweep"
    model, ckpt, info = phase("pretrain", pretrain, spec, tokenizer, log, save_model=not sweep)
    save(pretrain=info)
    if not sweep:
        model.to(spec["device"])
        save(perplexity=phase("perplexity", perplexity, model, tokenizer, spec, log))
        save(probe=phase("probe", probes, model, tokenizer, spec, log))
        del model
        if spec["device"] == "cuda":
            torch.cuda.empty_cache()
        save(finetune=phase("finetune", finetune, ckpt, spec, log, lambda ft: save(finetune=ft)))
        shutil.rmtree(Path(spec["cell_dir"]) / "pretrained", ignore_errors=True)
    result["phase_seconds"]["worker_total"] = round_sig(time.perf_counter() - t_start)
    save(complete=True)
    skipped = result.get("finetune", {}).get("skipped")
    log(f"done in {result['phase_seconds']['worker_total']:.0f} s" + (f"; skipped for time: {', '.join(skipped)}"
                                                                      if skipped else ""))
    return 0
