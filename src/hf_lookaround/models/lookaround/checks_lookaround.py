"""Input checks of the LookAround models: each forward calls one ``check_*`` here at its top, so that the
forward itself reads as the data path (as masks live in ``masking_lookaround``).

Every check raises a one-line ``ValueError`` that says what to fix. Checks of values (not shapes) need a host
sync, so they are skipped inside a compiled graph; a compiled step relies on its collator.
"""

from __future__ import annotations

import torch

from .configuration_lookaround import ATTENTION_PATTERNS
from .masking_lookaround import NO_TARGET_RANK, cache_lengths, check_row_kind

PLAN_INPUTS = ("group_ids", "target_positions", "query_group_ids", "query_position_ids")


def _skip_values(tensor: torch.Tensor) -> bool:
    """Value checks need a host sync: skipped inside a compiled graph (and for empty tensors)."""
    return torch.compiler.is_compiling() or tensor.numel() == 0


# ----------------------------------------------------------------------------------------------
# The backbone (LookAroundModel)
# ----------------------------------------------------------------------------------------------
def check_backbone_inputs(config, *, input_ids, inputs_embeds, attention_mask, group_ids, target_positions,
                          position_ids, attention_pattern, query_position_ids, query_group_ids,
                          past_key_values=None, row_kind=None, output_attentions=False) -> None:
    """Everything `LookAroundModel.forward` (and `prepare_attention`) takes, checked before any work."""
    check_embedding_inputs(config, input_ids, inputs_embeds)
    batch, seq_len = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    past_len, key_len = cache_lengths(past_key_values, seq_len)
    explicit_rows = query_position_ids is not None or query_group_ids is not None
    if explicit_rows and (query_position_ids is None or query_group_ids is None):
        raise ValueError("pass query_position_ids and query_group_ids together: the position and rank of each query row")
    if explicit_rows and target_positions is not None:
        raise ValueError("pass either target_positions or query_position_ids/query_group_ids, not both")
    if group_ids is None and target_positions is not None:
        raise ValueError("target_positions select query-stream rows and need group_ids (a plan)")
    pattern = attention_pattern or config.default_attention
    if group_ids is None and attention_pattern is None and pattern == "block_diffusion":
        # a row of plain ids of even length would be read as the two halves, silently
        raise ValueError("this checkpoint is BD3-LM's one-stream form: its backbone reads the layout x_t ⊕ x_0 only "
                         "when asked, attention_pattern='block_diffusion'; to read plain ids pass another pattern "
                         "(e.g. 'bidirectional'), or take features with features_lookaround.token_states")
    if group_ids is None and pattern == "block_diffusion":
        if seq_len % 2 or key_len != seq_len:
            raise ValueError(f"the block_diffusion pattern reads BD3-LM's one-stream layout x_t ⊕ x_0 (the noised "
                             f"sequence, then the clean one, each T tokens) without a cache: got {seq_len} tokens "
                             f"and {int(past_len)} cached; decode with generate(diffusion_threshold=...)")
        check_total_length(past_len, seq_len // 2, config.max_position_embeddings)  # both copies share positions
    else:
        check_total_length(past_len, seq_len, config.max_position_embeddings)
    if attention_mask is not None:
        check_key_width(attention_mask, batch, past_len, seq_len, key_len, lambda: (
            f"attention_mask must have shape ({batch}, {int(past_len) + seq_len}) (past + current tokens), "
            f"got {tuple(attention_mask.shape)}"))
    if position_ids is not None and position_ids.shape != (batch, seq_len) and position_ids.shape[-1] != seq_len:
        raise ValueError(f"position_ids must have shape ({batch}, {seq_len})")
    if group_ids is None and pattern not in ATTENTION_PATTERNS:
        raise ValueError(f"attention_pattern must be one of {ATTENTION_PATTERNS}, got {pattern!r}")
    if group_ids is not None:
        expected = seq_len if isinstance(past_len, int) and past_len == 0 else f"past_len + {seq_len}"
        check_key_width(group_ids, batch, past_len, seq_len, key_len, lambda: (
            f"group_ids must have the shape of the input, ({batch}, {expected}): a rank for every cached "
            f"and current token (past_len = {int(past_len)}); got {tuple(group_ids.shape)}"))
        check_rank_dtype("group_ids", group_ids)
    if target_positions is not None:
        check_target_positions(target_positions, batch, seq_len)
    if explicit_rows:
        check_explicit_rows(query_position_ids, query_group_ids, batch, config.max_position_embeddings)
    if row_kind is not None:
        # one mask per row kind, the same for every batch: no plan, padding, cache or attention weights
        if (group_ids is not None or explicit_rows or attention_mask is not None or key_len != seq_len
                or pattern != "block_causal" or output_attentions):
            raise ValueError("row_kind (a one-stream mixture batch) needs a block-causal config "
                             "(default_attention='block_causal') and a batch without attention_mask, cache or plan")
        check_row_kind(row_kind, batch)


def check_embedding_inputs(config, input_ids, inputs_embeds) -> None:
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids or inputs_embeds")
    if input_ids is not None:
        check_token_ids(input_ids, "input_ids", config.vocab_size)
    elif inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(f"inputs_embeds must have shape (batch, seq_len, {config.hidden_size}), "
                         f"got {tuple(inputs_embeds.shape)}")


def check_token_ids(ids: torch.Tensor, name: str, vocab_size: int) -> None:
    if ids.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, seq_len), got {tuple(ids.shape)}")
    if _skip_values(ids):
        return
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{name} holds ids outside the vocabulary [0, {vocab_size}): min {int(ids.min())}, "
                         f"max {int(ids.max())}; check the tokenizer matches the model")


