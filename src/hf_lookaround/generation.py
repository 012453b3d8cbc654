"""Decoding with the streams (DESIGN.md, "Decoding with the streams").

The query stream at position ``i`` predicts token ``i`` from content of lower group rank only, so
one forward predicts every position of the next group. Two decoders follow:

- **Group decoding** (semi-autoregressive, the BD3-LM pattern) for ``ar`` / ``dar`` checkpoints:
  each step runs the query stream at the next ``t`` positions (rank = the next group), samples them
  together, and their content joins a KV cache with one rank for the group, so the group's content
  rows see each other and all earlier content, as in training. ``t = 1`` is AR decoding. The ranks
  of prompt + continuation form one semi-AR plan of ``plans.semi_autoregressive_plan`` whose groups
  end where the prompt ends (the first group has ``1..t`` tokens, as the plan draws it).
  Entry points: ``model.generate(..., group_size=t)`` on a head with :class:`GroupDecodingMixin`
  (also from the ``text-generation`` pipeline), or :func:`group_generate` on any LookAround LM head.
- **Any-order infilling** (the MaskGIT / MDLM / LLaDA pattern) for masked, variable-mask and GVP
  checkpoints: every step predicts all remaining hidden positions from the visible ones (visible
  rank 0, hidden rank 1, query rows at the hidden positions; the content of a hidden position is
  never seen by anyone) and commits some of them, by confidence, at random or left to right, on a
  cosine or linear schedule. Entry point: :func:`infill`.

``hf-lookaround generate`` runs both from the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

logger = logging.getLogger(__name__)

__all__ = [
    "AR_OBJECTIVES",
    "MASKED_OBJECTIVES",
    "ORDERS",
    "SCHEDULES",
    "UntrainedDecodingError",
    "trained_group_sizes",
    "check_group_size",
    "check_infill_objective",
    "semi_ar_ranks",
    "GroupDecodingMixin",
    "group_decoding",
    "group_generate",
    "InfillOutput",
    "infill",
    "commit_schedule",
    "make_logits_processor",
    "main",
]

AR_OBJECTIVES = ("ar", "dar")
MASKED_OBJECTIVES = ("mlm", "vmlm", "gvp")
ORDERS = ("confidence", "random", "left_to_right")
SCHEDULES = ("cosine", "linear")


# sampling warpers that read only the scores, never the sequence so far
_POSITIONLESS_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                            TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


class UntrainedDecodingError(ValueError):
    """A decoder the checkpoint was not trained for (pass ``allow_untrained=True`` to run it anyway)."""


# ----------------------------------------------------------------------------------------------
# What a checkpoint was trained for
# ----------------------------------------------------------------------------------------------
def trained_group_sizes(config) -> tuple[int, ...] | None:
    """Group sizes ``t`` the checkpoint's plan trained: ``(1,)`` for ``ar``, ``plan_params["t"]`` (an int or a
    list, a mixture) for ``dar``, ``()`` for masked / GVP objectives, ``None`` when the config records no objective."""
    objective = getattr(config, "objective", None)
    if objective is None:
        return None
    if objective == "ar":
        return (1,)
    if objective == "dar":
        t = (getattr(config, "plan_params", None) or {}).get("t", 2)
        return (int(t),) if isinstance(t, int) else tuple(int(x) for x in t)
    return ()


def _refuse_or_warn(message: str, allow_untrained: bool) -> None:
    if not allow_untrained:
        raise UntrainedDecodingError(message + "; pass allow_untrained=True (CLI: --allow_untrained) to decode anyway")
    logger.warning("%s; decoding anyway (allow_untrained=True)", message)


def check_group_size(config, group_size, allow_untrained: bool = False) -> None:
    """Refuse a group size the checkpoint was not trained for, unless ``allow_untrained`` (then warn).

    A ``dar`` checkpoint trained with ``t = 2`` predicts the second token of a pair without seeing the
    first; decoding with ``t = 4`` asks for predictions three tokens ahead that it never learned."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    sizes = trained_group_sizes(config)
    objective = getattr(config, "objective", None)
    if getattr(config, "prediction_stream", None) == "content":
        _refuse_or_warn("this checkpoint was trained single-stream (config.prediction_stream='content'): its query "
                        "stream, which group decoding reads, was never trained; use generate() without group_size",
                        allow_untrained)
    elif sizes is None:
        logger.warning("the config records no pretraining objective: cannot check that group_size=%d was trained",
                       group_size)
    elif objective in MASKED_OBJECTIVES:
        _refuse_or_warn(f"this checkpoint was pretrained with the {objective!r} objective, not a (semi-)autoregressive "
                        "one: fill positions with hf_lookaround.generation.infill instead of group decoding",
                        allow_untrained)
    elif group_size not in sizes:
        _refuse_or_warn(f"group_size={group_size} was not trained: this {objective!r} checkpoint was pretrained with "
                        f"group sizes {list(sizes)}", allow_untrained)


