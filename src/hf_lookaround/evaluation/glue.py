"""GLUE-style fine-tuning with ``Trainer``, fully or with LoRA: ``hf-lookaround glue`` and ``examples/run_glue.py``.

In the manner of transformers' ``run_glue.py``: ``HfArgumentParser`` over :class:`ModelArguments`,
:class:`DataTrainingArguments` and ``TrainingArguments`` (so every Trainer option works, and a single
``.json`` argument is read as a file of arguments).

- Data: ``--task_name`` (a GLUE task, from ``nyu-mll/glue`` when a network is there), or local
  ``--train_file`` / ``--validation_file`` / ``--test_file`` (CSV or JSON Lines with one or two sentence
  columns and a ``label`` column), or ``--dataset_name`` (a folder of split files or a datasets name).
- Model: any checkpoint ``AutoModelForSequenceClassification`` loads (a LookAround checkpoint pretrained
  with any objective gets a fresh head). A checkpoint that already has a classification head with a
  different number of labels is an error unless ``--ignore_mismatched_sizes``.
- LoRA (``--use_lora``): adapters on the attention / MLP ``Linear`` layers of the backbone, found by
  name (:func:`find_lora_target_modules`); the classification head is trained fully and saved with the
  adapter (``modules_to_save``) in ``output_dir/adapter`` (``PeftModel.from_pretrained(base,
  output_dir/"adapter")`` reloads it), and the merged model is saved in ``output_dir`` itself.
- The output folder loads the way users load a fine-tuned model, full or LoRA:
  ``pipeline("text-classification", model=output_dir)`` or
  ``AutoModelForSequenceClassification.from_pretrained(output_dir)``, with the data's number of labels
  and their names (a ``label_name`` column becomes ``config.id2label``).
- Metrics: the package's ``evaluate`` module (:func:`glue_metric_path`), which loads offline.
- Results: ``train_results.json``, ``eval_results.json`` and ``all_results.json`` as transformers writes them.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data.subsets import seeded_sample

logger = logging.getLogger(__name__)

__all__ = [
    "ModelArguments",
    "DataTrainingArguments",
    "glue_metric_path",
    "load_glue_metric",
    "head_module_names",
    "find_lora_target_modules",
    "check_head_size",
    "run",
]


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "checkpoint folder or hub name"})
    config_name: str | None = field(default=None, metadata={"help": "config if not the model's"})
    tokenizer_name: str | None = field(default=None, metadata={"help": "tokenizer if not the model's"})
    cache_dir: str | None = field(default=None)
    model_revision: str = field(default="main")
    trust_remote_code: bool = field(default=False)
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "replace a classification head whose label count differs from the data's"}
    )
    attention_pattern: str | None = field(
        default=None, metadata={"help": "LookAround: causal or bidirectional (default: as pretrained)"}
    )
    classifier_pooling: str | None = field(default=None, metadata={"help": "LookAround: cls, mean or last"})
    features: str | None = field(
        default=None, metadata={"help": "LookAround: the token states the classifier pools, prediction_state or "
                                        "content_last_layer (default: the config's classifier_features; "
                                        "docs/evaluation.md)"}
    )
    use_lora: bool = field(default=False, metadata={"help": "fine-tune LoRA adapters (peft) instead of all weights"})
    lora_r: int = field(default=8)
    lora_alpha: int = field(default=16)
    lora_dropout: float = field(default=0.05)
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "module names to adapt (default: every Linear of the backbone, found by name)"}
    )


@dataclass
class DataTrainingArguments:
    task_name: str | None = field(default=None, metadata={"help": "a GLUE task: cola sst2 mrpc qqp stsb mnli qnli rte wnli"})
    dataset_name: str | None = field(default=None, metadata={"help": "a folder of {train,validation,test} files or a datasets name"})
    dataset_config_name: str | None = field(default=None)
    train_file: str | None = field(default=None, metadata={"help": "CSV or JSON(L) training data"})
    validation_file: str | None = field(default=None, metadata={"help": "CSV or JSON(L) validation data"})
    test_file: str | None = field(default=None, metadata={"help": "CSV or JSON(L) test data (labels optional)"})
    label_column: str = field(default="label")
    max_seq_length: int = field(default=128, metadata={"help": "longer inputs are truncated, and counted in the log"})
    max_train_samples: int | None = field(default=None)
    max_eval_samples: int | None = field(default=None)
    max_predict_samples: int | None = field(default=None)

    def __post_init__(self):
        if self.task_name is not None:
            self.task_name = self.task_name.lower()


def glue_metric_path() -> str:
    """The folder of the package's ``evaluate`` metric module (``evaluate.load(path, config_name)``)."""
    return str(Path(__file__).resolve().parents[1] / "metrics" / "glue_lookaround")