def check_total_length(past_len, seq_len: int, limit: int) -> None:
    if torch.compiler.is_compiling() or torch.is_tensor(past_len):
        # needs a host sync; generate() checks the final length before it starts. A static cache (a tensor
        # past_len) is bounded by its own slots, which may hold more than positions: self-speculative decoding
        # appends padded drafts past the last position, and leaves holes of rejected ones
        return
    total_len = int(past_len) + seq_len
    if total_len > limit:
        raise ValueError(f"sequence length {total_len} exceeds max_position_embeddings={limit}; split or shorten "
                         "the input (nothing is truncated for you)")


def check_key_width(tensor, batch, past_len, seq_len, key_len, message) -> None:
    """A key-indexed input covers the cached and current tokens (a static cache: up to all its slots). `message`
    is built only on failure: with a static cache `past_len` is a tensor, and reading it breaks a compiled graph."""
    width = tensor.shape[-1]
    if tensor.dim() != 2 or tensor.shape[0] != batch or width > key_len or (
        not torch.compiler.is_compiling() and width not in (key_len, int(past_len) + seq_len)
    ):
        raise ValueError(message())


def check_rank_dtype(name: str, ranks: torch.Tensor) -> None:
    """Ranks are integers: a float tensor would be cut to integers silently (0.5 -> 0) by `.long()`."""
    if ranks.dtype.is_floating_point or ranks.dtype.is_complex or ranks.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer (long) tensor of group ranks, got dtype {ranks.dtype}: a "
                         f"{ranks.dtype} rank would be truncated; build it as integers (torch.long)")


def check_target_positions(target_positions: torch.Tensor, batch: int, seq_len: int) -> None:
    if target_positions.dim() != 2 or target_positions.shape[0] != batch:
        raise ValueError(f"target_positions must have shape ({batch}, M), got {tuple(target_positions.shape)}")
    if _skip_values(target_positions):
        return
    if target_positions.min() < -1 or target_positions.max() >= seq_len:
        raise ValueError(f"target_positions must lie in [0, {seq_len}) or be -1 for padding")


def check_explicit_rows(query_position_ids, query_group_ids, batch: int, limit: int) -> None:
    if query_position_ids.dim() != 2 or query_position_ids.shape[0] != batch or \
            query_group_ids.shape != query_position_ids.shape:
        raise ValueError(f"query_position_ids and query_group_ids must both have shape ({batch}, M); got "
                         f"{tuple(query_position_ids.shape)} and {tuple(query_group_ids.shape)}")
    check_rank_dtype("query_group_ids", query_group_ids)
    check_rank_dtype("query_position_ids", query_position_ids)
    is_slot = query_group_ids != NO_TARGET_RANK
    if torch.compiler.is_compiling() or not is_slot.any():
        return
    used = query_position_ids[is_slot.to(query_position_ids.device)]
    if used.min() < 0 or used.max() >= limit:
        raise ValueError(f"query_position_ids must lie in [0, max_position_embeddings={limit}) where query_group_ids "
                         f"is not {NO_TARGET_RANK}; got positions from {int(used.min())} to {int(used.max())}")
    if query_group_ids.min() < NO_TARGET_RANK:
        raise ValueError(f"query_group_ids must be ranks >= 0, or {NO_TARGET_RANK} for a padding slot")


