"""Statistics for the seeded study (study/study_report.py): pure functions, no I/O.

- ``mean``, ``sd``;
- ``paired_comparison``: the paired t-test over seeds (mean difference, its 95 % t interval, two-sided p);
- ``holm``: Holm's step-down adjustment of a family of p-values;
- ``power_paired_t`` / ``seeds_for_power``: the power of a two-sided paired t-test for a given true effect, sd of
  the paired differences and number of seeds (noncentral t, ``scipy.stats.nct``; a normal approximation if scipy
  is missing, named so in ``POWER_METHOD``);
- a seeded per-example bootstrap of a metric difference (``bootstrap_indices``, ``accuracy_metric``,
  ``pearson_metric``, ``ratio_metric``, ``paired_bootstrap``): the test examples (or held-out passages) are
  resampled with replacement, the *same* draw for both objectives and every seed (paired), within each stratum
  (a task's test set, a held-out text set) separately.

The rule that turns these into a verdict is stated (and applied) in study_report.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["mean", "sd", "PairedComparison", "paired_comparison", "holm", "power_paired_t", "seeds_for_power",
           "POWER_METHOD", "bootstrap_indices", "accuracy_metric", "pearson_metric", "ratio_metric",
           "identity_indices", "BootstrapResult", "paired_bootstrap", "CALL_LEVEL"]

CALL_LEVEL = 0.05  # two-sided

try:
    from scipy import stats as _stats
except ImportError:  # pragma: no cover - scipy is a dependency of the package; kept for a bare interpreter
    _stats = None

POWER_METHOD = ("noncentral t (scipy.stats.nct), two-sided" if _stats is not None else
                "normal approximation (scipy missing): Phi(|d|/se - z) + Phi(-|d|/se - z), two-sided")


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


# ---------------------------------------------------------------------------------------------
# the paired t-test over seeds
# ---------------------------------------------------------------------------------------------
@dataclass
class PairedComparison:
    n: int
    mean_diff: float  # mean of a - b
    sd_diff: float
    ci_low: float  # 95 % paired-t interval of the mean difference
    ci_high: float
    t: float
    p_t: float  # two-sided paired-t p-value (of mean(a - b) = null)
    p_sign: float  # two-sided exact sign-test p-value (information only)
    same_sign: bool
    called: bool  # the old rule: the t interval excludes the null and every difference has the same sign
    direction: int  # +1: a > b called, -1: a < b called, 0: not called (old rule)
    null: float = 0.0  # the difference tested against (a margin for a non-inferiority question)

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


def _t_ppf(q: float, df: int) -> float:
    if _stats is not None:
        return float(_stats.t.ppf(q, df))
    raise RuntimeError("the t quantile needs scipy")  # pragma: no cover


def paired_comparison(a, b, level: float = CALL_LEVEL, null: float = 0.0) -> PairedComparison:
    """Compare ``a[s]`` with ``b[s]`` (same seeds, same order): the paired t-test of mean(a - b) = ``null``."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs the same seeds on both sides, got {len(a)} and {len(b)} values")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    if n == 0:
        raise ValueError("paired comparison of no pairs")
    m = mean(diffs)
    shifted = [d - null for d in diffs]
    same_sign = all(d > 0 for d in shifted) or all(d < 0 for d in shifted)
    if n < 2:
        nan = float("nan")
        return PairedComparison(n, m, nan, nan, nan, nan, nan, _sign_test_p(shifted), same_sign, False, 0, null)
    s = sd(diffs)
    half = _t_ppf(1 - level / 2, n - 1) * s / math.sqrt(n)
    if s == 0:
        t_value = math.copysign(math.inf, m - null) if m != null else 0.0
        p = 0.0 if m != null else 1.0
    else:
        t_value = (m - null) / (s / math.sqrt(n))
        p = float(2 * _stats.t.sf(abs(t_value), n - 1))
    excludes = (m - half > null) or (m + half < null)
    called = bool(excludes and same_sign)
    direction = (1 if m > null else -1) if called else 0
    return PairedComparison(n, m, s, m - half, m + half, t_value, p, _sign_test_p(shifted), same_sign, called,
                            direction, null)


