"""The plans of every objective, drawn for a whole batch at once, against the per-row loop they replaced (29bc920).

``reference_*`` below is the per-row implementation of ``hf_lookaround.plans`` as it was before the
plans were drawn for a whole batch at once (copied unchanged, only renamed). It is the slow reference:

- bit-identical (same generator, same output): ``ar`` (no randomness), ``dar`` with one group size
  ``t`` (the vectorised plan draws ``s1`` from the same stream in the same order), the ``fixed`` GVP
  boundaries, and the target counts of ``mlm`` (a function of the row);
- distribution-equivalent: ``dar`` with a list of ``t`` (the draws of ``t`` and ``s1`` are no longer
  interleaved row by row), ``mlm``/``vmlm`` (which positions: a per-row ``randperm`` became one batched
  shuffle) and ``gvp`` (the order and the random/mixed boundaries). These are tested against the exact
  plan distribution on short sequences (every possible plan and its probability, a chi-square test of
  the observed frequencies, for the new and the reference implementation alike), and against the
  reference on long ones (two-sample tests of counts, boundaries and per-position frequencies).

All draws use fixed seeds, so the tests are deterministic.
"""

import functools
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from hf_lookaround.objectives import ar, dar, mlm, vmlm, gvp
from hf_lookaround import plans
from hf_lookaround.models.lookaround.modeling_lookaround import positions_of
from hf_lookaround.objectives import make_plan
from hf_lookaround.plans import Plan
from hf_lookaround.theory.cooccurrence import plan_distribution
from hf_lookaround.data.image_collator import image_plan


# =============================================================================================
# The per-row reference (hf_lookaround.plans before vectorisation)
# =============================================================================================
def reference_check_lengths(lengths, seq_len: int, num_condition_tokens: int) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if lengths.numel() == 0:
        raise ValueError("a plan needs at least one sequence; got an empty batch")
    if (lengths < 0).any() or (lengths > seq_len).any():
        raise ValueError(f"sequence lengths must lie in [0, {seq_len}], got {lengths.tolist()}")
    if num_condition_tokens < 0:
        raise ValueError(f"num_condition_tokens must be >= 0, got {num_condition_tokens}")
    return lengths


def reference_empty(lengths: torch.Tensor, seq_len: int) -> Plan:
    batch = lengths.numel()
    return Plan(torch.zeros(batch, seq_len, dtype=torch.long), torch.zeros(batch, seq_len, dtype=torch.bool))


def reference_autoregressive_plan(lengths, seq_len: int, num_condition_tokens: int = 0, generator=None) -> Plan:
    """GPT: ``g[i] = i``; every position with rank >= 1 is a target (so ``i >= 1`` with no prefix)."""
    lengths = reference_check_lengths(lengths, seq_len, num_condition_tokens)
    plan = reference_empty(lengths, seq_len)
    c = num_condition_tokens
    for b, n in enumerate(lengths.tolist()):
        if n <= c:
            continue
        ranks = torch.arange(n - c) + (1 if c else 0)
        plan.group_ids[b, c:n] = ranks
        plan.is_target[b, c:n] = ranks >= 1
    return plan


def reference_draw_group_size(t, generator) -> int:
    sizes = [t] if isinstance(t, int) else list(t)
    if not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"group size t must be a positive int or a non-empty list of them, got {t!r}")
    if len(sizes) == 1:
        return int(sizes[0])
    return int(sizes[int(torch.randint(len(sizes), (1,), generator=generator))])


