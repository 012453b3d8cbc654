"""The toy data of paper (a) §4.1.2 and the closed form of its Theorem 4.2.

The paper's text leaves the construction open in places, so here it is exactly.

**Construction** ``toy_dataset(r, s, tokens_per_slot=k, shared_per_slot=o, bos=False)``:

- ``r`` classes, uniform; every sample has ``s`` tokens at positions ``0..s-1``;
- each (class ``y``, position ``p``) *slot* owns a token set ``T[y, p]`` of ``k`` token ids;
  sets of different positions never share tokens;
- a sample of class ``y`` draws its token at position ``p`` uniformly from ``T[y, p]``,
  independently across positions (``k = 1``: the sample is the fixed sequence of the class);
- ``o = 0``: sets of different classes are disjoint. ``o > 0``: ``T[y, p]`` shares its last ``o``
  tokens with the first ``o`` of ``T[y+1 mod r, p]`` (classes overlap: the theorem's premise fails);
- ``bos``: a begin token at position 0, a condition token of rank 0 (``num_condition_tokens=1``):
  ``"shared"`` (or ``True``) one token for all classes, ``"class"`` one token per class (a class
  prompt).

The data set is enumerated exactly (``r k^s`` samples) and so are the plans (see
:func:`~hf_lookaround.theory.cooccurrence.plan_distribution`), so the co-occurrence matrix is
exact: no sampling.

**What one can prove for this construction** (``o = 0``, any ``k``), with the plans of this
package. Given the class, the target is independent of the visible tokens, so ``Ā`` is, class by
class, a block whose values depend only on the plan's positions; ``k`` only tensors it with a
rank-one block and leaves the singular values unchanged.

- masked with ``m = expected_masked_count(ρ, s)`` targets (``1 <= m <= s-1``): within a class,
  ``ĀᵀĀ = a I + b J`` over the ``s`` target positions with ``a = (s-m) / (m (s-1))`` and
  ``a + b s = 1``. So ``σ = 1`` (``r`` times) and ``σ = sqrt((s-m) / (m (s-1)))`` (``r(s-1)``
  times): the paper's ``sqrt(s(1-ρ) / (sρ(s-1)))`` with ``ρ = m/s``. It equals the closed form
  at the nominal ρ only when ``ρ s`` is an integer.
- AR: every prefix fixes the class and position, so every target has its own conditional text:
  ``σ = 1`` ``r(s-1)`` times (position 0 is never a target: it has no conditional text), then 0.
  With a shared ``bos`` the first token is predicted from the begin token, one conditional text
  for all classes: ``r(s-1) + 1`` ones. Either way AR has *fewer* than the ``rs`` ones of the
  closed form. With a class ``bos`` the first token's conditional text fixes the class too, AR
  has ``rs`` ones and masked is unchanged: **under this construction Theorem 4.2 holds in full**.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from ..plans import expected_masked_count
from .cooccurrence import Cooccurrence, cooccurrence_matrix, exact_pairs

__all__ = [
    "ToyData",
    "toy_dataset",
    "toy_cooccurrence",
    "closed_form_spectrum",
    "derived_spectrum",
    "spectrum_bands",
    "MAX_TOY_SAMPLES",
]

MAX_TOY_SAMPLES = 50_000


@dataclass
class ToyData:
    sequences: np.ndarray  # (N, s or s+1) token ids
    probs: np.ndarray  # (N,) sums to 1
    labels: np.ndarray  # (N,) class ids
    r: int
    s: int
    num_condition_tokens: int

    def __len__(self) -> int:
        return len(self.sequences)


def toy_dataset(
    r: int, s: int, tokens_per_slot: int = 1, shared_per_slot: int = 0, bos: bool | str = False
) -> ToyData:
    """Enumerate the toy data set described in the module docstring."""
    k, o = tokens_per_slot, shared_per_slot
    if r < 1 or s < 2:
        raise ValueError(f"need r >= 1 classes and length s >= 2, got r={r}, s={s}")
    if k < 1 or not 0 <= o < k:
        raise ValueError(f"need tokens_per_slot >= 1 and 0 <= shared_per_slot < tokens_per_slot, got {k}, {o}")
    if r * k**s > MAX_TOY_SAMPLES:
        raise ValueError(f"r * tokens_per_slot**s = {r * k**s} samples is too many to enumerate; lower s or k")
    bos = "shared" if bos is True else (bos or "none")
    if bos not in ("none", "shared", "class"):
        raise ValueError(f"bos must be False, True, 'none', 'shared' or 'class', got {bos!r}")
    stride = k - o  # tokens a class adds per position; consecutive classes share o tokens
    per_position = r * stride

    def slot(y: int, p: int) -> list[int]:
        return [p * per_position + (y * stride + u) % per_position for u in range(k)]

    sequences, labels = [], []
    for y in range(r):
        begin = {"none": [], "shared": [s * per_position], "class": [s * per_position + y]}[bos]
        for choice in itertools.product(*(slot(y, p) for p in range(s))):
            sequences.append(begin + list(choice))
            labels.append(y)
    n = len(sequences)
    return ToyData(np.array(sequences), np.full(n, 1.0 / n), np.array(labels), r, s, 0 if bos == "none" else 1)


def toy_cooccurrence(data: ToyData, objective: str, target_with_position: bool = False, **params) -> Cooccurrence:
    """The exact co-occurrence matrix of ``data`` under ``objective``'s plan distribution."""
    pairs = exact_pairs(
        list(data.sequences),
        data.probs,
        objective,
        num_condition_tokens=data.num_condition_tokens,
        target_with_position=target_with_position,
        **params,
    )
    return cooccurrence_matrix(pairs)


