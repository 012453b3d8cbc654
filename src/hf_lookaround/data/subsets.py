"""Cutting a split down to N examples: always a seeded random sample, never the first N.

The first N rows of a file sorted by label hold one label (a probe then reports a test score that means nothing),
and the first N documents of a corpus are one source. Every command that cuts a split (``probe``, ``glue``,
``pretrain``'s ``--max_*_samples``, ``perplexity --max_documents``, ``vision``, the demo) cuts it here, with its
``--seed``, and is warned when the sample leaves a class out.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)


def sample_indices(total: int, n: int, seed: int, keep_order: bool = False) -> list[int]:
    """``n`` of ``range(total)`` drawn with ``seed``: the first ``n`` of the permutation ``datasets``'
    ``shuffle(seed=seed)`` makes. ``keep_order``: returned in file order (predictions written row by row, and
    contiguous reads)."""
    chosen = np.random.default_rng(seed).permutation(total)[:n]
    return sorted(chosen.tolist()) if keep_order else chosen.tolist()


def _take(rows, indices: list[int]):
    if isinstance(rows, list):
        return [rows[i] for i in indices]
    if hasattr(rows, "subset"):  # data.images.ImageSource
        return rows.subset(indices)
    return rows.select(indices)  # datasets.Dataset


def _labels_of(rows, label_column):
    if hasattr(rows, "subset"):
        return None if rows.labels is None else rows.labels.tolist()
    if label_column is not None and label_column in getattr(rows, "column_names", ()):
        return list(rows[label_column])
    return None


def seeded_sample(rows, n: int | None, seed: int, *, what: str, flag: str, label_column: str | None = None,
                  keep_order: bool = False):
    """``n`` rows of ``rows`` (a ``datasets.Dataset``, a list, or an ``ImageSource``) drawn at random with
    ``seed``; all of them, untouched, when ``n`` is None or not smaller than ``len(rows)``.

    ``what`` names the split in the log ("test examples"), ``flag`` the option that asked for the cut. With
    ``label_column`` (or an ``ImageSource``'s labels), a warning names the classes of the split the sample holds
    no example of."""
    if n is not None and n < 1:  # a negative n would slice from the end: 19 of 20 for -1
        raise ValueError(f"{flag} {n}: must be a positive number of {what} (leave it out to use them all)")
    total = len(rows)
    if n is None or n >= total:
        return rows
    indices = sample_indices(total, n, seed, keep_order)
    logger.info("using %d of %d %s (%s), drawn at random with seed %d", n, total, what, flag, seed)
    cut = _take(rows, indices)
    labels = _labels_of(rows, label_column)
    if labels is not None:
        kept = set(_labels_of(cut, label_column))
        missing = sorted({v for v in labels if v not in kept}, key=str)
        if missing:
            logger.warning("%s: the %d of %d kept by %s hold no example of the class(es) %s; its scores leave them "
                           "out (a larger %s keeps more)", what, n, total, flag, missing, flag)
    return cut
