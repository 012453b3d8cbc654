"""Plans: every pretraining objective as a group rank per token.

A plan gives each position ``i`` of a sequence (in the original token order) an integer group
rank ``g[i]`` and says which positions carry a loss. The two-stream model turns ranks into
attention (see ``masks.may_attend``):

- the content stream at ``i`` sees ``j`` iff ``g[j] <= g[i]``;
- the query stream at ``i`` sees content ``j`` iff ``g[j] < g[i]``.

Each objective is defined once, here. Collators, evaluators and the theory module all call
these functions, so an objective means the same thing everywhere.

Every function takes the valid ``lengths`` of a batch (padding is on the right), the padded
length ``seq_len`` and a ``torch.Generator``, and returns a :class:`Plan`. A prefix of
``num_condition_tokens`` (BOS/CLS or other conditioning) always has rank 0, is never a target,
and the objective's own ranks start at 1 after it. A plan is drawn for the whole batch at once (no
loop over rows); ``tests/test_plans_vectorised.py`` checks it against the former per-row drawing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import objectives

__all__ = [
    "Plan",
    "PLAN_NAMES",
    "autoregressive_plan",
    "semi_autoregressive_plan",
    "masked_plan",
    "variable_masked_plan",
    "gvp_plan",
    "gvp_boundaries",
    "mixture_plan",
    "check_mixture",
    "draw_mixture_components",
    "make_plan",
    "infilling_ranks",
]

PLAN_NAMES = objectives.PLAN_NAMES  # the objectives table (objectives.py) names every plan
SEGMENTATIONS = ("fixed", "random", "mixed")


@dataclass
class Plan:
    """Group ranks ``(B, T)`` (long) and loss positions ``(B, T)`` (bool) for a batch."""

    group_ids: torch.Tensor
    is_target: torch.Tensor

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


def _check_lengths(lengths, seq_len: int, num_condition_tokens: int) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if lengths.numel() == 0:
        raise ValueError("a plan needs at least one sequence; got an empty batch")
    if (lengths < 0).any() or (lengths > seq_len).any():
        raise ValueError(f"sequence lengths must lie in [0, {seq_len}], got {lengths.tolist()}")
    if num_condition_tokens < 0:
        raise ValueError(f"num_condition_tokens must be >= 0, got {num_condition_tokens}")
    return lengths


def _inside(lengths: torch.Tensor, seq_len: int, num_condition_tokens: int) -> np.ndarray:
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
def _numpy_rng(generator) -> np.random.Generator:
    seed = torch.randint(0, 2**63 - 1, (2,), generator=generator)
    return np.random.Generator(np.random.PCG64(seed.tolist()))


def _shuffle_prefixes(rng: np.random.Generator, labels: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The first ``lengths[b]`` labels of every row (B, W), each row in a uniformly random order; the rows
    concatenated (1-D, ``lengths.sum()`` entries). Labels must be >= 0."""
    if (lengths == labels.shape[1]).all():
        return rng.permuted(labels, axis=1, out=labels).reshape(-1)
    # the entries past a row's length are set apart with -1 and shuffled along: the others keep
    # a uniformly random relative order, and dropping the -1 entries gives it
    labels[np.arange(labels.shape[1]) >= lengths[:, None]] = -1
    rng.permuted(labels, axis=1, out=labels)
    return labels[labels >= 0]


def _random_subsets(rng: np.random.Generator, counts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """For each row, a uniform random subset of ``counts[b]`` among ``sizes[b]`` items, as 0/1 flags
    (1-D, the rows concatenated, ``sizes.sum()`` entries)."""
    width = int(sizes.max()) if sizes.size else 0
    flags = (np.arange(width) < counts[:, None]).astype(np.int64)  # numpy shuffles 8-byte items fastest
    return _shuffle_prefixes(rng, flags, sizes)


def autoregressive_plan(lengths, seq_len: int, num_condition_tokens: int = 0, generator=None) -> Plan:
    """GPT: ``g[i] = i``; every position with rank >= 1 is a target (so ``i >= 1`` with no prefix)."""
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    c = num_condition_tokens
    inside = _inside(lengths, seq_len, c)
    ranks = np.arange(seq_len) - c + (1 if c else 0)
    return Plan(torch.from_numpy(np.where(inside, ranks, 0)), torch.from_numpy(inside & (ranks >= 1)))


def _group_sizes(t) -> list[int]:
    sizes = [t] if isinstance(t, int) else list(t)
    if not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"group size t must be a positive int or a non-empty list of them, got {t!r}")
    return [int(s) for s in sizes]


