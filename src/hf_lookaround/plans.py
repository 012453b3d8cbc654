"""Plans: every pretraining objective as a group rank per token, and the drawing machinery they share.

A plan gives each position ``i`` of a sequence (in the original token order) an integer group
rank ``g[i]`` and says which positions carry a loss. The two-stream model turns ranks into
attention (see ``masking_lookaround.may_attend``):

- the content stream at ``i`` sees ``j`` iff ``g[j] <= g[i]``;
- the query stream at ``i`` sees content ``j`` iff ``g[j] < g[i]``.

Each objective's plan function lives in its module of :mod:`hf_lookaround.objectives`; this module holds what
they share (the :class:`Plan`, length checks, the batched random draws). Any objective's plan is drawn by name
with :func:`hf_lookaround.objectives.make_plan` (collators call their objective's plan function directly): the
collators, evaluators and the theory module all draw the same functions, so an objective means the same thing
everywhere. This module imports nothing of the objectives: they build on it.

Every plan function takes the valid ``lengths`` of a batch (padding is on the right), the padded
length ``seq_len`` and a ``torch.Generator``, and returns a :class:`Plan`. A prefix of
``num_condition_tokens`` (BOS/CLS or other conditioning) always has rank 0, is never a target,
and the objective's own ranks start at 1 after it. A plan is drawn for the whole batch at once (no
loop over rows); ``tests/test_plans.py`` checks it against the former per-row drawing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .models.lookaround.masking_lookaround import infilling_ranks

__all__ = [
    "Plan",
    "infilling_ranks",
    "expected_masked_count",
    "host_positions_of",
    "target_positions_from_mask",
]



@dataclass
class Plan:
    """Group ranks ``(B, T)`` (long) and loss positions ``(B, T)`` (bool) for a batch; ``loss_weights`` ``(B, T)``
    (float), a weight per target in the loss where the objective gives one (the diffusion objectives: the noise
    schedule's weight, ``objectives/mdlm.py``), None where every target weighs 1."""

    group_ids: torch.Tensor
    is_target: torch.Tensor
    loss_weights: torch.Tensor | None = None

    def target_positions(self, pad_to: int | None = None) -> torch.Tensor:
        """Indices of the targets of each row, ``(B, M)``, padded with -1 (``M`` = max count or ``pad_to``)."""
        return target_positions_from_mask(self.is_target, pad_to)


def target_positions_from_mask(is_target: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    """(B, T) bool -> (B, M) target indices in order, padded with -1; ``M`` = the largest count or ``pad_to``."""
    positions = host_positions_of(is_target.cpu().numpy())
    if pad_to is not None:
        if pad_to < positions.shape[1]:
            raise ValueError(f"pad_to={pad_to} is smaller than the largest target count {positions.shape[1]} in the batch")
        positions = np.pad(positions, ((0, 0), (0, pad_to - positions.shape[1])), constant_values=-1)
    return torch.from_numpy(positions).to(is_target.device)


def host_positions_of(mask: np.ndarray, width: int | None = None) -> np.ndarray:
    """The model's ``positions_of`` on the host, in numpy (a collator's batch is built there, and numpy's few calls
    cost a fraction of torch's scatter on the CPU): (B, T) bool -> (B, M) int64 indices of the True entries of each
    row, in order, padded with -1. ``M`` is the largest count, or ``width`` (entries past it are left out)."""
    counts = mask.sum(1)
    if width is None:
        width = int(counts.max()) if mask.size else 0
    width = min(width, mask.shape[1])
    positions = np.full((mask.shape[0], width), -1, dtype=np.int64)
    batch, length = mask.shape
    flat = np.flatnonzero(mask)  # several times faster than np.nonzero's (rows, columns) on a 2-D mask
    if counts.size and (counts == counts[0]).all() and counts[0] <= width:  # every row holds as many: a reshape
        positions[:, : counts[0]] = flat.reshape(batch, counts[0]) - length * np.arange(batch)[:, None]
        return positions
    rows = np.repeat(np.arange(batch), counts)
    slot = np.arange(flat.size) - (np.cumsum(counts) - counts)[rows]  # rank of each entry in its row
    columns = flat - length * rows
    if width < counts.max():
        fits = slot < width
        rows, slot, columns = rows[fits], slot[fits], columns[fits]
    positions.reshape(-1)[rows * width + slot] = columns
    return positions


def check_lengths(lengths, seq_len: int, num_condition_tokens: int) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if lengths.numel() == 0:
        raise ValueError("a plan needs at least one sequence; got an empty batch")
    if (lengths < 0).any() or (lengths > seq_len).any():
        raise ValueError(f"sequence lengths must lie in [0, {seq_len}], got {lengths.tolist()}")
    if num_condition_tokens < 0:
        raise ValueError(f"num_condition_tokens must be >= 0, got {num_condition_tokens}")
    return lengths


def inside_positions(lengths: torch.Tensor, seq_len: int, num_condition_tokens: int) -> np.ndarray:
    """(B, T) bool: the positions a plan ranks, ``num_condition_tokens <= i < length``."""
    position = np.arange(seq_len)
    return (position >= num_condition_tokens) & (position < lengths.numpy()[:, None])


# Every plan is drawn for the whole batch at once: one call per random quantity, no loop over rows. The (B, T)
# arithmetic is numpy's: torch's CPU kernels go multi-threaded on large batches, and on a busy host (compile
# workers, data loaders) a collator in the main process then waits milliseconds for its threads.
# A random subset or order is a shuffle of labels: e.g. `count` ones and `n - count` zeros, shuffled,
# mark a uniform random subset of `count` among `n`. torch has no batched shuffle and its CPU sort is
# slow, so the shuffles are numpy's ``Generator.permuted`` (a Fisher-Yates shuffle of every row, in C),
# seeded from the torch generator: the same torch generator state gives the same plan.
def numpy_rng(generator) -> np.random.Generator:
    seed = torch.randint(0, 2**63 - 1, (2,), generator=generator)
    return np.random.Generator(np.random.PCG64(seed.tolist()))


def shuffle_prefixes(rng: np.random.Generator, labels: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The first ``lengths[b]`` labels of every row (B, W), each row in a uniformly random order; the rows
    concatenated (1-D, ``lengths.sum()`` entries). Labels must be >= 0."""
    if (lengths == labels.shape[1]).all():
        return rng.permuted(labels, axis=1, out=labels).reshape(-1)
    # the entries past a row's length are set apart with -1 and shuffled along: the others keep
    # a uniformly random relative order, and dropping the -1 entries gives it
    labels[np.arange(labels.shape[1]) >= lengths[:, None]] = -1
    rng.permuted(labels, axis=1, out=labels)
    return labels[labels >= 0]


def random_subsets(rng: np.random.Generator, counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """For each row, a uniform random subset of ``counts[b]`` among ``sizes[b]`` items, as 0/1 flags
    (1-D, the rows concatenated, ``sizes.sum()`` entries)."""
    width = int(sizes.max()) if sizes.size else 0
    flags = (np.arange(width) < counts[:, None]).astype(np.int64)  # numpy shuffles 8-byte items fastest
    return shuffle_prefixes(rng, flags, sizes)


def expected_masked_count(ratio: float, n: int) -> int:
    """The number of targets that :func:`masked_plan` draws for ``n`` maskable positions."""
    return min(n, max(1, round(ratio * n))) if n else 0