# ----------------------------------------------------------------------------------------------
# The heads
# ----------------------------------------------------------------------------------------------
def check_labels(labels: torch.Tensor, vocab_size: int, shape=None) -> None:
    """Labels are token ids in [0, vocab) or -100 (no loss), of the input's `shape` if given."""
    if shape is not None and labels.shape != shape:
        raise ValueError(f"labels must have shape {tuple(shape)}, got {tuple(labels.shape)}")
    if _skip_values(labels):
        return
    bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        raise ValueError(f"labels must be token ids in [0, {vocab_size}) or -100 (no loss); found "
                         f"{sorted(set(labels[bad].tolist()))[:5]}")


def refuse_plan_inputs(model, kwargs: dict) -> None:
    """The single-stream heads (text and image classification too) take no plan: a `group_ids` passed to them would
    be swallowed by `**kwargs`."""
    given = [name for name in PLAN_INPUTS if kwargs.get(name) is not None]
    if given:
        raise ValueError(f"{type(model).__name__} takes no {', '.join(given)} (it would ignore them): a plan is "
                         "read by the pretraining head (AutoModelForPreTraining); load the checkpoint with that "
                         "head, or drop them")


def check_single_stream_head_inputs(model, kwargs: dict, input_ids, inputs_embeds, labels, row_kind=None) -> None:
    """The causal, masked LM and classification heads: no plan, and labels over the input tokens. A one-stream
    mixture batch (`row_kind`) is for a single-stream checkpoint."""
    refuse_plan_inputs(model, kwargs)
    if row_kind is not None and model.config.prediction_stream == "query":
        raise ValueError("row_kind (a one-stream mixture batch) needs a single-stream checkpoint "
                         "(prediction_stream='content'); this one predicts with the query stream")
    if labels is not None:
        shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        check_labels(labels, model.config.vocab_size, shape)


def check_pretraining_inputs(config, input_ids, inputs_embeds, group_ids, labels, query_position_ids,
                             query_group_ids, query_target_ids) -> None:
    """`LookAroundForPreTraining`: a plan, and its targets either as labels over the input tokens or as
    `query_target_ids` of explicit query rows (the backbone checks the rest)."""
    if group_ids is None:
        raise ValueError("LookAroundForPreTraining needs group_ids (a plan); collators in hf_lookaround emit them")
    explicit_rows = query_position_ids is not None or query_group_ids is not None
    if query_target_ids is not None:
        if not explicit_rows or labels is not None:
            raise ValueError("query_target_ids are the tokens of explicit query rows (query_position_ids/"
                             "query_group_ids); with labels over the input tokens pass labels instead")
        if query_target_ids.shape != query_group_ids.shape:
            raise ValueError(f"query_target_ids must have the shape of query_group_ids "
                             f"{tuple(query_group_ids.shape)}, got {tuple(query_target_ids.shape)}")
        check_labels(query_target_ids, config.vocab_size)
    if labels is not None:
        if explicit_rows:
            raise ValueError("labels index the input tokens; with explicit query rows compute the loss from logits")
        check_labels(labels, config.vocab_size, (input_ids if input_ids is not None else inputs_embeds).shape[:2])


def check_masked_lm_query_inputs(config, input_ids, labels) -> None:
    """A two-stream masked LM predicts where the mask token is (or labels are): it needs ids or labels."""
    if input_ids is None and labels is None:
        raise ValueError("this two-stream checkpoint (prediction_stream='query') predicts the positions holding the "
                         "mask token or carrying labels: pass input_ids (or labels), not only inputs_embeds")
    if input_ids is not None and config.mask_token_id is None:
        raise ValueError("this two-stream checkpoint (prediction_stream='query') fills the positions holding the mask "
                         "token, but config.mask_token_id is None: set it to the tokenizer's mask_token_id")


