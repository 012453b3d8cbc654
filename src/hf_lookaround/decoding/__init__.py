"""Decoding, the one import point: ``from hf_lookaround.decoding import group_generate, infill, ...``.

Every decoder is a :class:`DecodingStrategy` (``check`` what the checkpoint was trained for, ``decode`` a prompt)
that ``model.generate(...)`` runs: ``group_size=t`` (group decoding), ``draft_group_size=k`` (self-speculative
decoding), ``decoding=Infilling(...)`` (any-order infilling of masked and GVP checkpoints),
``decoding=DiffusionDecoding(...)`` or ``diffusion_threshold=p`` / ``diffusion_steps=s`` (block-wise masked diffusion
of mdlm and bd3lm checkpoints). The strategies of ``generate()`` live in the model bundle (``models/lookaround/``:
``generation_lookaround``, ``speculation_lookaround``, ``diffusion_lookaround``, ``decoding_lookaround``,
``layout_lookaround``), because a checkpoint loaded with ``trust_remote_code`` runs them without this package; the package adds infilling (:mod:`.infill`) and image sampling (:mod:`.images`).
"""

from ..models.lookaround.decoding_lookaround import (
    LEGACY_GROUP_DECODING_OBJECTIVES,
    DecodingStrategy,
    StopTracker,
    UntrainedDecodingError,
    build_output,
    check_group_size,
    default_group_size,
    is_block_diffusion_model,
    is_one_stream_group_model,
    make_logits_processor,
    process_and_pick,
    trained_group_sizes,
)
from ..models.lookaround.diffusion_lookaround import (
    DiffusionDecoding,
    GenerateDiffusionOutput,
    decodes_by_diffusion,
    diffusion_block_of,
    diffusion_ranks,
)
from ..models.lookaround.generation_lookaround import (
    DecodingOptions,
    GroupDecoding,
    GroupDecodingMixin,
    check_decoder,
    decoding_strategy,
    group_decoding,
    group_generate,
)
from ..models.lookaround.layout_lookaround import one_stream_next_token_layouts, one_stream_prompt, semi_ar_ranks
from ..models.lookaround.speculation_lookaround import (
    SPECULATION_BREAK_EVEN,
    GenerateSpeculativeOutput,
    SpeculativeDecoding,
    check_draft_group_size,
)
from .infill import Infilling, InfillOutput, commit_schedule, infill

__all__ = [
    "DecodingStrategy", "DecodingOptions", "GroupDecoding", "SpeculativeDecoding", "Infilling", "GroupDecodingMixin",
    "group_generate", "group_decoding", "infill", "InfillOutput", "commit_schedule", "sample_images",
    "UntrainedDecodingError", "trained_group_sizes", "default_group_size", "check_group_size",
    "check_draft_group_size", "check_decoder", "decoding_strategy", "is_one_stream_group_model",
    "is_block_diffusion_model",
    "LEGACY_GROUP_DECODING_OBJECTIVES", "SPECULATION_BREAK_EVEN", "GenerateSpeculativeOutput",
    "make_logits_processor", "process_and_pick", "StopTracker", "build_output", "semi_ar_ranks",
    "one_stream_prompt", "one_stream_next_token_layouts", "DiffusionDecoding", "GenerateDiffusionOutput",
    "decodes_by_diffusion", "diffusion_block_of", "diffusion_ranks",
]


def __getattr__(name):
    # image sampling imports the ViT: only when asked for
    if name in ("sample_images", "save_image_grid"):
        from . import images

        return getattr(images, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