def load_glue_metric(config_name: str):
    """The GLUE metric of ``config_name`` (a GLUE task, ``accuracy`` or ``regression``), offline."""
    import evaluate

    return evaluate.load(glue_metric_path(), config_name)


# ---------------------------------------------------------------------------------------------
# model helpers
# ---------------------------------------------------------------------------------------------


def head_module_names(model) -> list[str]:
    """Top-level modules with weights outside the backbone: the task head (``score``, ``classifier``, ...)."""
    prefix = getattr(model, "base_model_prefix", "")
    return [
        name
        for name, child in model.named_children()
        if name != prefix and any(True for _ in child.parameters())
    ]


def find_lora_target_modules(model) -> list[str]:
    """Names (last component) of the backbone's ``Linear`` layers: attention and MLP projections.

    Found by inspecting the module tree rather than hard-coding, so any architecture works
    (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` for LookAround, ``c_attn c_proj c_fc``
    for GPT-2, ``query key value dense`` for BERT). The task head is excluded: it is trained in full.
    """
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    heads = set(head_module_names(model))
    names = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and name.split(".")[0] not in heads and "lm_head" not in name
    }
    if not names:
        raise ValueError(f"found no Linear layer in the backbone of {type(model).__name__} to put LoRA adapters on")
    return sorted(names)


def apply_lora(model, model_args: ModelArguments):
    from peft import LoraConfig, TaskType, get_peft_model

    targets = model_args.lora_target_modules or find_lora_target_modules(model)
    heads = head_module_names(model)
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets,
        modules_to_save=heads,
    )
    logger.info("LoRA r=%d alpha=%d on %s; trained in full: %s", config.r, config.lora_alpha, targets, heads)
    model = get_peft_model(model, config)
    model.print_trainable_parameters()
    return model


def check_head_size(checkpoint_config, num_labels: int, ignore_mismatched_sizes: bool) -> None:
    """A checkpoint with a classification head must match the data's label count (or be told to replace it)."""
    archs = getattr(checkpoint_config, "architectures", None) or []
    has_head = any(a.endswith("ForSequenceClassification") for a in archs)
    if has_head and checkpoint_config.num_labels != num_labels and not ignore_mismatched_sizes:
        raise ValueError(
            f"the checkpoint's classification head has {checkpoint_config.num_labels} labels but the data has "
            f"{num_labels}; pass --ignore_mismatched_sizes to replace the head with a new one"
        )


# ---------------------------------------------------------------------------------------------
# the job
# ---------------------------------------------------------------------------------------------


def _metric_config(task_name: str | None, is_regression: bool) -> str:
    from hf_lookaround.evaluation.tasks import GLUE_TASK_KEYS

    if task_name in GLUE_TASK_KEYS:
        return task_name
    return "regression" if is_regression else "accuracy"


def run(model_args: ModelArguments, data_args: DataTrainingArguments, training_args) -> dict:
    """Fine-tune and evaluate; return all metrics (also written to ``output_dir/all_results.json``).

    The steps, in order: read the labelled splits, load the model with a head for their labels, tokenize, then
    train / evaluate / predict with ``Trainer``, and write the fine-tuned model's card."""
    from transformers import DataCollatorWithPadding, Trainer, set_seed

    from hf_lookaround.evaluation.tasks import detect_sentence_columns, label_info, load_labeled_splits

    set_seed(training_args.seed)
    raw = load_labeled_splits(
        task_name=data_args.task_name,
        dataset=data_args.dataset_name,
        dataset_config_name=data_args.dataset_config_name,
        train_file=data_args.train_file,
        validation_file=data_args.validation_file,
        test_file=data_args.test_file,
        label_column=data_args.label_column,
    )
    if training_args.do_eval and "validation" not in raw:
        raise ValueError("--do_eval needs a validation split: pass --validation_file")
    labels = label_info(raw, data_args.task_name, data_args.label_column)
    columns = detect_sentence_columns(raw["train"], data_args.task_name, data_args.label_column)
    logger.info("inputs: %s; %s", columns, "regression" if labels.is_regression else f"{labels.num_labels} classes")

    model, tokenizer = _load_model(model_args, data_args, labels)
    processed = _tokenize_splits(raw, tokenizer, labels, columns, data_args, training_args.seed)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=processed.get("train") if training_args.do_train else None,
        eval_dataset=processed.get("validation") if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if training_args.fp16 else None),
        compute_metrics=_metrics_function(data_args.task_name, labels.is_regression),
    )
    metrics = _train_evaluate_predict(trainer, tokenizer, processed, labels, model_args, data_args, training_args)
    if training_args.do_train and trainer.is_world_process_zero():
        from ..hub.cards import write_model_card

        # the fine-tuned classifier gets its own card: the fine-tune, its base model and its results
        data_name = data_args.dataset_name or data_args.task_name
        fine_tune = {
            "task": data_args.task_name or "text classification",
            "method": (f"LoRA (r={model_args.lora_r}, alpha={model_args.lora_alpha})" if model_args.use_lora
                       else "full"),
            "problem_type": model.config.problem_type,
            "labels": None if labels.is_regression else [str(n) for n in labels.names],
            "dataset": data_args.train_file or data_name,
            "eval_dataset": (data_args.validation_file or data_name) if training_args.do_eval else None,
            "test_dataset": (data_args.test_file or data_name) if training_args.do_predict else None,
        }
        write_model_card(training_args.output_dir, base_model=model_args.model_name_or_path,
                         dataset=data_args.dataset_name or data_args.train_file or data_args.task_name,
                         fine_tune=fine_tune)
    return metrics


