"""Group decoding from the package: the model bundle's API, what ``generate(group_size=t)`` runs
(:mod:`hf_lookaround.models.lookaround.generation_lookaround`). Any-order infilling is in
:mod:`hf_lookaround.decoding.infill`."""

from __future__ import annotations

from .models.lookaround.generation_lookaround import (  # noqa: F401  (the group decoding API, re-exported)
    SPECULATION_BREAK_EVEN,
    GenerateSpeculativeOutput,
    GroupDecodingMixin,
    UntrainedDecodingError,
    check_draft_group_size,
    check_group_size,
    default_group_size,
    group_decoding,
    group_generate,
    make_logits_processor,
    semi_ar_ranks,
    trained_group_sizes,
)