def reference_semi_autoregressive_plan(lengths, seq_len: int, t=2, num_condition_tokens: int = 0, generator=None) -> Plan:
    """Diversity-enhanced AR (paper (a) Eq. 3 and 6).

    The first group has size ``s1 ~ U{1..t}`` and rank 0; then consecutive groups of ``t`` tokens:
    ``g[i] = 1 + (i - s1) // t``. Targets have rank >= 1. ``t`` may be a list: a group size is
    drawn uniformly from it for each sequence (a mixture of t values). ``t = 1`` is AR.
    """
    lengths = reference_check_lengths(lengths, seq_len, num_condition_tokens)
    plan = reference_empty(lengths, seq_len)
    c = num_condition_tokens
    for b, n in enumerate(lengths.tolist()):
        size = reference_draw_group_size(t, generator)
        if n <= c:
            continue
        s1 = int(torch.randint(1, size + 1, (1,), generator=generator))
        i = torch.arange(n - c)
        ranks = torch.where(i < s1, 0, 1 + torch.div(i - s1, size, rounding_mode="floor"))
        ranks = ranks + (1 if c else 0)
        plan.group_ids[b, c:n] = ranks
        plan.is_target[b, c:n] = ranks >= 1
    return plan


def reference_check_ratio(name: str, value: float) -> None:
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")


def reference_masked_plan(
    lengths, seq_len: int, mask_ratio: float = 0.15, num_condition_tokens: int = 0, maskable=None, generator=None
) -> Plan:
    """BERT/MAE with a fixed ratio: ``round(ratio * n)`` (at least 1) positions drawn without
    replacement get rank 1 and are the targets; the rest have rank 0."""
    reference_check_ratio("mask_ratio", mask_ratio)
    return reference_masked(lengths, seq_len, lambda: mask_ratio, num_condition_tokens, maskable, generator)


def reference_variable_masked_plan(
    lengths,
    seq_len: int,
    mask_ratio_range: tuple[float, float] = (0.15, 0.3),
    num_condition_tokens: int = 0,
    maskable=None,
    generator=None,
) -> Plan:
    """Variable-length masking (paper (a) Eq. 5): the ratio is drawn per sequence from ``U[a, b]``."""
    a, b = reference_check_mask_ratio_range(mask_ratio_range)

    def draw() -> float:
        return a + (b - a) * float(torch.rand((), generator=generator))

    return reference_masked(lengths, seq_len, draw, num_condition_tokens, maskable, generator)


def reference_check_mask_ratio_range(mask_ratio_range) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in mask_ratio_range)
    except (TypeError, ValueError):
        raise ValueError(f"mask_ratio_range must be two numbers (a, b), got {mask_ratio_range!r}") from None
    if not (0.0 < a <= b < 1.0):
        raise ValueError(f"mask_ratio_range must satisfy 0 < a <= b < 1, got ({a}, {b})")
    return a, b


def reference_masked(lengths, seq_len, draw_ratio, num_condition_tokens, maskable, generator) -> Plan:
    lengths = reference_check_lengths(lengths, seq_len, num_condition_tokens)
    plan = reference_empty(lengths, seq_len)
    c = num_condition_tokens
    if maskable is not None:
        maskable = torch.as_tensor(maskable, dtype=torch.bool)
        if maskable.shape != plan.group_ids.shape:
            raise ValueError(f"maskable must have shape {tuple(plan.group_ids.shape)}, got {tuple(maskable.shape)}")
    for b, n in enumerate(lengths.tolist()):
        ratio = draw_ratio()
        candidates = torch.arange(c, n)
        if maskable is not None:
            candidates = candidates[maskable[b, c:n]]
        if candidates.numel() == 0:
            continue
        count = min(candidates.numel(), max(1, round(ratio * candidates.numel())))
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
        base = 1 if c else 0
        plan.group_ids[b, c:n] = base
        plan.group_ids[b, chosen] = base + 1
        plan.is_target[b, chosen] = True
    return plan