def check_infill_objective(config, allow_untrained: bool = False) -> None:
    """Infilling shows every visible token at rank 0 (bidirectional content), as masked and GVP pretraining do."""
    objective = getattr(config, "objective", None)
    if objective is None:
        logger.warning("the config records no pretraining objective: cannot check that it was trained to infill")
    elif objective not in MASKED_OBJECTIVES:
        _refuse_or_warn(f"this checkpoint was pretrained with the {objective!r} objective, whose content stream never "
                        "saw a bidirectional context: continue text with group decoding "
                        "(model.generate(..., group_size=t)) instead of infilling", allow_untrained)


# ----------------------------------------------------------------------------------------------
# Pieces shared by both decoders
# ----------------------------------------------------------------------------------------------
def _backbone_and_head(model):
    backbone, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if backbone is None or head is None:
        raise TypeError(
            f"decoding needs a LookAround LM head (LookAroundForPreTraining, ForCausalLM or ForMaskedLM) with "
            f"`.model` and `.lm_head`; got {type(model).__name__}"
        )
    return backbone, head


def _device(model) -> torch.device:
    return next(model.parameters()).device


def make_logits_processor(do_sample: bool, temperature=None, top_k=None, top_p=None) -> LogitsProcessorList:
    """transformers' warpers for sampling (temperature, top-k, top-p); empty for greedy decoding."""
    if not do_sample:
        given = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
        if given:
            raise ValueError(f"{sorted(given)} only apply when sampling: pass do_sample=True (CLI: --do_sample)")
        return LogitsProcessorList()
    processors = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(float(temperature)))  # checks temperature > 0
    if top_k is not None and top_k != 0:
        processors.append(TopKLogitsWarper(int(top_k)))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(float(top_p)))
    return processors


def _pick(scores: torch.Tensor, do_sample: bool, generator=None) -> torch.Tensor:
    """(N, V) processed scores -> (N,) tokens: a draw from their softmax, or the argmax."""
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def _check_length(total: int, config, what: str) -> None:
    limit = config.max_position_embeddings
    if total > limit:
        raise ValueError(f"{what} needs {total} positions but the model has max_position_embeddings={limit}: "
                         "shorten the input or ask for fewer tokens (nothing is truncated for you)")


# ----------------------------------------------------------------------------------------------
# Group decoding
# ----------------------------------------------------------------------------------------------
def _check_left_padded(attention_mask: torch.Tensor) -> None:
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape (batch, seq_len), got {tuple(attention_mask.shape)}")
    mask = attention_mask != 0
    if (mask[:, :-1] & ~mask[:, 1:]).any():
        raise ValueError("group decoding needs left padding (attention_mask 0...0 1...1 in every row): "
                         "set tokenizer.padding_side = 'left'")
    if (~mask.any(-1)).any():
        raise ValueError("every row of the prompt needs at least one token (a BOS token will do)")