# ---------------------------------------------------------------------------------------------
# multiple comparisons
# ---------------------------------------------------------------------------------------------
def holm(pvalues, fixed_family: bool = False) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order. NaN (a test that could not be run) stays NaN.
    Reject hypothesis i at family-wise level alpha iff adjusted[i] < alpha.

    ``fixed_family=False``: a NaN test leaves the family (issue 32's rule: the family is what finished).
    ``fixed_family=True``: the family is every test given (the protocol's list) and a NaN test counts as p = 1,
    the largest it could be: data that arrives later can only lower the others' adjusted p-values, never raise them,
    so a test called without it stays called with it."""
    p = [float(x) for x in pvalues]
    if fixed_family:
        filled = [1.0 if math.isnan(v) else v for v in p]
        return [float("nan") if math.isnan(v) else a for v, a in zip(p, holm(filled))]
    valid = sorted((v, i) for i, v in enumerate(p) if not math.isnan(v))
    m = len(valid)
    out = [float("nan")] * len(p)
    running = 0.0
    for rank, (v, i) in enumerate(valid):
        running = max(running, min(1.0, (m - rank) * v))
        out[i] = running
    return out


# ---------------------------------------------------------------------------------------------
# power of the paired t-test
# ---------------------------------------------------------------------------------------------
def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def _z(q: float) -> float:  # the standard normal quantile, by bisection on _phi (no scipy needed)
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _phi(mid) < q else (lo, mid)
    return (lo + hi) / 2


def power_paired_t(effect: float, sd_diff: float, n: int, alpha: float = CALL_LEVEL) -> float:
    """Probability that a two-sided paired t-test at level ``alpha`` over ``n`` seeds rejects when the true mean
    difference is ``effect`` and the paired differences have sd ``sd_diff``: P(|T| > t_{1-alpha/2, n-1}) with T
    noncentral t, df n - 1, noncentrality effect / (sd_diff / sqrt(n)). NaN when n < 2 or the sd is unknown."""
    if n < 2 or sd_diff is None or math.isnan(sd_diff) or math.isnan(effect):
        return float("nan")
    if sd_diff == 0:
        return 1.0 if effect != 0 else alpha
    ncp = abs(effect) / (sd_diff / math.sqrt(n))
    if _stats is None:  # pragma: no cover - the normal approximation (scipy missing)
        z = _z(1 - alpha / 2)
        return _phi(ncp - z) + _phi(-ncp - z)
    df = n - 1
    crit = float(_stats.t.ppf(1 - alpha / 2, df))
    upper = float(_stats.nct.sf(crit, df, ncp))
    if math.isnan(upper):
        upper = 1.0 - float(_stats.nct.cdf(crit, df, ncp))
    lower = float(_stats.nct.cdf(-crit, df, ncp))  # the wrong-sign rejections: below P(T < 0) = Phi(-ncp)
    if math.isnan(lower):  # scipy's nct can return NaN deep in the tail: bound it by the normal tail
        lower = _phi(-ncp)
    if math.isnan(upper):  # pragma: no cover
        upper = _phi(ncp - _z(1 - alpha / 2))
    return min(1.0, max(0.0, upper + lower))


def seeds_for_power(effect: float, sd_diff: float, target: float = 0.8, alpha: float = CALL_LEVEL,
                    max_n: int = 1000) -> int | None:
    """The fewest seeds (n >= 2) for which ``power_paired_t`` reaches ``target``; None beyond ``max_n`` or unknown."""
    if sd_diff is None or math.isnan(sd_diff) or math.isnan(effect) or effect == 0:
        return None
    for n in range(2, max_n + 1):
        if power_paired_t(effect, sd_diff, n, alpha) >= target:
            return n
    return None


# ---------------------------------------------------------------------------------------------
# per-example bootstrap
# ---------------------------------------------------------------------------------------------
def bootstrap_indices(sizes, n_boot: int = 2000, seed: int = 0) -> list[np.ndarray]:
    """One (n_boot, size) matrix of resampled indices per stratum (row r: replicate r's draw with replacement
    from range(size)), from one seeded generator: the same ``sizes`` and ``seed`` give the same draws."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, int(n), size=(n_boot, int(n))) for n in sizes]


def identity_indices(sizes) -> list[np.ndarray]:
    """The observed sample as a single 'replicate' (each stratum's indices once)."""
    return [np.arange(int(n))[None, :] for n in sizes]


def accuracy_metric(predictions, labels):
    """idx (replicates, examples) -> accuracy per replicate."""
    correct = np.asarray(predictions) == np.asarray(labels)
    return lambda idx: correct[idx].mean(axis=1)


def pearson_metric(predictions, labels):
    """idx -> Pearson r of predictions and labels per replicate (0 where a resample has no variance)."""
    x, y = np.asarray(predictions, dtype=float), np.asarray(labels, dtype=float)

    def fn(idx):
        xs, ys = x[idx], y[idx]
        xs = xs - xs.mean(axis=1, keepdims=True)
        ys = ys - ys.mean(axis=1, keepdims=True)
        den = np.sqrt((xs * xs).sum(axis=1) * (ys * ys).sum(axis=1))
        with np.errstate(invalid="ignore", divide="ignore"):
            r = (xs * ys).sum(axis=1) / den
        return np.where(den > 0, r, 0.0)

    return fn


def ratio_metric(numerator, denominator):
    """idx -> sum(numerator[idx]) / sum(denominator[idx]) per replicate: mean NLL per token with passage-level
    resampling (numerator: a passage's summed NLL, denominator: its token count). NaN where no token is drawn."""
    num, den = np.asarray(numerator, dtype=float), np.asarray(denominator, dtype=float)

    def fn(idx):
        d = den[idx].sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(d > 0, num[idx].sum(axis=1) / d, np.nan)

    return fn


@dataclass
class BootstrapResult:
    estimate: float  # the statistic on the observed examples (mean over seeds of the paired difference)
    low: float  # percentile interval of the replicates
    high: float
    p: float  # two-sided: 2 * min(share of replicates <= null, share >= null), at least 1 / n_boot
    n_boot: int
    n_seeds: int
    units: list  # examples (or passages) per stratum
    null: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def excludes(self, value: float | None = None) -> bool:
        value = self.null if value is None else value
        return bool(self.low > value or self.high < value)


def paired_bootstrap(differences, sizes, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                     null: float = 0.0, indices=None) -> BootstrapResult:
    """Per-example bootstrap of a difference, pooled over seeds.

    ``differences``: one callable per seed, taking a list of index matrices (one per stratum, rows = replicates)
    and returning the difference a - b per replicate (e.g. ``lambda I: acc_a(I[0]) - acc_b(I[0])``). Every seed
    and both objectives see the same resampled test examples (they were scored on the same ones), so the
    replicate's statistic is the mean over seeds of the per-seed difference: the interval shows the test-sample
    error of the seed-averaged difference, with the seeds held fixed. ``indices``: the draws of
    ``bootstrap_indices(sizes, n_boot, seed)`` when the caller already holds them (to reuse cached replicates).
    """
    if not differences:
        raise ValueError("a bootstrap over no seeds")
    idxs = bootstrap_indices(sizes, n_boot, seed) if indices is None else indices
    draws = np.mean([np.asarray(fn(idxs), dtype=float) for fn in differences], axis=0)
    observed = float(np.mean([float(np.asarray(fn(identity_indices(sizes)))[0]) for fn in differences]))
    draws = draws[~np.isnan(draws)]
    if draws.size == 0:
        nan = float("nan")
        return BootstrapResult(observed, nan, nan, nan, n_boot, len(differences), [int(s) for s in sizes], null)
    tail = (1 - level) / 2
    low, high = np.quantile(draws, [tail, 1 - tail])
    p = min(1.0, max(2 * min(np.mean(draws <= null), np.mean(draws >= null)), 1 / draws.size))
    return BootstrapResult(observed, float(low), float(high), float(p), n_boot, len(differences),
                           [int(s) for s in sizes], null)
