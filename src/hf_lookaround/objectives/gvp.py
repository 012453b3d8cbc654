"""``gvp``: generative visual pretraining's grouped permuted prediction (paper (b) §3.2).

A random order over positions is cut into groups G0..GK; G0 is the condition and each later group is predicted
from all earlier ones. Works on any sequence: tokens or image patches.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PATCH_KEYS, PlanCollator, padded_width
from ..plans import Plan, check_lengths, inside_positions, numpy_rng, random_subsets, shuffle_prefixes
from .base import ANY_ORDER, Objective, ObjectiveParams, flag

SEGMENTATIONS = ("fixed", "random", "mixed")


def _check_gvp(num_groups: int, segmentation: str) -> None:
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {segmentation!r}")
    if num_groups < 1:
        raise ValueError(f"num_groups (K) must be >= 1, got {num_groups}")


def _too_short(n: int, k: int) -> ValueError:
    return ValueError(f"GVP with K={k} needs sequences of at least K+1={k + 1} positions, got {n}")


def _boundary_marks(n: np.ndarray, k: int, segmentation: str, generator, rng) -> np.ndarray:
    """(B, max n) int32: 1 at the steps ``n0 < ... < n(K-1)`` of each row (``nK = n`` is implied), else 0.
    Every ``n[b]`` must be >= K+1."""
    batch, width = n.size, int(n.max())
    marks = np.zeros((batch, width), dtype=np.int32)
    rows = np.arange(batch)[:, None]
    if segmentation == "fixed":
        # round((i + 1) n / (K + 1)) in float64, half to even: what Python's round gives
        bounds = np.round(np.arange(1, k + 1) * n[:, None] / float(k + 1)).astype(np.int64)
        marks[rows, bounds] = 1
        return marks
    if segmentation == "random":
        last, inner = n, k  # n0..n(K-1): K distinct values in 1..n-1
    else:
        p = 0.5 + 0.1 * torch.randn(batch, generator=generator).double().numpy()
        last = np.clip(np.round(p * n), k, n - 1).astype(np.int64)  # n(K-1); then K-1 values in 1..n(K-1)-1
        marks[rows[:, 0], last] = 1
        inner = k - 1
    if inner:
        marks[rows, _distinct_values(rng, last - 1, inner)] = 1
    return marks


def _distinct_values(rng: np.random.Generator, limit: np.ndarray, count: int) -> np.ndarray:
    """(B, count): ``count`` distinct values drawn uniformly from ``1 .. limit[b]`` for each row (a uniform
    random subset); ``limit[b] >= count``."""
    values = np.empty((limit.size, count), dtype=np.int64)
    # Few values among many (GVP's K boundaries in a long sequence): draw with replacement and draw again
    # the rows that repeat a value. Exact: an accepted row is a draw conditioned on distinct values, and
    # each row is accepted with probability >= about 0.6 when count (count - 1) <= limit.
    sparse = np.flatnonzero(count * (count - 1) <= limit)
    while sparse.size:
        draw = np.sort(rng.integers(1, limit[sparse, None], size=(sparse.size, count), endpoint=True), axis=1)
        repeats = (draw[:, 1:] == draw[:, :-1]).any(1)
        values[sparse[~repeats]] = draw[~repeats]
        sparse = sparse[repeats]
    # otherwise: count flags shuffled among limit[b]
    dense = np.flatnonzero(count * (count - 1) > limit)
    if dense.size:
        flags = random_subsets(rng, np.full(dense.size, count), limit[dense])
        within = np.arange(int(limit[dense].max()))[None, :] < limit[dense, None]
        chosen = np.zeros(within.shape, dtype=bool)
        chosen[within] = flags
        values[dense] = (np.nonzero(chosen)[1] + 1).reshape(dense.size, count)
    return values


def boundaries(n: int, num_groups: int = 20, segmentation: str = "mixed", generator=None) -> list[int]:
    """Group boundaries ``n0 < n1 < ... < nK = n`` of GVP (paper (b) §3.2, App. B).

    - fixed:  ``n_i = (i + 1) n / (K + 1)``;
    - random: ``n0..n(K-1)`` distinct, uniform in ``[1, n-1]``;
    - mixed:  ``n(K-1) = round(p n)``, ``p ~ N(0.5, 0.1)``; ``n0..n(K-2)`` distinct, uniform in
      ``[1, n(K-1) - 1]``. ``n(K-1)`` is clipped to ``[K, n-1]`` so the draw is always possible.
    """
    k = num_groups
    _check_gvp(k, segmentation)
    if n < k + 1:
        raise _too_short(n, k)
    marks = _boundary_marks(np.array([n]), k, segmentation, generator, numpy_rng(generator))
    return np.flatnonzero(marks[0]).tolist() + [n]


def plan(
    lengths,
    seq_len: int,
    num_groups: int = 20,
    segmentation: str = "mixed",
    num_condition_tokens: int = 0,
    generator=None,
) -> Plan:
    """Generative visual pretraining (paper (b)): a random order ``z`` over positions, split into
    groups ``G0..GK``; ``g[z_t]`` is the index of the group holding ``t``. ``G0`` is the condition
    (not a target). Works on any sequence: tokens or image patches."""
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    k, c = num_groups, num_condition_tokens
    _check_gvp(k, segmentation)
    n = lengths - c
    short = (n > 0) & (n < k + 1)
    if short.any():
        raise _too_short(int(n[short][0]), k)
    inside = inside_positions(lengths, seq_len, c)
    group_ids = np.zeros(inside.shape, dtype=np.int64)
    drawn = n > 0
    if drawn.any():
        rng = numpy_rng(generator)
        n = n[drawn].numpy()
        # the group of step t of the order z: the number of boundaries n0..n(K-1) at or below t
        group_of_step = np.cumsum(_boundary_marks(n, k, segmentation, generator, rng), axis=1)
        # z uniformly random: the groups of the steps, shuffled over the row's positions c..length-1
        group_ids[inside] = shuffle_prefixes(rng, group_of_step, n) + (1 if c else 0)
    return Plan(torch.from_numpy(group_ids), torch.from_numpy(inside & (group_ids >= (2 if c else 1))))  # G0: condition


@dataclass
class Params(ObjectiveParams):
    num_groups: int = flag(20, help="gvp: K")
    segmentation: str = flag("mixed", help="gvp: fixed, random or mixed")

    def __post_init__(self):
        try:
            _check_gvp(int(self.num_groups), self.segmentation)
        except ValueError as error:
            raise ValueError(f"--{error}") from None

    def plan_params(self) -> dict:
        return {"num_groups": int(self.num_groups), "segmentation": self.segmentation}

    def check_block_size(self, block_size: int) -> None:
        if self.num_groups + 1 > block_size - 1:
            raise ValueError(f"--num_groups {self.num_groups} needs blocks of at least K+1={self.num_groups + 1} "
                             f"tokens after BOS (--block_size {block_size}): lower --num_groups or raise --block_size")


@dataclass
class GVPCollator(PlanCollator):
    """Generative visual pretraining's grouped permutation (paper (b) §3.2): a random order, split
    into ``num_groups`` (K) groups by a ``fixed``, ``random`` or ``mixed`` segmentation.

    Works on token sequences and on patch features: features may hold ``pixel_values`` or
    ``inputs_embeds`` of shape (T, D) instead of ``input_ids`` (or the batch may be a (B, T, D)
    tensor). For patches the output holds the padded features under the same key,
    ``attention_mask``, ``group_ids``, ``target_positions`` and ``target_mask`` (B, T) (the loss
    positions; the regression target is the input itself, so there are no ``labels``).
    """

    num_groups: int = 20
    segmentation: str = "mixed"
    objective = "gvp"
    plan_function = staticmethod(plan)

    def __post_init__(self):
        if self.segmentation not in SEGMENTATIONS:
            raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {self.segmentation!r}")
        if int(self.num_groups) < 1:
            raise ValueError(f"num_groups must be >= 1, got {self.num_groups}")

    def plan_params(self):
        return {"num_groups": int(self.num_groups), "segmentation": self.segmentation}

    def __call__(self, features):
        if isinstance(features, torch.Tensor):
            if features.dim() != 3:
                raise ValueError(f"a tensor batch of patches must be (B, T, D), got shape {tuple(features.shape)}")
            features = [{"pixel_values": x} for x in features]
        if features is None or len(features) == 0:
            raise ValueError("cannot collate an empty batch")
        first = features[0]
        key = next((k for k in PATCH_KEYS if isinstance(first, Mapping) and k in first), None)
        if key is None or (isinstance(first, Mapping) and "input_ids" in first):
            return super().__call__(features)
        return self._call_patches(features, key)

    def _call_patches(self, features, key: str):
        rows = [torch.as_tensor(f[key]) for f in features]
        if any(r.dim() != 2 for r in rows):
            raise ValueError(f"each example's {key} must be (T, D) patch features")
        width = padded_width(max(r.shape[0] for r in rows), self.pad_to_multiple_of)
        values = rows[0].new_zeros((len(rows), width, rows[0].shape[1]))
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, (r, f) in enumerate(zip(rows, features)):
            values[b, : r.shape[0]] = r
            mask = f.get("attention_mask")
            attention_mask[b, : r.shape[0]] = 1 if mask is None else torch.as_tensor(mask, dtype=torch.long)
        lengths = attention_mask.sum(-1)
        # hash a few feature channels only: enough to tell batches apart, cheap on large images
        generator = self._batch_generator(values[..., :4].float(), lengths)
        c = int(self.num_condition_tokens or 0)
        plan_ = plan(lengths, width, generator=generator, num_condition_tokens=c, **self.plan_params())
        return {
            key: values,
            "attention_mask": attention_mask,
            "group_ids": plan_.group_ids,
            "target_positions": plan_.target_positions(self.pad_targets_to),
            "target_mask": plan_.is_target,
        }


OBJECTIVE = Objective(
    name="gvp",
    family=ANY_ORDER,
    title="grouped permuted prediction (GVP)",
    card_text="a random order over positions is cut into groups G0..GK; G0 is the condition and each later group "
              "is predicted from all earlier ones (paper (b) §3.2).",
    Params=Params,
    plan=plan,
    collator=GVPCollator,
    presets={"gvp-k8": ("grouped permutation, K=8, mixed", {"num_groups": 8, "segmentation": "mixed"})},
    image_defaults={"num_groups": 20, "segmentation": "mixed"},
    drops_unread_content=True,
)