def semi_ar_ranks(attention_mask: torch.Tensor, total_len: int, group_size: int, has_condition: torch.Tensor):
    """Group ranks ``(B, total_len)`` of a left-padded prompt followed by its continuation, and position ids.

    Per row, with ``P`` real prompt tokens and ``c`` = 1 when it starts with a condition token (BOS), the
    condition has rank 0 and text position ``i >= c`` has rank ``R + floor((i - P) / t)`` with
    ``R = c + ceil((P - c) / t)`` the rank of the first generated group: groups of ``t`` tokens end where the
    prompt ends and the first text group holds ``1..t`` tokens, exactly a plan that
    ``plans.semi_autoregressive_plan`` draws. ``t = 1`` gives ``g[i] = i`` (the AR plan). Padding gets rank 0
    (it is never attended). Position ids count real tokens only.
    """
    batch, prompt_cols = attention_mask.shape
    device = attention_mask.device
    real = (attention_mask != 0).long().sum(-1, keepdim=True)  # P
    pad = prompt_cols - real
    cols = torch.arange(total_len, device=device).expand(batch, total_len)
    i = cols - pad  # position in the row's own sequence (negative on padding)
    c = has_condition.long().view(batch, 1).to(device)
    first_generated = c + torch.div(real - c + group_size - 1, group_size, rounding_mode="floor")
    ranks = first_generated + torch.div(i - real, group_size, rounding_mode="floor")
    ranks = torch.where(i < c, torch.zeros_like(ranks), ranks)
    return ranks, i.clamp(min=0)


class GroupDecodingMixin:
    """``generate(..., group_size=t)`` runs group decoding through the query stream (:func:`group_decoding`).

    Without ``group_size`` every call goes to transformers' ``GenerationMixin.generate`` unchanged. With it, the
    usual preparation of ``generate`` (generation config, logits processors and warpers, stopping criteria, EOS,
    ``max_new_tokens``, ``num_return_sequences``) runs, and transformers hands decoding to
    :func:`group_decoding` through its ``custom_generate`` callable hook. ``allow_untrained=True`` decodes with a
    group size the checkpoint was not trained for (warns instead of refusing; see :func:`check_group_size`).
    """

    def generate(self, inputs=None, generation_config=None, *args, group_size=None, allow_untrained=False, **kwargs):
        if group_size is None:
            return super().generate(inputs, generation_config, *args, **kwargs)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("group_size selects group decoding; it cannot be combined with custom_generate")
        check_group_size(self.config, group_size, allow_untrained)
        return super().generate(
            inputs, generation_config, *args, custom_generate=group_decoding, group_size=group_size, **kwargs
        )


def group_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    group_size: int = 1,
    **model_kwargs,
):
    """transformers' ``custom_generate`` callable: ``GenerationMixin.generate`` has prepared everything."""
    if generation_config.num_beams > 1:
        raise ValueError("group decoding takes the argmax or samples; beam search (num_beams > 1) is not supported")
    if getattr(generation_config, "cache_implementation", None) not in (None, "dynamic"):
        raise ValueError(
            f"group decoding keeps its own DynamicCache; cache_implementation={generation_config.cache_implementation!r} "
            "serves token-by-token generate() without group_size"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("group decoding starts from input_ids (the cache holds content of known tokens); "
                         "pass input_ids instead of inputs_embeds")
    past = model_kwargs.get("past_key_values")
    if past is not None and past.get_seq_length() > 0:
        raise ValueError("group decoding builds its cache from the prompt; pass no filled past_key_values")
    pad = generation_config._pad_token_tensor
    eos = generation_config._eos_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)
    return _group_decode(
        model,
        input_ids,
        model_kwargs.get("attention_mask"),
        group_size=group_size,
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=generation_config.do_sample,
        pad_token_id=pad_id,
        use_cache=bool(model_kwargs.get("use_cache", True)),
        return_dict=generation_config.return_dict_in_generate,
        output_scores=generation_config.output_scores,
        output_logits=generation_config.output_logits,
        streamer=streamer,
    )