def reference_gvp_boundaries(n: int, num_groups: int = 20, segmentation: str = "mixed", generator=None) -> list[int]:
    """Group boundaries ``n0 < n1 < ... < nK = n`` of GVP (paper (b) §3.2, App. B).

    - fixed:  ``n_i = (i + 1) n / (K + 1)``;
    - random: ``n0..n(K-1)`` distinct, uniform in ``[1, n-1]``;
    - mixed:  ``n(K-1) = round(p n)``, ``p ~ N(0.5, 0.1)``; ``n0..n(K-2)`` distinct, uniform in
      ``[1, n(K-1) - 1]``. ``n(K-1)`` is clipped to ``[K, n-1]`` so the draw is always possible.
    """
    k = num_groups
    if segmentation not in gvp.SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {gvp.SEGMENTATIONS}, got {segmentation!r}")
    if k < 1:
        raise ValueError(f"num_groups (K) must be >= 1, got {k}")
    if n < k + 1:
        raise ValueError(f"GVP with K={k} needs sequences of at least K+1={k + 1} positions, got {n}")
    if segmentation == "fixed":
        return [round((i + 1) * n / (k + 1)) for i in range(k)] + [n]
    if segmentation == "random":
        inner = (torch.randperm(n - 1, generator=generator)[:k] + 1).sort().values.tolist()
        return inner + [n]
    p = 0.5 + 0.1 * float(torch.randn((), generator=generator))
    last = min(max(round(p * n), k), n - 1)
    inner = (torch.randperm(last - 1, generator=generator)[: k - 1] + 1).sort().values.tolist()
    return inner + [last, n]


def reference_gvp_plan(
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
    lengths = reference_check_lengths(lengths, seq_len, num_condition_tokens)
    plan = reference_empty(lengths, seq_len)
    c = num_condition_tokens
    for b, n in enumerate(lengths.tolist()):
        if n <= c:
            continue
        m = n - c
        bounds = reference_gvp_boundaries(m, num_groups, segmentation, generator)
        order = torch.randperm(m, generator=generator)
        group_of_step = torch.bucketize(torch.arange(m), torch.tensor(bounds), right=True)
        ranks = torch.empty(m, dtype=torch.long)
        ranks[order] = group_of_step
        plan.group_ids[b, c:n] = ranks + (1 if c else 0)
        plan.is_target[b, c:n] = ranks >= 1
    return plan


def reference_make_plan(objective: str, lengths, seq_len: int, generator=None, **params) -> Plan:
    """Draw the plan of ``objective`` (one of :data:`objectives.PLAN_NAMES`) with its parameters."""
    if objective == "ar":
        return reference_autoregressive_plan(lengths, seq_len, generator=generator, **params)
    if objective == "dar":
        return reference_semi_autoregressive_plan(lengths, seq_len, generator=generator, **params)
    if objective == "mlm":
        return reference_masked_plan(lengths, seq_len, generator=generator, **params)
    if objective == "vmlm":
        return reference_variable_masked_plan(lengths, seq_len, generator=generator, **params)
    if objective == "gvp":
        return reference_gvp_plan(lengths, seq_len, generator=generator, **params)
    raise ValueError(f"unknown objective {objective!r}; choose one of {objectives.PLAN_NAMES}")



# =============================================================================================
# helpers
# =============================================================================================
def gen(seed):
    return torch.Generator().manual_seed(seed)


def row_plans(plan: Plan, rows, start: int, stop: int) -> Counter:
    """Counter of (group ranks, targets) of positions ``start:stop`` over the given rows."""
    g = plan.group_ids[rows, start:stop].tolist()
    t = plan.is_target[rows, start:stop].tolist()
    return Counter(zip(map(tuple, g), map(tuple, t)))


def chi_square_pvalue(seen: Counter, exact: dict, draws: int) -> float:
    """Goodness of fit of observed plan counts to exact probabilities; cells expected < 5 are pooled."""
    outside = set(seen) - set(exact)
    assert not outside, f"plans outside the exact support: {sorted(outside)[:3]}"
    observed, expected, pooled_o, pooled_e = [], [], 0, 0.0
    for key, p in exact.items():
        if p * draws >= 5:
            observed.append(seen[key])
            expected.append(p * draws)
        else:
            pooled_o += seen[key]
            pooled_e += p * draws
    assert len(observed) >= 2, "too few draws for this many plans: every cell was pooled"
    if pooled_e > 0:
        observed.append(pooled_o)
        expected.append(pooled_e)
    expected = np.array(expected) * (sum(observed) / sum(expected))  # float rounding of the probabilities
    return stats.chisquare(observed, expected).pvalue


def exact_text_plans(objective, n, c, **params) -> dict:
    exact = Counter()
    for p, g, target in plan_distribution(objective, n, num_condition_tokens=c, **params):
        exact[(tuple(g.tolist()), tuple(target.tolist()))] += p
    return exact


@functools.lru_cache(maxsize=None)
def gvp_bounds_probability(bounds: tuple, m: int, k: int, segmentation: str) -> float:
    """P(n0..nK = bounds) for a sequence of m ranked positions (paper (b) App. B, as plans.py states it)."""
    last = bounds[k - 1]
    if segmentation == "fixed":
        return float(bounds == tuple(round((i + 1) * m / (k + 1)) for i in range(k)) + (m,))
    if segmentation == "random":
        return 1.0 / math.comb(m - 1, k)
    # mixed: n(K-1) = clip(round(p m), K, m-1) with p ~ N(0.5, 0.1); then n0..n(K-2) uniform below it
    cdf = lambda x: stats.norm.cdf((x / m - 0.5) / 0.1)  # noqa: E731  P(p m < x)
    if not k <= last <= m - 1:
        return 0.0
    hi = 1.0 if last == m - 1 else cdf(last + 0.5)
    lo = 0.0 if last == k else cdf(last - 0.5)
    return (hi - lo) / math.comb(last - 1, k - 1)


def exact_gvp_plans(n, c, num_groups, segmentation) -> dict:
    """Every GVP plan of one sequence of length n with its probability: the ranks fix the group sizes, hence
    the boundaries; given the boundaries every arrangement of the groups over positions is equally likely."""
    m, k, base = n - c, num_groups, (1 if c else 0)
    exact = {}
    for ranks in itertools.product(range(k + 1), repeat=m):
        sizes = np.bincount(ranks, minlength=k + 1)
        if (sizes == 0).any():
            continue
        p = gvp_bounds_probability(tuple(np.cumsum(sizes).tolist()), m, k, segmentation)
        if p == 0:
            continue
        arrangements = math.factorial(m) / math.prod(math.factorial(int(s)) for s in sizes)
        g = (0,) * c + tuple(r + base for r in ranks)
        exact[(g, (False,) * c + tuple(r >= 1 for r in ranks))] = p / arrangements
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-9)
    return exact


