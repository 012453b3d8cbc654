"""Loading evaluation data: raw text for perplexity, sentence (pair) / label splits for probing and GLUE.

Everything works from local files (JSON Lines, JSON, CSV, plain text, optionally gzipped), from a
directory holding ``{train,validation,test}.<ext>``, or from a ``datasets`` name when a network is
there. Errors say what to pass instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..data import records

logger = logging.getLogger(__name__)

__all__ = [
    "GLUE_TASKS",
    "GLUE_TASK_KEYS",
    "load_texts",
    "load_labeled_splits",
    "detect_sentence_columns",
    "label_info",
    "LabelInfo",
]

# run_glue's task_to_keys: the sentence column(s) of each GLUE task.
GLUE_TASK_KEYS = {
    "cola": ("sentence", None),
    "sst2": ("sentence", None),
    "mrpc": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"),
    "stsb": ("sentence1", "sentence2"),
    "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"),
    "rte": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
GLUE_TASKS = tuple(GLUE_TASK_KEYS)
_SPLITS = ("train", "validation", "test")
_EXTENSIONS = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".csv", ".csv.gz", ".txt", ".txt.gz")
# columns that are never sentence inputs when auto-detecting
_NON_TEXT_COLUMNS = {"label", "labels", "label_name", "label_text", "idx", "id"}


def _builder_for(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith((".jsonl", ".json")):
        return "json"
    if name.endswith(".csv"):
        return "csv"
    if name.endswith(".txt"):
        return "text"
    raise ValueError(f"unsupported file type for {path!r}; use JSON Lines, JSON, CSV or .txt (optionally .gz)")


def _split_file(directory: Path, split: str) -> Path | None:
    for ext in _EXTENSIONS:
        candidate = directory / f"{split}{ext}"
        if candidate.is_file():
            return candidate
    return None


# ---------------------------------------------------------------------------------------------
# raw text (perplexity)
# ---------------------------------------------------------------------------------------------


def _read_text_file(path: Path, text_column: str) -> list[str]:
    if _builder_for(str(path)) not in ("json", "text"):
        raise ValueError(f"unsupported text file {path}; use .jsonl, .json or .txt (optionally .gz)")
    if records.check_file(path, text_column) == 0:
        raise ValueError(f"{path}: the file is empty; give a file that holds documents")
    # .txt: one document per file (perplexity needs running text, not lines out of context)
    return list(records.read_documents(path, text_column))


def load_texts(source: str, split: str = "test", text_column: str = "text", config_name: str | None = None) -> list[str]:
    """Documents of ``source``: a file, a directory with ``<split>.<ext>``, or a ``datasets`` name."""
    path = Path(source)
    if path.is_dir():
        found = _split_file(path, split)
        if found is None:
            raise ValueError(f"{source} has no {split}.<jsonl|jsonl.gz|json|txt> file")
        path = found
    if path.is_file():
        texts = _read_text_file(path, text_column)
    else:
        texts = list(_load_hub_split(source, config_name, split)[text_column])
    texts = [t for t in texts if t and t.strip()]
    if not texts:
        raise ValueError(f"no non-empty text found in {source} (split {split!r})")
    return texts


def _load_hub_split(name: str, config_name: str | None, split: str):
    import datasets

    try:
        return datasets.load_dataset(name, config_name, split=split)
    except Exception as err:  # offline, unknown name, ...: say what to do instead
        raise ValueError(
            f"could not load {name!r} (config {config_name!r}, split {split!r}) with datasets.load_dataset: {err}. "
            "If there is no network, point to local files instead."
        ) from err


# ---------------------------------------------------------------------------------------------
# sentence (pair) / label tasks (probing, GLUE)
# ---------------------------------------------------------------------------------------------


def load_labeled_splits(
    task_name: str | None = None,
    dataset: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    test_file: str | None = None,
    label_column: str = "label",
):
    """A ``DatasetDict`` with ``train`` / ``validation`` (and ``test`` when given) for a sentence task.

    Sources, in order: local files; ``dataset`` (a directory with ``{train,validation,test}.<ext>``
    or a ``datasets`` name); a GLUE ``task_name`` (``nyu-mll/glue``, needs a network).
    """
    import datasets

    files = {k: v for k, v in (("train", train_file), ("validation", validation_file), ("test", test_file)) if v}
    if not files and dataset and Path(dataset).is_dir():
        files = {s: str(p) for s in _SPLITS if (p := _split_file(Path(dataset), s)) is not None}
        if not files:
            raise ValueError(f"directory {dataset} holds no train/validation/test .jsonl/.json/.csv file")
    if files:
        for split, file in files.items():
            if not Path(file).is_file():
                raise ValueError(f"--{split}_file {file} does not exist")
        for file in files.values():  # every record checked, naming file and line, before `datasets` reads it
            if records.check_file(file, None) == 0:
                raise ValueError(f"{file}: the file is empty; give a file that holds examples")
        builders = {_builder_for(f) for f in files.values()}
        if len(builders) != 1:
            raise ValueError(f"all data files must have the same format, got {files}")
        raw = datasets.load_dataset(builders.pop(), data_files=files)
    elif dataset:
        raw = _load_hub_dict(dataset, dataset_config_name)
    elif task_name:
        task = task_name.lower()
        if task not in GLUE_TASK_KEYS:
            raise ValueError(f"unknown GLUE task {task_name!r}; choose one of {GLUE_TASKS} or pass --train_file")
        raw = _load_hub_dict("nyu-mll/glue", task, hint=f"GLUE task {task!r}")
        if task == "mnli":
            raw["validation"] = raw["validation_matched"]
            raw["test"] = raw["test_matched"]
    else:
        raise ValueError("no data: pass a --task_name, a --dataset, or --train_file/--validation_file")

    if "train" not in raw:
        raise ValueError(f"the data has no train split (splits: {list(raw)}); pass --train_file")
    for split, ds in raw.items():
        if label_column not in ds.column_names and split != "test":
            raise ValueError(
                f"the {split} split has no label column {label_column!r} (columns: {ds.column_names}); "
                "rename it or pass --label_column"
            )
    return raw


def _load_hub_dict(name: str, config_name: str | None, hint: str | None = None):
    import datasets

    try:
        return datasets.load_dataset(name, config_name)
    except Exception as err:
        what = hint or f"{name!r} (config {config_name!r})"
        raise ValueError(
            f"no data for {what}: datasets.load_dataset({name!r}, {config_name!r}) failed ({type(err).__name__}: "
            f"{err}). Without a network, pass local files with --train_file/--validation_file "
            "(CSV or JSON Lines with sentence column(s) and a 'label' column)."
        ) from err


def detect_sentence_columns(dataset, task_name: str | None = None, label_column: str = "label"):
    """The sentence column(s) ``(key1, key2 or None)``, the way run_glue picks them."""
    columns = dataset.column_names
    if task_name and task_name.lower() in GLUE_TASK_KEYS:
        keys = GLUE_TASK_KEYS[task_name.lower()]
        if all(k is None or k in columns for k in keys):
            return keys
    if "sentence1" in columns and "sentence2" in columns:
        return "sentence1", "sentence2"
    if "sentence" in columns:
        return "sentence", None
    text_like = [
        name
        for name, feature in dataset.features.items()
        if name != label_column and name not in _NON_TEXT_COLUMNS and getattr(feature, "dtype", None) in ("string", "large_string")
    ]
    if not text_like:
        raise ValueError(f"found no text column to classify among {columns}; name it 'sentence' (or sentence1/sentence2)")
    return (text_like[0], text_like[1]) if len(text_like) >= 2 else (text_like[0], None)


@dataclass
class LabelInfo:
    """What the labels are: regression, or classes with their raw values and readable names."""

    is_regression: bool
    values: list | None = None  # raw label values in the data, sorted; index = class id
    names: list[str] | None = None

    @property
    def num_labels(self) -> int:
        return 1 if self.is_regression else len(self.values)


def label_info(raw, task_name: str | None = None, label_column: str = "label") -> LabelInfo:
    """Regression or classification, from the train split (and the GLUE task for STS-B)."""
    import datasets

    train = raw["train"]
    feature = train.features[label_column]
    if (task_name and task_name.lower() == "stsb") or getattr(feature, "dtype", "").startswith("float"):
        return LabelInfo(is_regression=True)
    if isinstance(feature, datasets.ClassLabel):
        return LabelInfo(False, list(range(feature.num_classes)), list(feature.names))
    values = sorted(set(list(train[label_column])))
    names = [str(v) for v in values]
    # readable names when the data carries them (our JSON Lines tasks have label_name)
    if "label_name" in train.column_names:
        by_value = dict(zip(list(train[label_column]), list(train["label_name"])))
        names = [str(by_value[v]) for v in values]
    return LabelInfo(False, values, names)
