"""Decoding from the package: group decoding (the model bundle's, what ``generate(group_size=t)`` runs) and the
checks of any-order infilling (``decoding/infill.py``), which read what a checkpoint was trained for from the
objectives table."""

from __future__ import annotations

import logging

from . import objectives
from .models.lookaround.generation_lookaround import (  # noqa: F401  (the group decoding API, re-exported)
    GroupDecodingMixin,
    UntrainedDecodingError,
    _backbone_and_head,
    _check_length,
    _device,
    _pick,
    _refuse_or_warn,
    check_group_size,
    group_decoding,
    group_generate,
    make_logits_processor,
    semi_ar_ranks,
    trained_group_sizes,
)

logger = logging.getLogger(__name__)

ORDERS = ("confidence", "random", "left_to_right")
SCHEDULES = ("cosine", "linear")


def check_infill_objective(config, allow_untrained: bool = False) -> None:
    """Infilling shows every visible token at rank 0 (bidirectional content), as masked and GVP pretraining do."""
    objective = getattr(config, "objective", None)
    if objective is None:
        logger.warning("the config records no pretraining objective: cannot check that it was trained to infill")
    elif objectives.INFILLING not in (objectives.decoders(objective, getattr(config, "plan_params", None)) or ()):
        _refuse_or_warn(f"this checkpoint was pretrained with the {objective!r} objective, whose content stream never "
                        "saw a bidirectional context: continue text with group decoding "
                        "(model.generate(..., group_size=t)) instead of infilling", allow_untrained)
