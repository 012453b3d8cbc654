"""Co-occurrence matrices of (conditional text, target token) pairs, and their spectra.

Paper (a) (Zhang et al., 2024, "Look Ahead or Look Around?") writes every generative objective
as a joint distribution ``P(X, X+)`` of a *conditional text* ``X`` and a *target token* ``X+``.
Here the pairs follow from the plans of :mod:`hf_lookaround.plans`: for a target ``i`` of a plan
with group ranks ``g``, the conditional text is the set of tokens (with their positions) of rank
``< g[i]`` -- exactly what the query stream at ``i`` may attend to -- and the target is ``x_i``.

Weighting: a (sample, plan) draw of probability ``p`` with ``M`` targets gives each of its pairs
the mass ``p / M`` (a uniformly chosen target). For data of one fixed length, as here, this is the
token-level average that training uses.

The objects, one function each:

- :func:`plan_distribution` -- the exact distribution of a plan (AR, DAR, MLM, VMLM, ...: each objective
  module's ``exact_plans``), consistent with the random draws of :func:`hf_lookaround.objectives.make_plan`;
- :func:`pairs_from_plan` -- the pairs of one sequence under one plan;
- :func:`cooccurrence_matrix` -- ``A[X, X+] = P(X, X+)`` as a ``scipy.sparse`` matrix;
- :func:`normalised_matrix` -- ``Ā = A / sqrt(P_C P_G)``;
- :func:`spectrum` -- the singular values of ``Ā``;
- :func:`spectral_loss` and :func:`factorisation_loss` -- the two sides of Theorem 3.1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla

from .. import objectives

__all__ = [
    "EXACT_OBJECTIVES",
    "Cooccurrence",
    "plan_distribution",
    "full_context",
    "pairs_from_plan",
    "exact_pairs",
    "cooccurrence_matrix",
    "normalised_matrix",
    "spectrum",
    "spectral_loss",
    "factorisation_loss",
    "check_theorem_31",
]

# the objectives whose plans are enumerated exactly: those whose module gives an ``exact_plans`` hook
EXACT_OBJECTIVES = tuple(name for name, o in objectives.OBJECTIVES.items() if o.exact_plans is not None)

# A context function maps (tokens, visible mask, target index) to a hashable conditional text.
ContextFn = Callable[[np.ndarray, np.ndarray, int], Hashable]


# --------------------------------------------------------------------------------------------
# exact plan distributions
# --------------------------------------------------------------------------------------------
def plan_distribution(objective: str, n: int, num_condition_tokens: int = 0, **params):
    """Every plan of ``objective`` for one sequence of length ``n``, with its probability.

    Returns a list of ``(probability, group_ids (n,), is_target (n,))``, from the ``exact_plans`` hook of the
    objective's module (tests check that ``make_plan`` draws from this distribution):

    - ``ar``: one plan, ``g[i] = i`` (shifted by one after a condition prefix);
    - ``dar`` (``t`` int or list): ``t`` uniform over the list, then ``s1 ~ U{1..t}``;
    - ``mlm`` (``mask_ratio``): every subset of ``expected_masked_count(ratio, n)`` positions,
      uniformly;
    - ``vmlm`` (``mask_ratio_range=(a, b)``): the count's exact distribution under ``U[a, b]``,
      then every subset of that size uniformly;

    and so on for every objective in :data:`EXACT_OBJECTIVES`.
    """
    c = num_condition_tokens
    if not 0 <= c < n:
        raise ValueError(f"need 0 <= num_condition_tokens < n, got {c} and n={n}")
    if objective not in EXACT_OBJECTIVES:
        raise ValueError(f"exact enumeration supports {EXACT_OBJECTIVES}, got {objective!r}; sample other plans")
    entry = objectives.get(objective)
    _reject_unknown(params, tuple(entry.defaults))
    return entry.exact_plans(n, c, **params)


def _reject_unknown(params: dict, allowed: Sequence[str]) -> None:
    unknown = set(params) - set(allowed)
    if unknown:
        raise ValueError(f"unknown plan parameters {sorted(unknown)}; this objective takes {list(allowed)}")


# --------------------------------------------------------------------------------------------
# pairs
# --------------------------------------------------------------------------------------------
def full_context(tokens: np.ndarray, visible: np.ndarray, i: int) -> tuple:
    """The conditional text itself: the visible ``(position, token)`` pairs."""
    idx = np.flatnonzero(visible)
    return tuple(zip(idx.tolist(), tokens[idx].tolist()))


def pairs_from_plan(
    tokens,
    group_ids,
    is_target,
    context: ContextFn = full_context,
    target_with_position: bool = False,
) -> list[tuple[Hashable, Hashable]]:
    """The (conditional text, target) pairs of one sequence under one plan.

    For each target ``i``: the conditional text is ``context(tokens, g < g[i], i)`` (by default the
    tokens of rank ``< g[i]`` with their positions); the target is ``x_i``, or ``(i, x_i)`` with
    ``target_with_position`` (the query stream of the model also knows where its target is).
    """
    tokens = np.asarray(tokens)
    group_ids = np.asarray(group_ids)
    is_target = np.asarray(is_target, dtype=bool)
    if not (tokens.shape == group_ids.shape == is_target.shape) or tokens.ndim != 1:
        raise ValueError(
            f"tokens, group_ids and is_target must be 1-D of one length, got {tokens.shape}, "
            f"{group_ids.shape}, {is_target.shape}"
        )
    pairs = []
    cache: dict[int, Hashable] = {}  # with the full context, targets of one rank share their text
    for i in np.flatnonzero(is_target).tolist():
        rank = int(group_ids[i])
        if context is full_context:
            if rank not in cache:
                cache[rank] = full_context(tokens, group_ids < rank, i)
            ctx = cache[rank]
        else:
            ctx = context(tokens, group_ids < rank, i)
        target = (i, int(tokens[i])) if target_with_position else int(tokens[i])
        pairs.append((ctx, target))
    return pairs


def exact_pairs(
    sequences,
    probs,
    objective: str,
    num_condition_tokens: int = 0,
    context: ContextFn = full_context,
    target_with_position: bool = False,
    **params,
) -> Iterable[tuple[Hashable, Hashable, float]]:
    """Weighted pairs ``(x, x+, P)`` of a finite data set under the exact plan distribution.

    ``sequences`` is a list of token sequences, ``probs`` their probabilities (summing to 1)."""
    if len(sequences) != len(probs):
        raise ValueError(f"got {len(sequences)} sequences but {len(probs)} probabilities")
    plans_by_length: dict[int, list] = {}
    for seq, p in zip(sequences, probs):
        seq = np.asarray(seq)
        n = len(seq)
        if n not in plans_by_length:
            plans_by_length[n] = plan_distribution(objective, n, num_condition_tokens, **params)
        for q, g, target in plans_by_length[n]:
            pairs = pairs_from_plan(seq, g, target, context, target_with_position)
            for ctx, tgt in pairs:
                yield ctx, tgt, p * q / len(pairs)


# --------------------------------------------------------------------------------------------
# matrices and spectra
# --------------------------------------------------------------------------------------------
@dataclass
class Cooccurrence:
    """``A[x, x+] = P(x, x+)`` (sparse, sums to 1) with the keys of its rows and columns."""

    matrix: sp.csr_matrix
    contexts: list
    targets: list

    @property
    def p_c(self) -> np.ndarray:
        """Marginal of the conditional texts, ``P_C``."""
        return np.asarray(self.matrix.sum(axis=1)).ravel()

    @property
    def p_g(self) -> np.ndarray:
        """Marginal of the target tokens, ``P_G``."""
        return np.asarray(self.matrix.sum(axis=0)).ravel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.matrix.shape


def cooccurrence_matrix(weighted_pairs: Iterable[tuple[Hashable, Hashable, float]]) -> Cooccurrence:
    """Sum the weights of equal ``(x, x+)`` pairs into a sparse matrix, normalised to sum 1."""
    row_of: dict[Hashable, int] = {}
    col_of: dict[Hashable, int] = {}
    rows, cols, vals = [], [], []
    for ctx, tgt, w in weighted_pairs:
        rows.append(row_of.setdefault(ctx, len(row_of)))
        cols.append(col_of.setdefault(tgt, len(col_of)))
        vals.append(w)
    if not vals:
        raise ValueError("no (conditional text, target) pairs: the data set or the plans have no targets")
    matrix = sp.coo_matrix((vals, (rows, cols)), shape=(len(row_of), len(col_of)), dtype=np.float64).tocsr()
    matrix.sum_duplicates()
    total = matrix.sum()
    if not total > 0:
        raise ValueError("the pair weights sum to zero")
    return Cooccurrence(matrix / total, list(row_of), list(col_of))


def normalised_matrix(co: Cooccurrence) -> sp.csr_matrix:
    """``Ā[x, x+] = P(x, x+) / sqrt(P_C(x) P_G(x+))``."""
    return (sp.diags(1.0 / np.sqrt(co.p_c)) @ co.matrix @ sp.diags(1.0 / np.sqrt(co.p_g))).tocsr()


def spectrum(abar, k: int | None = None, method: str = "auto", dense_limit: int = 3000) -> np.ndarray:
    """Singular values of ``abar``, largest first.

    - ``dense``: LAPACK SVD of the dense matrix (exact, small matrices);
    - ``gram``: eigenvalues of the Gram matrix of the smaller side (``ĀᵀĀ`` is only vocab x vocab
      for token targets), exact for every singular value above ~1e-7 (squaring loses the rest);
    - ``svds``: ARPACK sparse SVD of the ``k`` largest;
    - ``auto``: ``dense`` when both sides are <= ``dense_limit``, else ``gram`` when the smaller
      side is, else ``svds`` (``k`` defaults to 200 there).
    """
    abar = sp.csr_matrix(abar)
    small = min(abar.shape)
    if method == "auto":
        method = "dense" if max(abar.shape) <= dense_limit else "gram" if small <= dense_limit else "svds"
    if method == "dense":
        values = np.linalg.svd(abar.toarray(), compute_uv=False)
    elif method == "gram":
        gram = (abar.T @ abar) if abar.shape[1] <= abar.shape[0] else (abar @ abar.T)
        eig = np.linalg.eigvalsh(gram.toarray())[::-1]
        values = np.sqrt(np.clip(eig, 0.0, None))
    elif method == "svds":
        k = min(k or 200, small - 1)
        if k < 1:
            raise ValueError(f"svds needs a matrix with both sides >= 2, got {abar.shape}")
        values = np.sort(spla.svds(abar, k=k, return_singular_vectors=False, random_state=0))[::-1]
    else:
        raise ValueError(f"method must be auto, dense, gram or svds, got {method!r}")
    return values[:k] if k is not None else values


# --------------------------------------------------------------------------------------------
# Theorem 3.1: spectral loss == low-rank factorisation of Ā, up to a constant
# --------------------------------------------------------------------------------------------
def spectral_loss(co: Cooccurrence, f: np.ndarray, g: np.ndarray) -> float:
    """Paper (a) Eq. 1, as an expectation over pairs:
    ``L = -2 E_{(x,x+)~P}[f(x)ᵀ g(x+)] + E_{x~P_C, x+~P_G}[(f(x)ᵀ g(x+))²]``.

    ``f`` has one row per conditional text (``co.contexts``), ``g`` one per target (``co.targets``).
    """
    _check_features(co, f, g)
    a = co.matrix.tocoo()
    positive = np.einsum("nd,nd->n", f[a.row], g[a.col]) @ a.data
    scores = f @ g.T  # independent pairs: every (x, x+) with mass P_C(x) P_G(x+)
    negative = co.p_c @ (scores**2) @ co.p_g
    return float(-2.0 * positive + negative)


def factorisation_loss(co: Cooccurrence, f: np.ndarray, g: np.ndarray) -> float:
    """``‖Ā − F W'ᵀ‖²_F`` with ``F = diag(sqrt(P_C)) f`` and ``W' = diag(sqrt(P_G)) g``."""
    _check_features(co, f, g)
    big_f = np.sqrt(co.p_c)[:, None] * f
    big_w = np.sqrt(co.p_g)[:, None] * g
    return float(np.linalg.norm(normalised_matrix(co).toarray() - big_f @ big_w.T) ** 2)


def _check_features(co: Cooccurrence, f: np.ndarray, g: np.ndarray) -> None:
    n_c, n_g = co.shape
    if f.ndim != 2 or g.ndim != 2 or f.shape[0] != n_c or g.shape[0] != n_g or f.shape[1] != g.shape[1]:
        raise ValueError(f"f must be ({n_c}, d) and g ({n_g}, d) with one d; got {f.shape} and {g.shape}")


def check_theorem_31(co: Cooccurrence, dim: int = 8, seed: int = 0, scale: float = 1.0) -> dict:
    """Draw random ``f, g`` and compare both sides of Theorem 3.1:
    ``L(f, g) = ‖Ā − F W'ᵀ‖²_F − ‖Ā‖²_F``."""
    rng = np.random.default_rng(seed)
    f = scale * rng.standard_normal((co.shape[0], dim))
    g = scale * rng.standard_normal((co.shape[1], dim))
    loss = spectral_loss(co, f, g)
    factorisation = factorisation_loss(co, f, g)
    constant = float(sp.linalg.norm(normalised_matrix(co)) ** 2)
    diff = abs(loss - (factorisation - constant))
    return {
        "spectral_loss": loss,
        "factorisation": factorisation,
        "constant": constant,
        "abs_diff": diff,
        "rel_diff": diff / max(abs(loss), abs(factorisation), 1e-300),
        "shape": co.shape,
    }


def effective_rank(values: np.ndarray, tol: float = 1e-9) -> int:
    return int(np.sum(np.asarray(values) > tol))