def semi_autoregressive_plan(lengths, seq_len: int, t=2, num_condition_tokens: int = 0, generator=None) -> Plan:
    """Diversity-enhanced AR (paper (a) Eq. 3 and 6).

    The first group has size ``s1 ~ U{1..t}`` and rank 0; then consecutive groups of ``t`` tokens:
    ``g[i] = 1 + (i - s1) // t``. Targets have rank >= 1. ``t`` may be a list: a group size is
    drawn uniformly from it for each sequence (a mixture of t values). ``t = 1`` is AR.
    """
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    sizes = _group_sizes(t)
    batch, c = lengths.numel(), num_condition_tokens
    if len(sizes) == 1:
        size = torch.full((batch,), sizes[0], dtype=torch.long)
    else:
        size = torch.tensor(sizes)[torch.randint(len(sizes), (batch,), generator=generator)]
    # s1 = 1 + (r mod t) with r uniform on [0, lcm of the sizes): exactly uniform on 1..t for every t
    # of the mixture. Drawn for non-empty rows only, in row order (as the per-row loop drew it).
    drawn = lengths > c
    s1 = torch.ones(batch, dtype=torch.long)
    if drawn.any():
        r = torch.randint(math.lcm(*sizes), (int(drawn.sum()),), generator=generator)
        s1[drawn] = 1 + r % size[drawn]
    i = np.arange(seq_len) - c
    s1, size = s1.numpy()[:, None], size.numpy()[:, None]
    ranks = np.where(i < s1, 0, 1 + (i - s1) // size) + (1 if c else 0)
    inside = _inside(lengths, seq_len, c)
    return Plan(torch.from_numpy(np.where(inside, ranks, 0)), torch.from_numpy(inside & (ranks >= 1)))


def _check_ratio(name: str, value: float) -> None:
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")


def masked_plan(
    lengths, seq_len: int, mask_ratio: float = 0.15, num_condition_tokens: int = 0, maskable=None, generator=None
) -> Plan:
    """BERT/MAE with a fixed ratio: ``round(ratio * n)`` (at least 1) positions drawn without
    replacement get rank 1 and are the targets; the rest have rank 0."""
    _check_ratio("mask_ratio", mask_ratio)

    def ratios(batch: int) -> torch.Tensor:
        return torch.full((batch,), float(mask_ratio), dtype=torch.float64)

    return _masked(lengths, seq_len, ratios, num_condition_tokens, maskable, generator)


def variable_masked_plan(
    lengths,
    seq_len: int,
    mask_ratio_range: tuple[float, float] = (0.15, 0.3),
    num_condition_tokens: int = 0,
    maskable=None,
    generator=None,
) -> Plan:
    """Variable-length masking (paper (a) Eq. 5): the ratio is drawn per sequence from ``U[a, b]``."""
    a, b = check_mask_ratio_range(mask_ratio_range)

    def ratios(batch: int) -> torch.Tensor:
        return a + (b - a) * torch.rand(batch, generator=generator).double()

    return _masked(lengths, seq_len, ratios, num_condition_tokens, maskable, generator)


def check_mask_ratio_range(mask_ratio_range) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in mask_ratio_range)
    except (TypeError, ValueError):
        raise ValueError(f"mask_ratio_range must be two numbers (a, b), got {mask_ratio_range!r}") from None
    if not (0.0 < a <= b < 1.0):
        raise ValueError(f"mask_ratio_range must satisfy 0 < a <= b < 1, got ({a}, {b})")
    return a, b


def _masked(lengths, seq_len, draw_ratios, num_condition_tokens, maskable, generator) -> Plan:
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    batch, c = lengths.numel(), num_condition_tokens
    inside = _inside(lengths, seq_len, c)
    candidates = inside
    if maskable is not None:
        maskable = torch.as_tensor(maskable, dtype=torch.bool)
        if maskable.shape != inside.shape:
            raise ValueError(f"maskable must have shape {tuple(inside.shape)}, got {tuple(maskable.shape)}")
        candidates = inside & maskable.numpy()
    ratio = draw_ratios(batch).numpy()
    available = candidates.sum(1)
    # expected_masked_count, row by row: round half to even (as Python's round) in float64
    count = np.minimum(available, np.maximum(np.round(ratio * available), 1).astype(np.int64))
    chosen = np.zeros(candidates.shape, dtype=bool)
    if available.max() > 0:
        chosen[candidates] = _random_subsets(_numpy_rng(generator), count, available)
    # a row with no candidate keeps rank 0 everywhere (nothing to predict, nothing to rank)
    group_ids = (inside & (available > 0)[:, None]) * (1 if c else 0) + chosen
    return Plan(torch.from_numpy(group_ids.astype(np.int64)), torch.from_numpy(chosen))


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
        flags = _random_subsets(rng, np.full(dense.size, count), limit[dense])
        within = np.arange(int(limit[dense].max()))[None, :] < limit[dense, None]
        chosen = np.zeros(within.shape, dtype=bool)
        chosen[within] = flags
        values[dense] = (np.nonzero(chosen)[1] + 1).reshape(dense.size, count)
    return values