@torch.no_grad()
def group_generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    group_size: int = 1,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature=None,
    top_k=None,
    top_p=None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    eos_token_id=None,
    pad_token_id=None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    allow_untrained: bool = False,
    return_dict_in_generate: bool = False,
    output_scores: bool = False,
    output_logits: bool = False,
):
    """Group decoding on any LookAround LM head (``LookAroundForPreTraining`` included), without ``generate()``.

    ``input_ids`` ``(B, P)`` left-padded (or a list of ids for one row); ``eos_token_id`` / ``pad_token_id``
    default to the config's (``eos_token_id=[]``: no EOS, always ``max_new_tokens``); ``logits_processor`` runs
    after the sampling warpers built from
    ``temperature``/``top_k``/``top_p``. Returns the sequences ``(B, P + n)``, or a ``GenerateDecoderOnlyOutput``.
    """
    check_group_size(model.config, group_size, allow_untrained)
    device = _device(model)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask, device=device)
        attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    config = model.config
    eos_token_id = config.eos_token_id if eos_token_id is None else eos_token_id
    pad_token_id = config.pad_token_id if pad_token_id is None else pad_token_id
    if pad_token_id is None:
        pad_token_id = eos_token_id if isinstance(eos_token_id, int) else 0
    processors = make_logits_processor(do_sample, temperature, top_k, top_p)
    processors.extend(logits_processor or [])
    criteria = StoppingCriteriaList([MaxLengthCriteria(input_ids.shape[1] + max_new_tokens)])
    if eos_token_id is not None:
        criteria.append(EosTokenCriteria(eos_token_id))
    criteria.extend(stopping_criteria or [])
    return _group_decode(
        model, input_ids, attention_mask, group_size=group_size, max_new_tokens=max_new_tokens,
        logits_processor=processors, stopping_criteria=criteria, do_sample=do_sample, pad_token_id=int(pad_token_id),
        use_cache=use_cache, return_dict=return_dict_in_generate, output_scores=output_scores,
        output_logits=output_logits, generator=generator,
    )


def _group_decode(
    model,
    input_ids,
    attention_mask,
    *,
    group_size,
    max_new_tokens,
    logits_processor,
    stopping_criteria,
    do_sample,
    pad_token_id,
    use_cache,
    return_dict=False,
    output_scores=False,
    output_logits=False,
    streamer=None,
    generator=None,
):
    backbone, lm_head = _backbone_and_head(model)
    config = model.config
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=device, dtype=torch.long)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    _check_left_padded(attention_mask)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check_length(prompt_len, config, "the prompt")
    _check_length(prompt_len + max_new_tokens, config, f"the prompt ({prompt_len} tokens) + max_new_tokens")

    if config.eos_token_id is not None and bool((input_ids[:, -1] == config.eos_token_id).any()):
        # the package's tokenizers wrap text as <s> ... </s>; a continuation of a finished text is rarely meant
        logger.warning("a prompt ends with the EOS token: encode it with add_special_tokens=False (and BOS in front) "
                       "to continue the text rather than start after its end")
    total = prompt_len + max_new_tokens
    first_real = input_ids.gather(1, (attention_mask == 0).sum(-1, keepdim=True)).squeeze(1)
    bos = config.bos_token_id
    has_condition = first_real == bos if bos is not None else torch.zeros(batch, dtype=torch.bool, device=device)
    # the whole plan is known up front: ranks and positions of every column, prompt and continuation
    ranks, positions = semi_ar_ranks(attention_mask, total, group_size, has_condition)

    # one buffer for the whole output: a step writes its columns, views give the sequence so far (no copies)
    buffer = input_ids.new_full((batch, total), pad_token_id)
    buffer[:, :prompt_len] = input_ids
    mask = attention_mask.new_zeros((batch, total))  # generated columns become valid as they are written
    mask[:, :prompt_len] = attention_mask
    # warpers that never read input_ids treat the slots of a group in one call
    one_call = all(isinstance(p, _POSITIONLESS_PROCESSORS) for p in logits_processor)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    cache = DynamicCache(config=config) if use_cache else None
    length, past = prompt_len, 0  # columns decided / columns whose content is in the cache
    all_scores, all_logits = [], []
    while True:
        width = min(group_size, total - length)  # the last group may be cut by max_new_tokens
        if width <= 0:
            break
        slots = slice(length, length + width)
        if cache is not None:
            # one forward: content rows of the group sampled last (the prompt at first) join the cache,
            # query rows of the next group read every key of lower rank
            out = backbone(
                input_ids=buffer[:, past:length], attention_mask=mask[:, :length], group_ids=ranks[:, :length],
                position_ids=positions[:, past:length], past_key_values=cache, use_cache=True,
                query_position_ids=positions[:, slots], query_group_ids=ranks[:, slots],
            )
            past = length
        else:
            # recompute every content row; the next group's columns are invalid keys that only hold query rows
            out = backbone(
                input_ids=buffer[:, : length + width], attention_mask=mask[:, : length + width],
                group_ids=ranks[:, : length + width], position_ids=positions[:, : length + width],
                target_positions=torch.arange(length, length + width, device=device).expand(batch, width),
            )
        logits = lm_head(out.query_hidden_state[:, :width]).float()
        if one_call:
            group_scores = logits.flatten(0, 1)
            if len(logits_processor):
                group_scores = logits_processor(buffer[:, :length].repeat_interleave(width, 0), group_scores)
            group_scores = group_scores.view(batch, width, -1)
            group_tokens = _pick(group_scores.flatten(0, 1), do_sample, generator).view(batch, width)
        for j in range(width):
            if one_call:
                scores, token = group_scores[:, j], group_tokens[:, j]
            else:
                # slots of a group are predicted together; processors still see the tokens picked before them
                scores = logits_processor(buffer[:, : length + j], logits[:, j])
                token = _pick(scores, do_sample, generator)
            buffer[:, length + j] = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
            mask[:, length + j] = 1
            if output_scores:
                all_scores.append(scores)
            if output_logits:
                all_logits.append(logits[:, j])
            unfinished = unfinished & ~stopping_criteria(buffer[:, : length + j + 1], scores)
        if streamer is not None:
            streamer.put(buffer[:, slots].cpu())
        length += width
        if not unfinished.any():
            break
    sequences = buffer[:, :length]
    if streamer is not None:
        streamer.end()
    if return_dict:
        return GenerateDecoderOnlyOutput(
            sequences=sequences,
            scores=tuple(all_scores) if output_scores else None,
            logits=tuple(all_logits) if output_logits else None,
            past_key_values=cache,
        )
    return sequences


