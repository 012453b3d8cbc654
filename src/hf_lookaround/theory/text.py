"""Co-occurrence matrices on real tokenized text, with plans drawn by ``make_plan``.

On real text almost every conditional text is unique (a 40-token prefix occurs once), so the
matrix must be coarsened to say anything. Every conditional text is reduced to a *key*:

- ``full``: the whole visible set, ``((position, token), ...)``;
- ``window:w``: only the visible tokens within ``w`` positions of the target, with their offsets
  to the target (an n-gram-like context: for AR the ``w`` previous tokens);

and the key is then hashed (Python's hash of a tuple of ints is deterministic across runs). With
``buckets = 0`` the 64-bit hash is the key itself (collisions are negligible); with
``buckets = B`` keys are merged ``mod B``.

What the coarsening does to the claim of paper (a) is part of the result (see docs/theory.md):
``full`` keeps the objective's structure (a masked conditional text is shared by all targets of
the sample), but then AR contexts are nearly all unique and its spectrum is trivially flat;
hash ``buckets`` merge unrelated contexts at random, which connects targets through hash
collisions rather than through the data; ``window:w`` makes contexts recur across the corpus
but gives every target its own context, so the sharing that the paper credits to masking is
gone and both objectives become n-gram co-occurrence models.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Callable, Hashable

import numpy as np
import torch

from ..data import records
from ..objectives import make_plan
from .cooccurrence import Cooccurrence, cooccurrence_matrix, full_context, pairs_from_plan

__all__ = ["load_texts", "build_tokenizer", "token_windows", "context_function", "sampled_cooccurrence"]

_WORD = re.compile(r"\w+|[^\w\s]")


def load_texts(path, text_field: str = "text", max_documents: int | None = None) -> list[str]:
    """Documents from a ``.jsonl``/``.jsonl.gz`` file (field ``text_field``), a ``.txt`` file (one
    document per non-empty line), or a directory of such files."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz", ".txt", ".txt.gz")))
        if not files:
            raise ValueError(f"{path} holds no .jsonl, .jsonl.gz, .txt or .txt.gz file")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"--data {path} does not exist")
    texts: list[str] = []
    for file in files:
        if ".jsonl" in file.name:  # every record checked (object, string text, JSON, UTF-8, gzip, nesting)
            documents = records.read_documents(file, text_field)
        else:  # one document per non-empty line
            documents = (line.rstrip("\n") for _, line in records.read_lines(file))
        for text in documents:
            if not text.strip():
                continue
            texts.append(text)
            if max_documents is not None and len(texts) >= max_documents:
                return texts
    return texts


def build_tokenizer(kind: str, texts: list[str], vocab_size: int = 1000) -> Callable[[str], list[int]]:
    """A text -> token ids function, built offline.

    - ``words``: lower-cased words and punctuation; the ``vocab_size - 1`` most frequent get ids,
      the rest map to one unknown id;
    - ``bpe``: a byte-level BPE of ``vocab_size`` (>= 261) trained here by
      :func:`hf_lookaround.data.tokenization.train_tokenizer`;
    - anything else is a path to a tokenizer directory for ``AutoTokenizer.from_pretrained``.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if kind == "words":
        counts = Counter(w for text in texts for w in _WORD.findall(text.lower()))
        ids = {w: i + 1 for i, (w, _) in enumerate(counts.most_common(vocab_size - 1))}  # 0 = unknown
        return lambda text: [ids.get(w, 0) for w in _WORD.findall(text.lower())]
    if kind == "bpe":
        from ..tokenization import train_tokenizer

        tokenizer = train_tokenizer(texts, vocab_size=vocab_size)
        return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kind)
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def token_windows(texts: list[str], tokenize, seq_len: int, num_windows: int, seed: int = 0) -> np.ndarray:
    """``num_windows`` non-overlapping windows of ``seq_len`` tokens, drawn at random (seeded)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    windows = []
    for text in texts:
        ids = tokenize(text)
        windows.extend(ids[k : k + seq_len] for k in range(0, len(ids) - seq_len + 1, seq_len))
    if not windows:
        raise ValueError(f"no document has {seq_len} tokens; lower --seq-len")
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(len(windows))[:num_windows]
    return np.array([windows[k] for k in chosen], dtype=np.int64)


def context_function(mode: str, buckets: int = 0) -> Callable[[np.ndarray, np.ndarray, int], Hashable]:
    """The key of a conditional text: ``full`` or ``window:w``, hashed, then ``mod buckets`` if > 0."""
    if mode == "full":
        reduce = full_context
    elif mode.startswith("window:") and mode[7:].isdigit() and int(mode[7:]) >= 1:
        w = int(mode[7:])

        def reduce(tokens, visible, i):
            lo, hi = max(0, i - w), min(len(tokens), i + w + 1)
            idx = lo + np.flatnonzero(visible[lo:hi])
            return tuple(zip((idx - i).tolist(), tokens[idx].tolist()))

    else:
        raise ValueError(f"context must be 'full' or 'window:W' with an integer W >= 1, got {mode!r}")
    if buckets < 0:
        raise ValueError(f"buckets must be >= 0 (0 = no bucketing), got {buckets}")

    def key(tokens, visible, i):
        h = hash(reduce(tokens, visible, i))
        return h % buckets if buckets else h

    return key


def sampled_cooccurrence(
    windows: np.ndarray,
    objective: str,
    context: str = "full",
    buckets: int = 0,
    plans_per_window: int = 1,
    seed: int = 0,
    **params,
) -> Cooccurrence:
    """The co-occurrence matrix of ``windows`` with plans drawn by ``make_plan`` (seeded).

    Every (window, plan) draw has the same mass, split evenly over its targets."""
    key = context_function(context, buckets)
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = windows.shape
    mass = 1.0 / (batch * plans_per_window)

    # with the full context, the cache in pairs_from_plan does the work once per group rank
    def pairs():
        for _ in range(plans_per_window):
            plan = make_plan(objective, [seq_len] * batch, seq_len, generator=generator, **params)
            group_ids, is_target = plan.group_ids.numpy(), plan.is_target.numpy()
            for b in range(batch):
                found = pairs_from_plan(windows[b], group_ids[b], is_target[b], _cached(key, context))
                for ctx, tgt in found:
                    yield ctx, tgt, mass / len(found)

    return cooccurrence_matrix(pairs())


def _cached(key, context: str):
    """A context function; for ``full`` contexts one key per distinct visible set of a sequence."""
    if context != "full":
        return key
    memo: dict = {}

    def cached(tokens, visible, i):
        sig = visible.tobytes()
        if sig not in memo:
            memo[sig] = key(tokens, visible, i)
        return memo[sig]

    return cached