# =============================================================================================
# bit-identical
# =============================================================================================
RAGGED = [9, 0, 1, 2, 7, 3, 9, 5]  # includes rows no longer than the condition prefix


@pytest.mark.parametrize("c", [0, 1, 2])
def test_ar_is_bit_identical(c):
    new = ar.plan(RAGGED, 9, num_condition_tokens=c)
    old = reference_autoregressive_plan(RAGGED, 9, num_condition_tokens=c)
    assert torch.equal(new.group_ids, old.group_ids) and torch.equal(new.is_target, old.is_target)


@pytest.mark.parametrize("t", [1, 2, 3, 5, [4]])
@pytest.mark.parametrize("c", [0, 1])
def test_semi_ar_with_one_group_size_is_bit_identical(t, c):
    lengths = RAGGED * 20
    for seed in range(3):
        new = dar.plan(lengths, 9, t=t, num_condition_tokens=c, generator=gen(seed))
        old = reference_semi_autoregressive_plan(lengths, 9, t=t, num_condition_tokens=c, generator=gen(seed))
        assert torch.equal(new.group_ids, old.group_ids) and torch.equal(new.is_target, old.is_target)


@pytest.mark.parametrize("segmentation", ["fixed", "random", "mixed"])
def test_gvp_boundaries_are_valid_and_fixed_ones_identical(segmentation):
    k = 4
    for n in range(k + 1, 40):
        for seed in range(3):
            bounds = gvp.boundaries(n, k, segmentation, generator=gen(seed))
            assert len(bounds) == k + 1 and bounds[-1] == n and bounds[0] >= 1
            assert all(a < b for a, b in zip(bounds, bounds[1:]))
            if segmentation == "fixed":
                assert bounds == reference_gvp_boundaries(n, k, "fixed")
            if segmentation == "mixed":
                assert k <= bounds[k - 1] <= n - 1


