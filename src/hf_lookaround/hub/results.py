"""Results for the model card: what the evaluation commands left in a checkpoint folder, as ``model-index``
entries (:func:`collect_results`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from .files import read_json

logger = logging.getLogger(__name__)

# an absolute path in a data set's description: "/", "~/" or "C:\" up to a space, comma, semicolon or bracket
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])(?:~?/|[A-Za-z]:\\)[^\s,;()]+")


def public_dataset_name(text: str) -> str:
    """A data set's name as a model card records it: every absolute path of the user's machine in ``text``
    becomes its last two parts, marked local ("/home/u/data/news/train.jsonl" -> "news/train.jsonl (local)");
    Hub ids and names pass through. A card is public: the folders of the machine that trained it are not its
    business, and a path is no link."""
    def short(match: re.Match) -> str:
        parts = [p for p in re.split(r"[/\\]", match.group(0)) if p and p != "~"]
        return "/".join(parts[-2:]) + " (local)"

    return _ABSOLUTE_PATH.sub(short, str(text))


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# Metric names of the evaluation commands -> (model-index metric type, readable name).
METRIC_NAMES = {
    "loss": ("loss", "held-out loss of the pretraining objective"),
    "perplexity": ("perplexity", "perplexity"),
    "ar_perplexity": ("perplexity", "AR perplexity p(x_k | x_<k)"),
    "masked_perplexity": ("perplexity", "masked-prefix perplexity p(x_k | x_<k)"),
    "pseudo_perplexity": ("pseudo-perplexity", "pseudo-perplexity (every token masked in turn)"),
    "bits_per_byte": ("bits_per_byte", "bits per byte"),
}


# The loss a fine-tuned classifier reports, by its config's problem_type (what transformers' heads compute).
FINE_TUNE_LOSSES = {
    "regression": "regression loss (mean squared error)",
    "multi_label_classification": "classification loss (binary cross-entropy)",
    "single_label_classification": "classification loss (cross-entropy)",
}
RESULT_FILES = ("all_results.json", "eval_results.json", "probe_results.json", "perplexity.json")


def collect_results(checkpoint_dir, dataset: str | None = None, task_type: str = "text-generation",
                    fine_tune: dict | None = None) -> list:
    """Evaluation results found in ``checkpoint_dir`` as ``huggingface_hub.EvalResult`` entries (see
    :func:`collect_results_by_file` for what is read)."""
    return [r for found in collect_results_by_file(checkpoint_dir, dataset, task_type, fine_tune).values()
            for r in found]


def collect_results_by_file(checkpoint_dir, dataset: str | None = None, task_type: str = "text-generation",
                            fine_tune: dict | None = None) -> dict[str, list]:
    """``{file name: [EvalResult, ...]}`` for the result files of ``checkpoint_dir`` that hold a result.

    Reads whichever of these exist (missing keys are skipped, never an error):

    - ``all_results.json`` / ``eval_results.json`` (transformers' layout, ``{"eval_accuracy": ..}``):
      every ``eval_*`` metric, plus ``perplexity``; on ``dataset`` (the pretraining data), split validation.
      For a fine-tuned classifier (``fine_tune``: ``{"task", "dataset", "eval_dataset", "test_dataset",
      "problem_type"}``) they are the fine-tune's: ``eval_*`` on its validation data, ``predict_*`` on its test
      data, the loss named as the classification (or regression) loss it is;
    - ``probe_results.json``: ``{"task", "dataset", "metric", "test_<metric>"}`` (or a list of such),
      the linear probe;
    - ``perplexity.json``: ``{"dataset", "ar_perplexity", "masked_perplexity", "bits_per_byte"}``.

    ``task_type`` is the model-index task of the language-modelling numbers (``fill-mask`` for masked models).
    """
    from huggingface_hub import EvalResult

    folder = Path(checkpoint_dir)
    found: dict[str, list] = {}
    source = public_dataset_name(dataset or "pretraining data")

    trainer_file = next((n for n in RESULT_FILES[:2] if isinstance(read_json(folder / n), dict) and read_json(folder / n)), None)
    trainer_metrics = read_json(folder / trainer_file) if trainer_file else {}
    if fine_tune:
        task = fine_tune.get("task") or "text classification"
        splits = {"eval_": ("validation", fine_tune.get("eval_dataset")),
                  "predict_": ("test", fine_tune.get("test_dataset"))}
        loss_name = FINE_TUNE_LOSSES.get(fine_tune.get("problem_type"), FINE_TUNE_LOSSES["single_label_classification"])
    else:
        splits = {"eval_": ("validation", None)}
    skip = ("runtime", "samples_per_second", "steps_per_second", "samples", "epoch")
    for key, value in sorted(trainer_metrics.items()):
        prefix = next((p for p in splits if key.startswith(p)), None)
        name = key[len(prefix):] if prefix else key if key == "perplexity" and not fine_tune else None
        if name is None or name in skip or _number(value) is None:
            continue
        if fine_tune:
            split, data = splits[prefix]
            data = public_dataset_name(data or fine_tune.get("dataset") or task)
            metric_type, metric_name = ("loss", loss_name) if name == "loss" else (name, f"{split} {name}")
            task_name = f"Fine-tuning ({task})"
            entry_type = "text-classification"
        else:
            split, data = "validation", source
            metric_type, metric_name = METRIC_NAMES.get(name, (name, f"eval {name}"))
            task_name, entry_type = "Pretraining data (held-out)", task_type
        found.setdefault(trainer_file, []).append(EvalResult(
            task_type=entry_type, task_name=task_name, dataset_type=data, dataset_name=data, dataset_split=split,
            metric_type=metric_type, metric_name=metric_name, metric_value=_number(value),
        ))

    probes = read_json(folder / "probe_results.json")
    for probe in probes if isinstance(probes, list) else [probes] if isinstance(probes, dict) else []:
        metric = probe.get("metric") or "accuracy"
        value = _number(probe.get(f"test_{metric}", probe.get(metric)))
        if value is None:
            continue
        task, data = probe.get("task"), public_dataset_name(probe.get("dataset") or probe.get("task") or "unknown")
        found.setdefault("probe_results.json", []).append(EvalResult(
            task_type="text-classification", task_name=f"Linear probe{f' ({task})' if task else ''}",
            dataset_type=data, dataset_name=data, dataset_split=probe.get("split", "test"),
            metric_type=metric, metric_name=f"linear probe {metric}", metric_value=value,
        ))

    ppl = read_json(folder / "perplexity.json")
    if isinstance(ppl, dict):
        data = public_dataset_name(ppl.get("dataset") or source)
        for key in ("ar_perplexity", "masked_perplexity", "pseudo_perplexity", "bits_per_byte"):
            value = _number(ppl.get(key))
            metric, label = METRIC_NAMES[key]
            if value is not None:
                found.setdefault("perplexity.json", []).append(EvalResult(
                    task_type=task_type, task_name="Language modelling",
                    dataset_type=data, dataset_name=data, dataset_split=ppl.get("split", "test"),
                    metric_type=metric, metric_name=label, metric_value=value,
                ))
    return found