def _load_model(model_args: ModelArguments, data_args: DataTrainingArguments, labels):
    """The checkpoint with a classification head for ``labels`` (a ``label_info``), LoRA adapters if asked, and
    its tokenizer (padding with EOS where it has no pad token, as run_glue users do)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from hf_lookaround.data.tokenization import auto_tokenizer
    from hf_lookaround.hub.load import load_checkpoint
    from hf_lookaround.hub.weights import check_local_checkpoint

    common = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision,
              "trust_remote_code": model_args.trust_remote_code}
    check_local_checkpoint(model_args.model_name_or_path, "hf-lookaround glue", kinds=("text", "other"))
    checkpoint_config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, **common)
    check_head_size(checkpoint_config, labels.num_labels, model_args.ignore_mismatched_sizes)
    config_kwargs = {"finetuning_task": data_args.task_name or "text-classification"}
    if labels.is_regression:
        config_kwargs.update(num_labels=1, problem_type="regression")
    else:  # id2label sets num_labels (passing both lets num_labels reset the names)
        config_kwargs.update(
            problem_type="single_label_classification",
            id2label=dict(enumerate(labels.names)),
            label2id={n: i for i, n in enumerate(labels.names)},
        )
    if model_args.attention_pattern:
        config_kwargs["default_attention"] = model_args.attention_pattern
    if model_args.classifier_pooling:
        config_kwargs["classifier_pooling"] = model_args.classifier_pooling
    if model_args.features:
        if model_args.attention_pattern and model_args.features == "prediction_state":
            raise ValueError("--attention_pattern applies to --features content_last_layer; prediction_state is read "
                             "in the checkpoint's own training layout: drop one of them")
        config_kwargs["classifier_features"] = model_args.features
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, **config_kwargs, **common)
    tokenizer = auto_tokenizer(model_args.tokenizer_name or model_args.model_name_or_path, **common)
    model = load_checkpoint(
        AutoModelForSequenceClassification, model_args.model_name_or_path, "hf-lookaround glue", ("text", "other"),
        config=config, ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, **common
    )
    if tokenizer.pad_token is None:  # GPT-style tokenizers: pad with EOS, as run_glue users do
        tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and getattr(config, "model_type", None) == "lookaround":
        from hf_lookaround.models.lookaround.features_lookaround import positions_past_input

        max_positions -= positions_past_input(config, config.classifier_features)  # the row after the last token
    if max_positions and data_args.max_seq_length > max_positions:
        raise ValueError(f"--max_seq_length {data_args.max_seq_length} exceeds the {max_positions} positions the "
                         f"model's features take")
    if model_args.use_lora:
        model = apply_lora(model, model_args)
    return model, tokenizer


def _tokenize_splits(raw, tokenizer, labels, columns, data_args: DataTrainingArguments, seed: int) -> dict:
    """The train, validation and test splits, sampled (``--max_*_samples``), tokenized (``columns``: the one or two
    sentence columns) and labelled with class ids; a warning counts what ``--max_seq_length`` truncated."""
    from hf_lookaround.data.tokenization import encode_sentences

    key1, key2 = columns
    label_to_id = None if labels.is_regression else {v: i for i, v in enumerate(labels.values)}

    def preprocess(batch):
        pairs = None if key2 is None else batch[key2]
        # encode_sentences: a single sentence keeps its end token (<s> A </s>), as a pair does
        out = encode_sentences(tokenizer, batch[key1], pairs, truncation=True, max_length=data_args.max_seq_length)
        full = encode_sentences(tokenizer, batch[key1], pairs)["input_ids"]  # to count what truncation cut
        out["was_truncated"] = [len(ids) > data_args.max_seq_length for ids in full]
        if data_args.label_column in batch:
            gold = batch[data_args.label_column]
            if label_to_id is not None:
                unknown = {g for g in gold if g not in label_to_id and g != -1}
                if unknown:
                    raise ValueError(f"labels {sorted(unknown, key=str)} are not among the train labels {labels.values}")
                gold = [label_to_id.get(g, -1) for g in gold]
            out["label"] = gold
        return out

    caps = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples,
            "test": data_args.max_predict_samples}
    flags = {"train": "--max_train_samples", "validation": "--max_eval_samples", "test": "--max_predict_samples"}
    processed = {}
    for split, ds in raw.items():
        if split not in caps:
            continue
        # the test split's sample keeps file order: its predictions are written row by row
        ds = seeded_sample(ds, caps[split], seed, what=f"{split} examples", flag=flags[split],
                           label_column=data_args.label_column if label_to_id is not None else None,
                           keep_order=split == "test")
        removable = [c for c in ds.column_names if c != "label"]
        ds = ds.map(preprocess, batched=True, remove_columns=removable, desc=f"tokenizing {split}")
        truncated = int(sum(ds["was_truncated"]))
        if truncated:
            logger.warning("%s: truncated %d of %d examples to --max_seq_length %d tokens", split, truncated, len(ds),
                           data_args.max_seq_length)
        processed[split] = ds.remove_columns("was_truncated")
    return processed


def _metrics_function(task_name: str | None, is_regression: bool):
    """``compute_metrics`` for ``Trainer``: the task's GLUE metric (several values also give their mean,
    ``combined_score``)."""
    metric = load_glue_metric(_metric_config(task_name, is_regression))

    def compute_metrics(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if is_regression else np.argmax(preds, axis=1)
        result = metric.compute(predictions=preds, references=p.label_ids)
        if len(result) > 1:
            result["combined_score"] = float(np.mean(list(result.values())))
        return result

    return compute_metrics


def _train_evaluate_predict(trainer, tokenizer, processed: dict, labels, model_args, data_args, training_args) -> dict:
    """``--do_train`` / ``--do_eval`` / ``--do_predict`` in turn; the metrics of each (``all_results.json`` collects
    train_* and eval_*). Predictions are written to ``predict_results_<task>.txt``."""
    metrics = {}
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        save_loadable_model(trainer, tokenizer, training_args.output_dir, model_args.use_lora)
        train_metrics = dict(result.metrics, train_samples=len(processed["train"]))
        trainer.log_metrics("train", train_metrics)
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)
    if training_args.do_eval:
        eval_metrics = trainer.evaluate(eval_dataset=processed["validation"])
        eval_metrics["eval_samples"] = len(processed["validation"])
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    if training_args.do_predict:
        if "test" not in processed:
            raise ValueError("--do_predict needs test data: pass --test_file")
        test = processed["test"]
        output = trainer.predict(test, metric_key_prefix="predict")
        if "label" in test.column_names and min(test["label"]) >= 0:  # a labelled test split: report its metrics
            trainer.log_metrics("predict", output.metrics)
            trainer.save_metrics("predict", output.metrics)
            metrics.update(output.metrics)
        preds = np.squeeze(output.predictions) if labels.is_regression else np.argmax(output.predictions, axis=1)
        if trainer.is_world_process_zero():
            path = Path(training_args.output_dir) / f"predict_results_{data_args.task_name or 'test'}.txt"
            with open(path, "w") as f:
                f.write("index\tprediction\n")
                for i, p in enumerate(preds):
                    f.write(f"{i}\t{p:.3f}\n" if labels.is_regression else f"{i}\t{labels.names[int(p)]}\n")
    return metrics


def save_loadable_model(trainer, tokenizer, output_dir: str, use_lora: bool) -> None:
    """Save so that ``pipeline("text-classification", model=output_dir)`` works, full or LoRA.

    A LoRA adapter alone would not do: loading it rebuilds the base from the *pretraining* checkpoint's
    config, with a 2-label head initialised at random and no label names. So a LoRA run saves the adapter
    (and the trained head) in ``output_dir/adapter`` and the merged model, whose config carries
    ``num_labels`` and ``id2label``, in ``output_dir``.
    """
    if not use_lora:
        trainer.save_model(output_dir)
        return
    trainer.save_model(os.path.join(output_dir, "adapter"))
    if trainer.is_world_process_zero():
        merged = copy.deepcopy(trainer.model).merge_and_unload()  # the trained model keeps its adapter
        merged.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        logger.info("saved the LoRA adapter in %s/adapter and the merged model in %s", output_dir, output_dir)