def test_fixed_gvp_group_sizes_are_identical():
    lengths = [33, 21, 0, 17, 33]
    new = gvp.plan(lengths, 33, num_groups=4, segmentation="fixed", num_condition_tokens=1, generator=gen(0))
    old = reference_gvp_plan(lengths, 33, num_groups=4, segmentation="fixed", num_condition_tokens=1,
                             generator=gen(0))
    for b in range(len(lengths)):
        assert torch.equal(torch.bincount(new.group_ids[b], minlength=6), torch.bincount(old.group_ids[b], minlength=6))
    assert torch.equal(new.is_target.sum(1), old.is_target.sum(1))


@pytest.mark.parametrize("ratio", [0.15, 0.3, 0.5, 0.99])
def test_masked_counts_and_ranks_match_the_reference(ratio):
    # (no empty row: with a condition prefix the reference fails on one, torch.arange(1, 0))
    lengths = torch.tensor([40, 1, 1, 2, 3, 17, 40, 25])
    maskable = torch.rand(len(lengths), 40, generator=gen(1)) < 0.7
    maskable[3] = False  # a row with nothing maskable
    for c in (0, 1):
        new = mlm.plan(lengths, 40, ratio, num_condition_tokens=c, maskable=maskable, generator=gen(2))
        old = reference_masked_plan(lengths, 40, ratio, num_condition_tokens=c, maskable=maskable, generator=gen(2))
        assert torch.equal(new.is_target.sum(1), old.is_target.sum(1))
        # the ranks are the same function of the targets: base inside the row, base + 1 on targets
        assert torch.equal(new.group_ids - new.is_target.long(), old.group_ids - old.is_target.long())


def test_target_positions_match_the_model():
    is_target = torch.rand(6, 50, generator=gen(3)) < 0.3
    is_target[2] = False
    assert torch.equal(plans.target_positions_from_mask(is_target), positions_of(is_target))
    padded = plans.target_positions_from_mask(is_target, pad_to=40)
    assert padded.shape == (6, 40) and torch.equal(padded[:, : positions_of(is_target).shape[1]], positions_of(is_target))
    assert (padded[:, positions_of(is_target).shape[1]:] == -1).all()
    with pytest.raises(ValueError, match="pad_to"):
        plans.target_positions_from_mask(is_target, pad_to=2)


@pytest.mark.parametrize("width", [None, 0, 3, 12, 50])
def test_host_positions_of_is_the_models_positions_of(width):
    """The collators' numpy twin of the model's `positions_of`: ragged rows, an empty row, equal counts (the reshape
    path) and widths that leave entries out."""
    ragged = torch.rand(6, 50, generator=gen(4)) < 0.3
    ragged[2] = False
    equal = torch.zeros(5, 50, dtype=torch.bool)
    equal[:, 7:19] = True
    equal[1] = torch.roll(equal[1], 9)
    for mask in (ragged, equal, torch.zeros(3, 50, dtype=torch.bool)):
        assert torch.equal(torch.from_numpy(plans.host_positions_of(mask.numpy(), width)), positions_of(mask, width))


# =============================================================================================
# distribution-equivalent: the exact distribution on short sequences
# =============================================================================================
EXACT_CASES = [
    ("dar", {"t": [1, 2, 3]}),
    ("dar", {"t": [2, 4]}),
    ("mlm", {"mask_ratio": 0.4}),
    ("vmlm", {"mask_ratio_range": (0.15, 0.6)}),
    ("gvp", {"num_groups": 3, "segmentation": "fixed"}),
    ("gvp", {"num_groups": 2, "segmentation": "random"}),
    ("gvp", {"num_groups": 2, "segmentation": "mixed"}),
    ("gvp", {"num_groups": 3, "segmentation": "mixed"}),
]