# ----------------------------------------------------------------------------------------------
# Any-order infilling
# ----------------------------------------------------------------------------------------------
@dataclass
class InfillOutput:
    """sequences ``(B, T)`` with every hidden position filled; ``commit_step`` ``(B, T)``: the step (1-based) at
    which each position was committed, 0 for positions that were visible; ``text``: the decoded rows if a
    tokenizer was given; ``num_steps``: forwards run."""

    sequences: torch.LongTensor
    commit_step: torch.LongTensor
    num_steps: int
    text: list[str] | None = None


def commit_schedule(num_hidden: int, steps: int, schedule: str = "cosine") -> list[int]:
    """How many of ``num_hidden`` positions to commit at each of ``steps`` steps (sums to ``num_hidden``).

    After step ``s`` a fraction ``f(s / S)`` stays hidden: ``cos(pi/2 * s/S)`` (MaskGIT's cosine: few commits
    first, when context is scarce) or ``1 - s/S`` (linear). Every step commits at least one position while any
    remain, so a row may finish before step ``S``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    fraction = (lambda r: math.cos(math.pi / 2 * r)) if schedule == "cosine" else (lambda r: 1.0 - r)
    counts, remaining = [], num_hidden
    for s in range(1, steps + 1):
        target = 0 if s == steps else math.floor(num_hidden * fraction(s / steps) + 1e-9)
        commit = min(remaining, max(remaining - target, 1 if remaining else 0))
        counts.append(commit)
        remaining -= commit
    return counts


def _encode_infill_inputs(tokenizer, text_or_ids, hidden, num_tokens, attention_mask, add_bos, config, device):
    """-> ids (B, T), hidden (B, T) bool, valid (B, T) bool."""
    mask_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else config.bos_token_id
    placeholder = mask_id if mask_id is not None else (config.mask_token_id or config.pad_token_id or 0)

    if text_or_ids is None or isinstance(text_or_ids, str) or (
        isinstance(text_or_ids, (list, tuple)) and text_or_ids and isinstance(text_or_ids[0], str)
    ):
        texts = [""] if text_or_ids is None else [text_or_ids] if isinstance(text_or_ids, str) else list(text_or_ids)
        if tokenizer is None:
            raise ValueError("text input needs a tokenizer")
        if hidden is not None:
            raise ValueError("with text input, mark the positions to fill with the mask token in the text, not `hidden`")
        rows, hidden_rows = [], []
        for text in texts:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
            if add_bos and bos is not None:
                ids = [bos] + ids
            marked = [mask_id is not None and t == mask_id for t in ids]
            if num_tokens:
                ids, marked = ids + [placeholder] * num_tokens, marked + [True] * num_tokens
            elif text and mask_id is None:
                raise ValueError(f"{type(tokenizer).__name__} has no mask token, so a [MASK]-marked string cannot say "
                                 "what to fill: pass ids and a boolean `hidden` mask, or num_tokens")
            elif not any(marked):
                raise ValueError(f"nothing to fill: the text holds no {tokenizer.mask_token} and num_tokens is not set")
            rows.append(ids)
            hidden_rows.append(marked)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), config.pad_token_id or 0, dtype=torch.long)
        hid = torch.zeros(len(rows), width, dtype=torch.bool)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, (r, h) in enumerate(zip(rows, hidden_rows)):
            ids[b, : len(r)], hid[b, : len(r)], valid[b, : len(r)] = torch.tensor(r), torch.tensor(h), True
        return ids.to(device), hid.to(device), valid.to(device)

    ids = torch.as_tensor(text_or_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"ids must have shape (seq_len,) or (batch, seq_len), got {tuple(ids.shape)}")
    valid = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask)
        attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must have the shape of the ids {tuple(ids.shape)}")
        valid = attention_mask != 0
    if num_tokens:
        if attention_mask is not None and not valid.all():
            raise ValueError("num_tokens appends after the last column; pass unpadded ids")
        ids = torch.cat([ids, ids.new_full((ids.shape[0], num_tokens), placeholder)], 1)
        valid = torch.cat([valid, valid.new_ones((ids.shape[0], num_tokens))], 1)
        extra = torch.zeros(ids.shape, dtype=torch.bool)
        extra[:, -num_tokens:] = True
        hidden = extra if hidden is None else torch.cat([_hidden_mask(hidden, ids[:, :-num_tokens]), extra[:, -num_tokens:]], 1)
    elif hidden is None:
        raise ValueError("say which positions to fill: a boolean `hidden` mask or a list of positions (or num_tokens)")
    hid = _hidden_mask(hidden, ids)
    if (hid & ~valid).any():
        raise ValueError("hidden positions fall on padding (attention_mask 0); fill only positions inside the sequence")
    return ids.to(device), hid.to(device), valid.to(device)


def _hidden_mask(hidden, ids: torch.Tensor) -> torch.Tensor:
    """A boolean (B, T) mask from a mask of the shape of ``ids`` or from a list of positions (one row, or one list per row)."""
    hidden = torch.as_tensor(hidden)
    if hidden.dtype == torch.bool:
        if hidden.dim() == 1:
            hidden = hidden[None]
        if hidden.shape != ids.shape:
            raise ValueError(f"the hidden mask {tuple(hidden.shape)} must have the shape of the ids {tuple(ids.shape)}")
        return hidden.clone()
    positions = hidden.long()
    if positions.dim() == 1:
        positions = positions[None].expand(ids.shape[0], -1)
    seq_len = ids.shape[1]
    if positions.numel() and (positions.min() < 0 or positions.max() >= seq_len):
        bad = positions[(positions < 0) | (positions >= seq_len)].unique().tolist()
        raise ValueError(f"positions to fill {bad} lie outside the sequence of {seq_len} tokens (valid: 0..{seq_len - 1})")
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask.scatter_(1, positions, True)
    return mask


def _prediction_stream(config, stream: str) -> str:
    if stream == "auto":
        return "content" if getattr(config, "prediction_stream", None) == "content" else "query"
    if stream not in ("query", "content"):
        raise ValueError(f"stream must be 'auto', 'query' or 'content', got {stream!r}")
    return stream


@torch.no_grad()
def infill(
    model,
    tokenizer=None,
    text_or_ids=None,
    hidden=None,
    *,
    num_tokens: int | None = None,
    attention_mask=None,
    steps: int | None = None,
    order: str = "confidence",
    schedule: str = "cosine",
    do_sample: bool = False,
    temperature=None,
    top_k=None,
    top_p=None,
    logits_processor: LogitsProcessorList | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    add_bos: bool = True,
    stream: str = "auto",
    allow_untrained: bool = False,
) -> InfillOutput:
    """Fill hidden positions in ``steps`` steps, any order (MaskGIT / MDLM / LLaDA).

    Inputs, one of:
      - a string (or a list of strings) with the tokenizer's mask token at each position to fill
        (``"The [MASK] met on [MASK]."``); BOS is prepended when ``add_bos`` and the tokenizer has one;
      - ids ``(T,)`` or ``(B, T)`` and ``hidden``: a boolean mask of that shape or a list of positions
        (``attention_mask`` marks padding);
      - ``num_tokens=N``: N hidden positions appended (after BOS alone when no text is given: unconditional sampling).

    Each step predicts every remaining hidden position from the visible ones (two-stream: visible rank 0, hidden
    rank 1, query rows at the hidden positions; a checkpoint whose config says ``prediction_stream="content"``
    reads the content stream over ``[MASK]`` inputs instead) and commits ``commit_schedule(n, steps, schedule)[s]``
    of them: those with the most confident token (``order="confidence"``: probability of the chosen token), at
    random, or the leftmost (``"left_to_right"``). Committed tokens become visible; visible tokens never change.
    ``steps`` defaults to the largest number of hidden positions in a row (one commit per step).
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if num_tokens is not None and num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    check_infill_objective(model.config, allow_untrained)
    backbone, lm_head = _backbone_and_head(model)
    config, device = model.config, _device(model)
    stream = _prediction_stream(config, stream)
    ids, remaining, valid = _encode_infill_inputs(
        tokenizer, text_or_ids, hidden, num_tokens, attention_mask, add_bos, config, device
    )
    _check_length(ids.shape[1], config, "the sequence to infill")
    counts_per_row = remaining.sum(-1)
    if (counts_per_row == 0).all():
        raise ValueError("nothing to fill: no position is hidden")
    max_hidden = int(counts_per_row.max())
    steps = max_hidden if steps is None else int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    steps = min(steps, max_hidden)  # a step commits at least one position, so more steps than positions never run
    schedules = torch.tensor(
        [commit_schedule(int(n), steps, schedule) for n in counts_per_row.tolist()], device=device
    )  # (B, S)
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    processors = make_logits_processor(do_sample, temperature, top_k, top_p)
    processors.extend(logits_processor or [])
    mask_id = config.mask_token_id
    if stream == "content" and mask_id is None:
        raise ValueError("the content-stream pathway reads [MASK] inputs, but config.mask_token_id is None")

    batch = ids.shape[0]
    commit_step = torch.zeros_like(ids)
    from .modeling_lookaround import positions_of  # the model's own (B, T) bool -> (B, M) slots

    ran = 0
    for step in range(1, steps + 1):
        if not remaining.any():
            break
        ran = step
        slots = positions_of(remaining)  # (B, M), -1 pads
        is_slot = slots >= 0
        gather_at = slots.clamp(min=0)
        if stream == "query":
            # visible rank 0 (bidirectional, as in masked pretraining), hidden rank 1; hidden content is an
            # invalid key, so nobody ever reads it
            out = backbone(
                input_ids=ids, attention_mask=(valid & ~remaining).long(), group_ids=remaining.long(),
                target_positions=slots,
            )
            logits = lm_head(out.query_hidden_state).float()
        else:
            masked = torch.where(remaining, torch.full_like(ids, mask_id), ids)
            out = backbone(input_ids=masked, attention_mask=valid.long(), attention_pattern="bidirectional")
            logits = lm_head(out.last_hidden_state.gather(1, gather_at[..., None].expand(-1, -1, config.hidden_size)))
            logits = logits.float()
        width = slots.shape[1]
        context = ids.repeat_interleave(width, 0)  # processors see the row's current sequence
        scores = processors(context, logits.flatten(0, 1)) if len(processors) else logits.flatten(0, 1)
        tokens = _pick(scores, do_sample, generator).view(batch, width)
        chosen_prob = torch.softmax(scores.float(), -1).gather(1, tokens.flatten()[:, None]).view(batch, width)

        if order == "confidence":
            priority = chosen_prob
        elif order == "random":
            priority = torch.rand(batch, width, device=device, generator=generator)
        else:
            priority = -gather_at.float()  # leftmost first
        priority = torch.where(is_slot, priority, torch.full_like(priority, -math.inf))
        rank_in_step = torch.argsort(torch.argsort(priority, dim=-1, descending=True, stable=True), dim=-1)
        commit = is_slot & (rank_in_step < schedules[:, step - 1 : step])
        rows = torch.arange(batch, device=device)[:, None].expand_as(slots)
        ids[rows[commit], gather_at[commit]] = tokens[commit]
        remaining[rows[commit], gather_at[commit]] = False
        commit_step[rows[commit], gather_at[commit]] = step
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(row[v].tolist(), skip_special_tokens=True) for row, v in zip(ids, valid)]
    return InfillOutput(sequences=ids, commit_step=commit_step, num_steps=ran, text=text)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-lookaround generate",
        description="Decode with a LookAround checkpoint through its query stream: continue a prompt by group "
        "decoding (ar / dar checkpoints, --group_size), fill [MASK] positions (--infill) or sample --num_tokens "
        "tokens in any order (masked / GVP checkpoints).",
    )
    parser.add_argument("model", help="checkpoint folder (or hub name)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder; default: the checkpoint's")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--infill", default=None, help='text with the mask token at each position to fill, e.g. "a [MASK] b"')
    mode.add_argument("--num_tokens", type=int, default=None,
                      help="any-order sampling of this many tokens (after BOS, or after --prompt)")
    parser.add_argument("--prompt", default=None, help="text to continue (group decoding) or to condition --num_tokens on")
    parser.add_argument("--group_size", type=int, default=1, help="group decoding: tokens per step (t)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--no_cache", action="store_true", help="group decoding: recompute the prefix every step")
    parser.add_argument("--steps", type=int, default=None, help="infilling: steps (default: one per hidden position)")
    parser.add_argument("--order", choices=ORDERS, default="confidence")
    parser.add_argument("--schedule", choices=SCHEDULES, default="cosine")
    parser.add_argument("--do_sample", action="store_true", help="sample (default: greedy / argmax)")
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--num_samples", type=int, default=1, help="independent samples (rows of one batch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow_untrained", action="store_true",
                        help="decode even with a group size / decoder the checkpoint was not trained for (warns)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of plain text")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``hf-lookaround generate``; bad input raises ValueError, which the CLI prints as one line (exit 2)."""
    args = build_parser().parse_args(argv)

    from transformers import AutoModelForPreTraining, AutoTokenizer  # the package's import registered our classes

    if args.infill is None and args.num_tokens is None and args.prompt is None:
        raise SystemExit("give --prompt (group decoding), --infill TEXT or --num_tokens N")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    # every LookAround checkpoint loads into the pretraining head: the query stream and the LM head
    model = AutoModelForPreTraining.from_pretrained(args.model).to(args.device).eval()
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    sampling = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

    if args.infill is not None or args.num_tokens is not None:
        text = args.infill if args.infill is not None else (args.prompt or None)
        inputs = [text] * args.num_samples if text is not None else None
        if inputs is None and args.num_samples > 1:
            inputs = [""] * args.num_samples
        result = infill(
            model, tokenizer, inputs, num_tokens=args.num_tokens, steps=args.steps, order=args.order,
            schedule=args.schedule, generator=generator, allow_untrained=args.allow_untrained, **sampling,
        )
        outputs, info = result.text, {"mode": "infill", "steps": result.num_steps, "order": args.order,
                                      "schedule": args.schedule}
    else:
        ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        ids = ([bos] if bos is not None else []) + list(ids)
        input_ids = torch.tensor([ids] * args.num_samples, device=args.device)
        sequences = group_generate(
            model, input_ids, group_size=args.group_size, max_new_tokens=args.max_new_tokens,
            use_cache=not args.no_cache, generator=generator, allow_untrained=args.allow_untrained,
            pad_token_id=tokenizer.pad_token_id, **sampling,
        )
        outputs = [tokenizer.decode(row[len(ids):], skip_special_tokens=True) for row in sequences.tolist()]
        info = {"mode": "group_decoding", "group_size": args.group_size, "max_new_tokens": args.max_new_tokens}
    if args.json:
        print(json.dumps({**info, "outputs": outputs}, ensure_ascii=False))
    else:
        for i, text in enumerate(outputs):
            print(f"[{i}] {text}" if len(outputs) > 1 else text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