def gvp_boundaries(n: int, num_groups: int = 20, segmentation: str = "mixed", generator=None) -> list[int]:
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
    marks = _boundary_marks(np.array([n]), k, segmentation, generator, _numpy_rng(generator))
    return np.flatnonzero(marks[0]).tolist() + [n]


def gvp_plan(
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
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    k, c = num_groups, num_condition_tokens
    _check_gvp(k, segmentation)
    n = lengths - c
    short = (n > 0) & (n < k + 1)
    if short.any():
        raise _too_short(int(n[short][0]), k)
    inside = _inside(lengths, seq_len, c)
    group_ids = np.zeros(inside.shape, dtype=np.int64)
    drawn = n > 0
    if drawn.any():
        rng = _numpy_rng(generator)
        n = n[drawn].numpy()
        # the group of step t of the order z: the number of boundaries n0..n(K-1) at or below t
        group_of_step = np.cumsum(_boundary_marks(n, k, segmentation, generator, rng), axis=1)
        # z uniformly random: the groups of the steps, shuffled over the row's positions c..length-1
        group_ids[inside] = _shuffle_prefixes(rng, group_of_step, n) + (1 if c else 0)
    return Plan(torch.from_numpy(group_ids), torch.from_numpy(inside & (group_ids >= (2 if c else 1))))  # G0: condition


def check_mixture(mixture=None, components=None) -> tuple[dict[str, float], dict[str, dict]]:
    """A mixture's normalised weights ``{name: weight}`` and its components' plan parameters ``{name: params}``
    (both in the order of the objectives table), or a ValueError that says what to fix.

    ``mixture``: ``{name: weight}`` (weights >= 0, any positive total; default ``objectives.DEFAULT_MIXTURE``);
    ``components``: ``{name: plan params}`` for some of them (the others use their plan's defaults)."""
    weights = dict(objectives.DEFAULT_MIXTURE if mixture is None else mixture)
    if not weights:
        raise ValueError("a mixture needs at least one component, e.g. mixture={'dar': 0.5, 'vmlm': 0.5}")
    choices = tuple(n for n, o in objectives.OBJECTIVES.items() if o.family != objectives.MIXTURE)
    for name, weight in weights.items():
        if name not in objectives.OBJECTIVES:
            raise ValueError(f"mixture: unknown objective {name!r}; components are objectives of {choices}")
        if objectives.OBJECTIVES[name].family == objectives.MIXTURE:
            raise ValueError(f"mixture: a component cannot itself be a mixture ({name!r}); list its components instead")
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise ValueError(f"mixture: the weight of {name!r} must be a number, got {weight!r}") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"mixture: the weight of {name!r} must be a finite number >= 0, got {weight}")
        weights[name] = weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"mixture: the weights {weights} sum to 0; give at least one component a positive weight")
    components = dict(components or {})
    extra = sorted(set(components) - set(weights))
    if extra:
        raise ValueError(f"mixture: parameters are given for {extra}, which are not components of {sorted(weights)}")
    checked = {}
    for name in objectives.OBJECTIVES:
        if name not in weights:
            continue
        params = dict(components.get(name) or {})
        try:  # the component's own plan checks its parameters (on an empty batch: nothing is drawn)
            make_plan(name, [0], 0, **params)
        except TypeError as error:
            raise ValueError(f"mixture: component {name!r} takes no such parameter ({error}); it takes "
                             f"{sorted(objectives.get(name).defaults)}") from None
        except ValueError as error:
            raise ValueError(f"mixture: component {name!r}: {error}") from None
        checked[name] = params
    return {name: weights[name] / total for name in checked}, checked