def exact_plans(objective, n, c, params):
    if objective == "gvp":
        return exact_gvp_plans(n, c, **params)
    return exact_text_plans(objective, n, c, **params)


@pytest.mark.parametrize("objective,params", EXACT_CASES)
def test_vectorised_plans_follow_the_exact_distribution(objective, params):
    # a ragged batch: every row, whatever its neighbours' lengths, has its own length's distribution
    c, lengths, draws = 1, (8, 7, 1), 12000
    batch = list(lengths) * draws
    plan = make_plan(objective, batch, 8, generator=gen(5), num_condition_tokens=c, **params)
    for r, n in enumerate(lengths):
        rows = slice(r, None, len(lengths))
        assert not plan.group_ids[rows, n:].any() and not plan.is_target[rows, n:].any()  # padding
        if n <= c:
            assert not plan.group_ids[rows].any()
            continue
        exact = exact_plans(objective, n, c, params)
        assert chi_square_pvalue(row_plans(plan, rows, 0, n), exact, draws) > 0.01, (objective, params, n)


@pytest.mark.parametrize("objective,params", EXACT_CASES)
def test_the_reference_follows_the_same_exact_distribution(objective, params):
    # the reference draws from the distribution the vectorised plans are tested against: the two agree
    n, c, draws = 7, 1, 3000
    plan = reference_make_plan(objective, [n] * draws, n, generator=gen(6), num_condition_tokens=c, **params)
    exact = exact_plans(objective, n, c, params)
    assert chi_square_pvalue(row_plans(plan, slice(None), 0, n), exact, draws) > 0.01


def test_masked_plan_with_maskable_is_a_uniform_subset():
    # maskable holes: each subset of the maskable positions, of the row's count, is equally likely
    n, draws = 9, 20000
    maskable = torch.tensor([False, True, True, False, True, True, True, False, True])
    plan = mlm.plan([n] * draws, n, 0.4, num_condition_tokens=1, maskable=maskable.expand(draws, n),
                             generator=gen(7))
    candidates = maskable.nonzero().flatten().tolist()
    count = plans.expected_masked_count(0.4, len(candidates))
    chosen = Counter(tuple(row.nonzero().flatten().tolist()) for row in plan.is_target)
    subsets = list(itertools.combinations(candidates, count))
    assert set(chosen) <= set(subsets)
    assert stats.chisquare([chosen[s] for s in subsets]).pvalue > 0.01


# =============================================================================================
# distribution-equivalent: long sequences, against the reference
# =============================================================================================
def test_long_masked_plans_match_the_reference():
    n, rows = 129, 1500
    new = vmlm.plan([n] * rows, n, (0.15, 0.3), num_condition_tokens=1, generator=gen(8))
    old = reference_variable_masked_plan([n] * rows, n, (0.15, 0.3), num_condition_tokens=1, generator=gen(9))
    # mask counts: two-sample test of the count distributions
    assert stats.ks_2samp(new.is_target.sum(1).numpy(), old.is_target.sum(1).numpy()).pvalue > 0.01
    # per-position target frequency: uniform over the positions after the prefix (chi-square)
    per_position = new.is_target[:, 1:].sum(0).numpy()
    assert stats.chisquare(per_position).pvalue > 0.01
    assert not new.is_target[:, 0].any()
    # no spatial structure: masked neighbours as often as for the reference
    adjacent = lambda p: (p.is_target[:, 1:] & p.is_target[:, :-1]).sum(1).numpy()  # noqa: E731
    assert stats.mannwhitneyu(adjacent(new), adjacent(old)).pvalue > 0.01


