"""The theory of paper (a) as code: co-occurrence matrices of (conditional text, target) pairs,
their spectra, and the checks of Theorems 3.1 and 4.2. See docs/theory.md.

Submodules, one job each: :mod:`.cooccurrence` (pairs, matrices, spectra, spectral loss),
:mod:`.toy` (the toy model of §4.1.2 and its closed form), :mod:`.text` (real text),
:mod:`.connectivity` (the Fig. 2 surrogate for checkpoints). ``hf-lookaround theory`` lives in
:mod:`hf_lookaround.cli.theory`.
"""

from .cooccurrence import (
    Cooccurrence,
    check_theorem_31,
    cooccurrence_matrix,
    exact_pairs,
    factorisation_loss,
    full_context,
    normalised_matrix,
    pairs_from_plan,
    plan_distribution,
    spectral_loss,
    spectrum,
)
from .toy import ToyData, closed_form_spectrum, derived_spectrum, spectrum_bands, toy_cooccurrence, toy_dataset

__all__ = [
    "Cooccurrence",
    "check_theorem_31",
    "cooccurrence_matrix",
    "exact_pairs",
    "factorisation_loss",
    "full_context",
    "normalised_matrix",
    "pairs_from_plan",
    "plan_distribution",
    "spectral_loss",
    "spectrum",
    "ToyData",
    "closed_form_spectrum",
    "derived_spectrum",
    "spectrum_bands",
    "toy_cooccurrence",
    "toy_dataset",
]
