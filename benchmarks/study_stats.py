"""Statistics for the seeded study (benchmarks/study.py): mean, sd, and a paired comparison across seeds.

The rule that calls a difference (used for every verdict in docs/RESULTS.md):

    With paired differences d_s = a_s - b_s over the seeds s that both objectives finished (n >= 2),
    a difference is *called* when the two-sided 95 % paired-t interval of the mean difference excludes 0
    (mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n); for 3 seeds t = 4.30, so |mean| must exceed 2.48 sd(d))
    AND every d_s has the same sign. Otherwise the two are "within seed spread".

With 3 seeds a sign test alone can never reach p < 0.05 (its smallest two-sided p is 0.25), so it is
reported for information only. Pure Python plus ``scipy.stats.t`` for the quantile and p-value.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["mean", "sd", "PairedComparison", "paired_comparison", "CALL_LEVEL"]

CALL_LEVEL = 0.05  # two-sided


def mean(values) -> float:
    values = [float(v) for v in values]
    if not values:
        raise ValueError("mean of no values")
    return sum(values) / len(values)


def sd(values) -> float:
    """Sample standard deviation (n - 1); NaN for fewer than two values."""
    values = [float(v) for v in values]
    if len(values) < 2:
        return float("nan")
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


@dataclass
class PairedComparison:
    n: int
    mean_diff: float  # mean of a - b
    sd_diff: float
    ci_low: float  # 95 % paired-t interval of the mean difference
    ci_high: float
    t: float
    p_t: float  # two-sided paired-t p-value
    p_sign: float  # two-sided exact sign-test p-value (information only)
    same_sign: bool
    called: bool  # the rule above
    direction: int  # +1: a > b called, -1: a < b called, 0: not called

    def to_dict(self) -> dict:
        return asdict(self)


def _sign_test_p(diffs) -> float:
    nonzero = [d for d in diffs if d != 0]
    n = len(nonzero)
    if n == 0:
        return 1.0
    k = min(sum(d > 0 for d in nonzero), sum(d < 0 for d in nonzero))
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_comparison(a, b, level: float = CALL_LEVEL) -> PairedComparison:
    """Compare ``a[s]`` with ``b[s]`` (same seeds, same order). See the module docstring for the rule."""
    from scipy import stats

    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs the same seeds on both sides, got {len(a)} and {len(b)} values")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    if n == 0:
        raise ValueError("paired comparison of no pairs")
    m = mean(diffs)
    same_sign = all(d > 0 for d in diffs) or all(d < 0 for d in diffs)
    if n < 2:
        nan = float("nan")
        return PairedComparison(n, m, nan, nan, nan, nan, nan, _sign_test_p(diffs), same_sign, False, 0)
    s = sd(diffs)
    quantile = float(stats.t.ppf(1 - level / 2, n - 1))
    half = quantile * s / math.sqrt(n)
    if s == 0:
        t_value = math.copysign(math.inf, m) if m != 0 else 0.0
        p = 0.0 if m != 0 else 1.0
    else:
        t_value = m / (s / math.sqrt(n))
        p = float(2 * stats.t.sf(abs(t_value), n - 1))
    excludes_zero = (m - half > 0) or (m + half < 0)
    called = bool(excludes_zero and same_sign)
    direction = (1 if m > 0 else -1) if called else 0
    return PairedComparison(n, m, s, m - half, m + half, t_value, p, _sign_test_p(diffs), same_sign, called, direction)