@pytest.mark.parametrize("segmentation", ["random", "mixed", "fixed"])
def test_long_gvp_plans_match_the_reference(segmentation):
    n, k, rows = 201, 8, 1500
    new = gvp.plan([n] * rows, n, k, segmentation, num_condition_tokens=1, generator=gen(10))
    old = reference_gvp_plan([n] * rows, n, k, segmentation, num_condition_tokens=1, generator=gen(11))
    sizes = lambda p: torch.stack([torch.bincount(r, minlength=k + 2)[1:] for r in p.group_ids[:, 1:]])  # noqa: E731
    new_bounds, old_bounds = sizes(new).cumsum(1), sizes(old).cumsum(1)
    assert (new_bounds[:, -1] == n - 1).all() and (new_bounds.diff(dim=1) > 0).all()
    for j in range(k):  # each boundary's distribution: two-sample KS against the reference
        if segmentation == "fixed":
            assert torch.equal(new_bounds[:, j], old_bounds[:, j])
        else:
            assert stats.ks_2samp(new_bounds[:, j].numpy(), old_bounds[:, j].numpy()).pvalue > 0.001, j
    # the order is uniform: every position falls in each group in proportion to its size
    g = new.group_ids[:, 1:] - 1
    table = np.stack([np.bincount(g[:, i].numpy(), minlength=k + 1) for i in range(0, n - 1, 20)])
    assert stats.chi2_contingency(table).pvalue > 0.01  # the group of a position does not depend on where it is
    assert not new.is_target[:, 0].any() and torch.equal(new.is_target[:, 1:], g >= 1)


def test_random_segmentation_boundaries_are_a_uniform_subset():
    # n0..n(K-1): K distinct values uniform in [1, m-1]; every value equally often, the minimum exactly distributed
    m, k, draws = 30, 5, 20000
    plan = gvp.plan([m] * draws, m, k, "random", generator=gen(12))
    sizes = torch.stack([torch.bincount(r, minlength=k + 1) for r in plan.group_ids])
    inner = sizes.cumsum(1)[:, :k]
    assert stats.chisquare(torch.bincount(inner.flatten(), minlength=m)[1:].numpy()).pvalue > 0.01
    first = torch.bincount(inner[:, 0], minlength=m)[1:].numpy()
    pmf = np.array([math.comb(m - 1 - v, k - 1) / math.comb(m - 1, k) for v in range(1, m)])
    keep = pmf * draws >= 5
    observed = np.append(first[keep], first[~keep].sum())
    expected = np.append(pmf[keep], pmf[~keep].sum()) * draws
    assert stats.chisquare(observed, expected).pvalue > 0.01


# =============================================================================================
# structural invariants, every objective
# =============================================================================================
INVARIANT_CASES = [
    ("ar", {}), ("dar", {"t": 2}), ("dar", {"t": [1, 3]}), ("mlm", {"mask_ratio": 0.2}),
    ("vmlm", {"mask_ratio_range": (0.5, 0.75)}), ("gvp", {"num_groups": 3, "segmentation": "mixed"}),
    ("gvp", {"num_groups": 3, "segmentation": "random"}), ("gvp", {"num_groups": 3, "segmentation": "fixed"}),
]