def check_next_token_view_inputs(config, input_ids, attention_mask, **given) -> None:
    """dar's one-stream causal view of plain token ids lays out its own rows, positions and masks and keeps no
    cache: it takes `input_ids` and an `attention_mask` only (`given`: the other inputs, by name)."""
    given = [name for name, value in given.items() if value is not None and value is not False]
    if given:
        raise ValueError(f"dar's one-stream causal view takes input_ids (and an attention_mask) only, not "
                         f"{', '.join(given)}: it lays out its own rows, positions and masks; pass inputs already "
                         "laid out with one_stream_layout=True, or decode with generate()")
    if config.bos_token_id is None:
        raise ValueError("dar's one-stream form lays out every row after BOS copies, but config.bos_token_id is "
                         "None: set it to the tokenizer's bos_token_id")
    if input_ids.shape[1] > config.n_positions:
        raise ValueError(f"{input_ids.shape[1]} tokens are more than this checkpoint's causal view takes "
                         f"(config.n_positions = {config.n_positions}: max_position_embeddings less its "
                         "start rows and a BOS); split or shorten the input (nothing is truncated for you)")
    if attention_mask is not None:
        real = attention_mask != 0
        run = real.long().diff(dim=-1, prepend=torch.zeros_like(real[:, :1], dtype=torch.long))
        if bool((run > 0).long().sum(-1).gt(1).any()):
            raise ValueError("the attention_mask must mark one run of real tokens per row (left or right padding)")


def check_class_labels(labels: torch.Tensor, num_labels: int) -> None:
    """Single-label classification: class ids in [0, num_labels)."""
    if _skip_values(labels):
        return
    if labels.min() < 0 or labels.max() >= num_labels:
        raise ValueError(f"class labels must lie in [0, {num_labels}), got {labels.unique().tolist()}")


# ----------------------------------------------------------------------------------------------
# The vision model (LookAroundViT*): patches, condition tokens, an image plan, the visual tokenizer
# ----------------------------------------------------------------------------------------------
def check_vit_inputs(config, *, pixel_values, input_ids, group_ids, target_positions, class_labels,
                     condition_embeds) -> None:
    """Everything `LookAroundViTModel.forward` takes, checked before any work (the backbone checks its own inputs)."""
    batch = check_patch_inputs(config, pixel_values, input_ids)
    check_condition_inputs(config, batch, class_labels, condition_embeds)
    if group_ids is not None:
        check_image_plan(group_ids, target_positions, (batch, config.sequence_length), config.num_prefix_tokens)


def check_patch_inputs(config, pixel_values, input_ids) -> int:
    """The patches come from pixels (p2p, p2d; d2d tokenises them) or from visual-token ids (d2d). Returns the batch."""
    mode = config.target_mode
    if mode != "d2d":
        if input_ids is not None:
            raise ValueError(f"target_mode {mode!r} reads pixels: pass pixel_values, not input_ids")
        if pixel_values is None:
            raise ValueError("LookAroundViTModel needs pixel_values of shape (batch, channels, height, width)")
    elif (pixel_values is None) == (input_ids is None):
        raise ValueError("target_mode 'd2d' reads visual tokens: pass exactly one of input_ids (batch, "
                         "num_patches) or pixel_values (tokenised with the model's codebook)")
    if pixel_values is not None:
        check_pixel_values(pixel_values, config)
        return pixel_values.shape[0]
    check_visual_token_ids(input_ids, config.codebook_size, "input_ids (visual tokens)", config.num_patches)
    return input_ids.shape[0]


def check_pixel_values(pixel_values: torch.Tensor, config) -> None:
    c, s = config.num_channels, config.image_size
    if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, s, s):
        raise ValueError(
            f"pixel_values must have shape (batch, {c}, {s}, {s}) (num_channels, image_size, image_size of the "
            f"config), got {tuple(pixel_values.shape)}; resize the images or build a config for their size"
        )