def draw_mixture_components(batch: int, weights: dict[str, float], generator=None) -> torch.Tensor:
    """(B,) long: the index (into ``weights``' order) of the component drawn for each row."""
    probs = torch.tensor(list(weights.values()), dtype=torch.float64)
    if len(weights) == 1:
        return torch.zeros(batch, dtype=torch.long)
    return torch.multinomial(probs, batch, replacement=True, generator=generator)


def mixture_plan(
    lengths,
    seq_len: int,
    mixture: dict | None = None,
    components: dict | None = None,
    num_condition_tokens: int = 0,
    maskable=None,
    generator=None,
    checked: bool = False,
) -> Plan:
    """A mixture of objectives (UL2's mixture of denoisers): each row gets the plan of one component, drawn from the
    normalised weights ``mixture`` (``{name: weight}``); ``components`` holds each component's plan parameters.
    ``checked``: they are what :func:`check_mixture` returned (a collator checks them once, not every batch).

    Vectorised per component: the rows are grouped by the component drawn, each component's plan is drawn once for
    its rows (with the same generator, components in table order), and the plans are scattered back. ``maskable``
    goes to the components whose plan takes it (the masked ones)."""
    weights, params = (mixture, components) if checked else check_mixture(mixture, components)
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    batch = lengths.numel()
    drawn = draw_mixture_components(batch, weights, generator).numpy()
    # rows are gathered and scattered in numpy: torch's index kernels run multi-threaded on the host and take
    # milliseconds when its cores are busy (compile workers, data loaders), numpy's microseconds
    group_ids = np.zeros((batch, seq_len), dtype=np.int64)
    is_target = np.zeros((batch, seq_len), dtype=bool)
    if maskable is not None:
        maskable = torch.as_tensor(maskable, dtype=torch.bool).numpy()
    for index, name in enumerate(weights):
        rows = np.flatnonzero(drawn == index)
        if rows.size == 0:
            continue
        extra = dict(params[name])
        if maskable is not None and objectives.get(name).takes_maskable:
            extra["maskable"] = torch.from_numpy(maskable[rows])
        plan = make_plan(name, lengths.numpy()[rows], seq_len, generator=generator,
                         num_condition_tokens=num_condition_tokens, **extra)
        group_ids[rows] = plan.group_ids.numpy()
        is_target[rows] = plan.is_target.numpy()
    group_ids, is_target = torch.from_numpy(group_ids), torch.from_numpy(is_target)
    return Plan(group_ids, is_target)


def mixture_row_components(lengths, seq_len: int, mixture=None, components=None, generator=None) -> list[str]:
    """The component each row of :func:`mixture_plan` with this generator state gets (its first draw)."""
    weights, _ = check_mixture(mixture, components)
    names = list(weights)
    return [names[i] for i in draw_mixture_components(len(torch.as_tensor(lengths).flatten()), weights, generator)]


def make_plan(objective: str, lengths, seq_len: int, generator=None, **params) -> Plan:
    """Draw the plan of ``objective`` (one of :data:`PLAN_NAMES`) with its parameters."""
    return globals()[objectives.get(objective).plan_function](lengths, seq_len, generator=generator, **params)


def expected_masked_count(ratio: float, n: int) -> int:
    """The number of targets that :func:`masked_plan` draws for ``n`` maskable positions."""
    return min(n, max(1, round(ratio * n))) if n else 0


def infilling_ranks(hidden: torch.Tensor, is_condition: torch.Tensor) -> torch.Tensor:
    """Ranks ``(B, T)`` of one step of infilling or of the masked-prefix protocol: the plan masked and GVP
    pretraining trained, for a set of visible tokens and the hidden positions to predict from them.

    As in :func:`masked_plan` / :func:`gvp_plan` with ``num_condition_tokens``: the condition token (BOS, where
    ``is_condition``) has rank 0 and sees only itself; the visible tokens are the first group (rank 1, or 0 in a
    row without a condition token), bidirectional among themselves; the hidden positions are the next group
    (rank 2, or 1), whose query rows read the condition and the visible tokens. Padding gets any rank: its
    keys are invalid."""
    hidden, is_condition = torch.as_tensor(hidden, dtype=torch.bool), torch.as_tensor(is_condition, dtype=torch.bool)
    if hidden.shape != is_condition.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and is_condition {tuple(is_condition.shape)} must have one shape")
    if (hidden & is_condition).any():
        raise ValueError("a condition token (BOS) is visible by definition: it cannot be hidden")
    c = is_condition.any(-1, keepdim=True).long()
    return torch.where(is_condition, 0, torch.where(hidden, c + 1, c))