@pytest.mark.parametrize("objective,params", INVARIANT_CASES)
@pytest.mark.parametrize("c", [0, 1, 2])
def test_structural_invariants(objective, params, c):
    T, rows = 24, 400
    lengths = torch.randint(0, T + 1, (rows,), generator=gen(13))
    lengths[lengths - c > 0] = lengths[lengths - c > 0].clamp(min=c + 4)  # GVP with K=3 needs 4 ranked positions
    maskable = torch.rand(rows, T, generator=gen(14)) < 0.8 if objective in ("mlm", "vmlm") else None
    extra = {"maskable": maskable} if maskable is not None else {}
    plan = make_plan(objective, lengths, T, generator=gen(15), num_condition_tokens=c, **params, **extra)
    position = torch.arange(T)
    inside = (position >= c) & (position < lengths[:, None])
    assert plan.group_ids.dtype == torch.long and plan.is_target.dtype == torch.bool
    assert (plan.group_ids >= 0).all()
    assert not plan.group_ids[:, :c].any() and not plan.is_target[:, :c].any()  # condition: rank 0, no loss
    padding = position >= lengths[:, None]
    assert not plan.group_ids[padding].any() and not plan.is_target[padding].any()  # padding: never a target
    assert not (plan.is_target & ~inside).any()
    assert (plan.group_ids[plan.is_target] >= 1).all()
    if maskable is not None:
        assert not (plan.is_target & ~maskable).any()
        ranked = inside & (inside & maskable).any(1, keepdim=True)
        assert torch.equal(plan.group_ids, (1 if c else 0) * ranked.long() + plan.is_target.long())
        available = (inside & maskable).sum(1).tolist()
        counts = [plans.expected_masked_count(0.2, a) for a in available] if objective == "mlm" else None
        if counts is not None:
            assert plan.is_target.sum(1).tolist() == counts
    elif objective == "gvp":
        k = params["num_groups"]
        base = 1 if c else 0
        for b in range(rows):
            if lengths[b] > c:
                g = plan.group_ids[b, c : lengths[b]] - base
                assert torch.equal(g.unique(), torch.arange(k + 1))  # every group G0..GK is non-empty
                assert torch.equal(plan.is_target[b, c : lengths[b]], g >= 1)
    else:  # ar, dar: ranks never decrease along a row, and targets are the ranks >= 1
        ranks = torch.where(inside, plan.group_ids, 0)
        assert torch.equal(plan.is_target, inside & (ranks >= 1))
        steps = ranks[:, 1:] - ranks[:, :-1]
        assert (steps[inside[:, 1:] & inside[:, :-1]] >= 0).all()


@pytest.mark.parametrize("objective,params", [("mlm", {"mask_ratio": 0.75}), ("vmlm", {}),
                                              ("gvp", {"num_groups": 4, "segmentation": "mixed"})])
def test_image_plans(objective, params):
    plan = image_plan(objective, 64, 16, generator=gen(16), **params)
    assert plan.group_ids.shape == (64, 17)
    assert not plan.group_ids[:, 0].any() and not plan.is_target[:, 0].any()  # CLS: the rank-0 condition
    assert plan.is_target.any(1).all() and (plan.group_ids[:, 1:] >= 1).all()


def test_plans_are_reproducible_and_need_no_loop_state():
    for objective, params in INVARIANT_CASES:
        a = make_plan(objective, [20, 11, 0], 20, generator=gen(17), num_condition_tokens=1, **params)
        b = make_plan(objective, [20, 11, 0], 20, generator=gen(17), num_condition_tokens=1, **params)
        assert torch.equal(a.group_ids, b.group_ids) and torch.equal(a.is_target, b.is_target)


def test_clear_errors():
    with pytest.raises(ValueError, match="at least K\\+1=5"):
        gvp.plan([10, 3], 10, num_groups=4)
    with pytest.raises(ValueError, match="group size"):
        dar.plan([5], 5, t=[2, 0])
    with pytest.raises(ValueError, match="maskable must have shape"):
        mlm.plan([5], 5, maskable=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="segmentation"):
        gvp.plan([5], 5, num_groups=2, segmentation="blocks")


def test_the_semi_ar_collator_draws_the_plans_of_the_reference(monkeypatch):
    # through the collator (per-batch seed, condition prefix, padding): the same batches as with the loop
    from hf_lookaround.objectives import make_collator

    class Tokenizer:
        pad_token_id, bos_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
        cls_token_id = sep_token_id = None

    g = gen(18)
    features = [{"input_ids": [1] + torch.randint(10, 99, (n,), generator=g).tolist()} for n in (30, 12, 30, 5)]
    for t in (2, 3):
        new = make_collator("dar", Tokenizer(), group_size=t, seed=4)(features)
        with monkeypatch.context() as patched:
            # the collator draws through its plan function: the reference's loop in its place
            patched.setattr(dar.SemiAutoregressiveCollator, "plan_function",
                            staticmethod(lambda *args, **kwargs: reference_make_plan("dar", *args, **kwargs)))
            old = make_collator("dar", Tokenizer(), group_size=t, seed=4)(features)
        assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new)