def closed_form_spectrum(r: int, s: int, objective: str, rho: float | None = None) -> np.ndarray:
    """Theorem 4.2 as stated in paper (a): the first ``rs`` singular values (0 beyond).

    ``σ_j = 1`` for ``j <= r``; for ``r < j <= rs`` AR has 1 and masked SSL has
    ``sqrt(s(1-ρ) / (sρ(s-1)))``."""
    if objective == "ar":
        return np.ones(r * s)
    if objective == "mlm":
        if rho is None or not 0 < rho < 1:
            raise ValueError(f"the masked closed form needs 0 < rho < 1, got {rho}")
        tail = np.sqrt(s * (1 - rho) / (s * rho * (s - 1)))
        return np.concatenate([np.ones(r), np.full(r * (s - 1), tail)])
    raise ValueError(f"Theorem 4.2 covers 'ar' and 'mlm', got {objective!r}")


def derived_spectrum(r: int, s: int, objective: str, rho: float | None = None, bos: bool | str = False) -> np.ndarray:
    """The nonzero singular values this package's plans give on the toy data (module docstring)."""
    if objective == "ar":
        bos = "shared" if bos is True else (bos or "none")
        return np.ones(r * (s - 1) + {"none": 0, "shared": 1, "class": r}[bos])
    if objective == "mlm":
        m = expected_masked_count(rho, s)
        if m >= s:  # everything masked: one empty conditional text for all targets
            return np.ones(1)
        return np.concatenate([np.ones(r), np.full(r * (s - 1), np.sqrt((s - m) / (m * (s - 1))))])
    raise ValueError(f"derived spectra cover 'ar' and 'mlm', got {objective!r}")


def spectrum_bands(values: np.ndarray, reference: np.ndarray, r: int, s: int) -> list[dict]:
    """Compare ``values`` with ``reference`` (both padded with zeros) band by band:
    ``j <= r``, ``r < j <= r(s-1)``, ``r(s-1) < j <= rs``, ``rs < j`` (1-based ``j``)."""
    width = max(len(values), len(reference), r * s + 1)
    v = np.zeros(width)
    ref = np.zeros(width)
    v[: len(values)] = values
    ref[: len(reference)] = reference
    bands = [("j <= r", 0, r), ("r < j <= r(s-1)", r, r * (s - 1)), ("r(s-1) < j <= rs", r * (s - 1), r * s)]
    bands.append(("j > rs", r * s, width))
    rows = []
    for name, lo, hi in bands:
        if hi <= lo:
            continue
        diff = np.abs(v[lo:hi] - ref[lo:hi]).max()
        rows.append(
            {
                "band": name,
                "count": hi - lo,
                "computed": _range(v[lo:hi]),
                "closed_form": _range(ref[lo:hi]),
                "max_abs_diff": float(diff),
                "match": bool(diff < 1e-8),
            }
        )
    return rows


def _range(x: np.ndarray) -> str:
    lo, hi = float(x.min()), float(x.max())
    return f"{lo:.6f}" if abs(hi - lo) < 1e-9 else f"{lo:.6f} .. {hi:.6f}"
