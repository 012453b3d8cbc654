"""The one module of the study that imports ``hf_lookaround``: every use of the package goes through here.

When the package's modules move, only this file changes. Each function imports lazily, so the driver and the
report start without torch or the package. On a checkout without ``pip install -e .`` (the GPU machine) the
source tree ``src/`` is put on the path.
"""

from __future__ import annotations

import sys

from study_common import REPO

try:
    import hf_lookaround  # noqa: F401
except ImportError:  # a checkout without `pip install -e .`: the source tree
    sys.path.insert(0, str(REPO / "src"))


# --- data and tokenizer ---------------------------------------------------------------------
def load_text_dataset(files, cache_dir=None):
    from hf_lookaround.data.text import load_text_dataset as fn

    return fn([str(f) for f in files], text_column="text", cache_dir=cache_dir)


def build_blocks(ds, tokenizer, block_size: int, num_proc=None, batch_size: int = 8, what: str = "training data"):
    """Tokenise (documents + EOS) and pack into blocks of ``block_size`` with ``datasets.map``."""
    from hf_lookaround.data.text import build_blocks as fn

    blocks, _ = fn(ds, tokenizer, block_size, num_proc=num_proc, batch_size=batch_size, what=what)
    return blocks


def find_files(path):
    from hf_lookaround.data.text import find_files as fn

    return fn(path)


def train_tokenizer(texts, vocab_size: int, model_max_length: int, output_dir: str):
    from hf_lookaround.data.tokenization import train_tokenizer as fn

    return fn(texts, vocab_size=vocab_size, model_max_length=model_max_length, output_dir=output_dir)


def bbc_news_splits(bbc_dir=None) -> dict[str, list[str]]:
    """BBC News as the demo splits it (a fixed split, seed 0): {train, validation, test: [documents]}."""
    from hf_lookaround.demo import read_bbc_news, split_articles

    bbc = split_articles(read_bbc_news(bbc_dir), seed=0)
    return {split: [a[2] for a in items] for split, items in bbc.items()}


def load_split_texts(folder: str, split: str) -> list[str]:
    from hf_lookaround.evaluation.tasks import load_texts

    return load_texts(folder, split)


# --- pretraining ----------------------------------------------------------------------------
def objective_arguments(kwargs: dict):
    """``ObjectiveArguments(**kwargs)``, with a clear error when this package version lacks an objective."""
    from hf_lookaround import objectives
    from hf_lookaround.training.pretraining import ObjectiveArguments

    name = kwargs.get("objective")
    if name not in objectives.PLAN_NAMES:
        raise ValueError(f"objective {name!r} is not in this version of hf_lookaround (its objectives: "
                         f"{list(objectives.PLAN_NAMES)}); update the package to run this cell")
    try:
        return ObjectiveArguments(**kwargs)
    except TypeError as err:
        raise ValueError(f"this version of hf_lookaround cannot configure {kwargs}: {err}") from err


def pretraining():
    """The pretraining module (``ModelArguments``, ``LookAroundTrainingArguments``, ``build_config``, ``build_model``
    and ``build_trainer``, the one training assembly)."""
    from hf_lookaround.training import pretraining as module

    return module


# --- evaluation -----------------------------------------------------------------------------
def perplexity():
    """The perplexity module (``masked_perplexity``, ``bucket_by_prefix_length``, ``default_masked_mode``,
    ``encode_documents``)."""
    from hf_lookaround.evaluation import perplexity as module

    return module


def probing():
    """``count_truncated``, ``extract_features``, ``linear_probe``."""
    from hf_lookaround.evaluation import probing as module

    return module


def tasks():
    """``detect_sentence_columns``, ``label_info``, ``load_labeled_splits``."""
    from hf_lookaround.evaluation import tasks as module

    return module


def glue():
    """The GLUE harness (``ModelArguments``, ``DataTrainingArguments``, ``run``)."""
    from hf_lookaround.evaluation import glue as module

    return module


def is_one_stream_group_model(config) -> bool:
    """dar's one-stream form (block-causal; ``generate(group_size=t)``, ``ar_perplexity`` with t layouts)."""
    from hf_lookaround.models.lookaround.generation_lookaround import is_one_stream_group_model as fn

    return fn(config)