def check_visual_token_ids(ids: torch.Tensor, codebook_size: int, name: str = "visual-token ids",
                           num_patches: int | None = None) -> None:
    """Visual tokens are integer ids in [0, codebook_size); as a model input, one per patch."""
    if num_patches is not None and (ids.dim() != 2 or ids.shape[1] != num_patches or ids.is_floating_point()):
        raise ValueError(f"{name} must be integer ids of shape (batch, {num_patches}) (one per patch), "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    if _skip_values(ids):
        return
    if ids.min() < 0 or ids.max() >= codebook_size:
        raise ValueError(f"{name} must lie in [0, {codebook_size}) (codebook_size), got ids from "
                         f"{int(ids.min())} to {int(ids.max())}")


def check_condition_inputs(config, batch: int, class_labels, condition_embeds) -> None:
    """The condition tokens carry a class (`class_labels`, -1: none; needs a class table) or given embeddings
    (`condition_embeds`), never both; a model without condition tokens takes neither."""
    n_cond, hidden = config.num_condition_tokens, config.hidden_size
    if not n_cond:
        if class_labels is not None or condition_embeds is not None:
            raise ValueError("class_labels / condition_embeds need condition tokens: this model has "
                             "num_condition_tokens=0 (set it, and num_condition_classes, in the config)")
        return
    if class_labels is not None and condition_embeds is not None:
        raise ValueError("pass either class_labels or condition_embeds for the condition tokens, not both")
    if condition_embeds is not None:
        if condition_embeds.dim() != 3 or tuple(condition_embeds.shape) != (batch, n_cond, hidden):
            raise ValueError(f"condition_embeds must have shape ({batch}, {n_cond}, {hidden}) (batch, "
                             f"num_condition_tokens, hidden_size), got {tuple(condition_embeds.shape)}")
        return
    if class_labels is None:
        raise ValueError(
            f"this model has {n_cond} condition token(s): pass class_labels (batch,) (-1 for no class) or "
            f"condition_embeds ({batch}, {n_cond}, {hidden})"
        )
    if not config.num_condition_classes:
        raise ValueError("class_labels need a class-embedding table: this model has num_condition_classes=0; "
                         "pass condition_embeds instead, or build the config with num_condition_classes")
    class_labels = torch.as_tensor(class_labels)
    if class_labels.dim() != 1 or class_labels.shape[0] != batch or class_labels.is_floating_point():
        raise ValueError(f"class_labels must be integer class ids of shape ({batch},), got "
                         f"{class_labels.dtype} {tuple(class_labels.shape)}")
    num_classes = config.num_condition_classes
    if not _skip_values(class_labels) and (class_labels.min() < -1 or class_labels.max() >= num_classes):
        raise ValueError(f"class_labels must lie in [0, {num_classes}) (num_condition_classes), or be -1 for no "
                         f"class; got {class_labels.unique().tolist()}")


def check_image_plan(group_ids, target_positions, shape, prefix: int = 1) -> None:
    """A plan over ``[CLS, conditions, patches]``: the prefix has the lowest rank and is never a target; every
    target ranks above the prefix, so that it sees it."""
    if tuple(group_ids.shape) != tuple(shape):
        raise ValueError(
            f"group_ids must cover [CLS, condition tokens, patches]: shape {tuple(shape)}, got "
            f"{tuple(group_ids.shape)}; draw the plan for config.sequence_length = {shape[1]} positions with "
            f"num_condition_tokens=config.num_prefix_tokens = {prefix}"
        )
    if torch.compiler.is_compiling():
        return  # value checks need a host sync
    if (group_ids[:, :prefix].amax(-1) > group_ids[:, prefix:].amin(-1)).any():
        raise ValueError(f"the CLS token and the condition tokens (positions 0..{prefix - 1}) must have the lowest "
                         f"rank of their row (rank 0 of a plan drawn with num_condition_tokens={prefix})")
    if target_positions is None:
        return
    if ((target_positions >= 0) & (target_positions < prefix)).any():
        raise ValueError(f"positions 0..{prefix - 1} are the CLS token and the condition tokens, which have no "
                         f"pixels: a prefix position cannot be a target (patches start at position {prefix})")
    slots = target_positions.clamp(min=0).to(group_ids.device)
    target_rank = group_ids.gather(1, slots)
    unseen = (target_positions.to(group_ids.device) >= 0) & (
        target_rank <= group_ids[:, :prefix].amax(-1, keepdim=True))
    if unseen.any():
        raise ValueError("every target must have a higher rank than the CLS and condition tokens, so that it "
                         "sees them (a plan's targets have rank >= 1, its prefix rank 0)")


def check_image_classification_inputs(model, kwargs: dict, labels) -> None:
    """`LookAroundViTForImageClassification`: no plan, and class ids in range for single-label classification."""
    refuse_plan_inputs(model, kwargs)
    if (labels is not None and model.config.problem_type in (None, "single_label_classification")
            and model.num_labels > 1 and labels.dtype in (torch.long, torch.int)):
        check_class_labels(labels, model.num_labels)


def check_vit_pretraining_inputs(group_ids, target_positions) -> None:
    if group_ids is None or target_positions is None:
        raise ValueError("LookAroundViTForPreTraining needs group_ids and target_positions (a plan); "
                         "hf_lookaround.data.image_collator.ImagePlanCollator emits them")


def check_codebook_width(patch_width: int, codebook: torch.Tensor) -> None:
    if patch_width != codebook.shape[-1]:
        raise ValueError(f"patches have {patch_width} values but the codebook's centroids have "
                         f"{codebook.shape[-1]}: the codebook was fitted for another patch size or channel count")


def check_codebook_tables(config, codebook, pixel_decoder) -> None:
    """`set_visual_codebook`: tables of (codebook_size, patch_dim), finite, with at least 2 distinct centroids."""
    if not config.uses_codebook:
        raise ValueError(f"target_mode {config.target_mode!r} regresses pixels and has no codebook; build the "
                         f"model with target_mode 'p2d' or 'd2d' to use visual tokens")
    want = (config.codebook_size, config.patch_dim)
    for name, table in (("codebook", codebook), ("pixel_decoder", pixel_decoder)):
        if table is None:
            continue
        table = torch.as_tensor(table)
        if tuple(table.shape) != want:
            raise ValueError(
                f"{name} has shape {tuple(table.shape)} but this model takes ({config.codebook_size}, "
                f"{config.patch_dim}) (config.codebook_size, num_channels * patch_size**2): fit the codebook with "
                f"codebook_size={config.codebook_size} and patch_size={config.patch_size}, or build the config "
                f"with codebook_size={table.shape[0]}"
            )
        if not torch.isfinite(table).all():
            raise ValueError(f"{name} holds non-finite values")
    if torch.unique(torch.as_tensor(codebook), dim=0).shape[0] < 2:
        raise ValueError("the codebook needs at least 2 distinct centroids")


def check_codebook_is_set(config, codebook: torch.Tensor) -> None:
    """All zeros = no codebook set yet (a fitted one has >= 2 distinct centroids)."""
    if torch.compiler.is_compiling():
        return  # needs a host sync: checked by the first eager call
    if not codebook.any():
        raise ValueError(
            f"target_mode {config.target_mode!r} needs a visual codebook and none is set: fit one with "
            f"hf_lookaround.visual_tokenizer.fit_codebook(images, patch_size={config.patch_size}, "
            f"codebook_size={config.codebook_size}) and call model.set_visual_codebook(codebook)"
        )


def check_pixel_decoder_is_set(pixel_decoder: torch.Tensor) -> None:
    if not pixel_decoder.any():
        raise ValueError(
            "this model has a codebook but no pixel decoder, so visual tokens cannot become pixels: call "
            "model.set_visual_codebook(codebook, pixel_decoder=hf_lookaround.visual_tokenizer.fit_pixel_decoder("
            "images, codebook, patch_size))"
        )


def check_block_diffusion_layout(prepared) -> None:
    """BD3-LM's one-stream checkpoints read ``x_t ⊕ x_0`` (the collator's batches, ``one_stream_layout=True``), not
    plain ``[MASK]`` inputs."""
    if not prepared.one_stream_layout:
        raise ValueError("this checkpoint is BD3-LM's one-stream form: its input is the noised sequence then the clean "
                         "one (x_t ⊕ x_0, as objectives/bd3lm.py's collator lays it out), passed with "
                         "one_stream_layout=True; decode it with generate(diffusion_threshold=...) or score it with "
                         "`hf-lookaround perplexity --protocol elbo`")
