"""Group decoding, what ``generate(..., group_size=t)`` runs (DESIGN.md, "Decoding with the streams").

The query stream at position ``i`` predicts token ``i`` from content of lower group rank only, so one forward
predicts every position of the next group. Group decoding (semi-autoregressive, the BD3-LM pattern) serves
look-ahead checkpoints (``ar`` / ``dar``): each step runs the query stream at the next ``t`` positions (rank =
the next group), samples them together, and their content joins a KV cache with one rank for the group, so the
group's content rows see each other and all earlier content, as in training. ``t = 1`` is AR decoding. The ranks
of prompt + continuation form one semi-AR plan whose groups end where the prompt ends (the first group has
``1..t`` tokens, as the plan draws it). Entry points: ``model.generate(..., group_size=t)`` on a head with
:class:`GroupDecodingMixin` (also from the ``text-generation`` pipeline), or :func:`group_generate` on any
LookAround LM head. Any-order infilling lives in the package (``hf_lookaround.decoding.infill``).
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation import (
    EosTokenCriteria,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerateDecoderOnlyOutput,
    LogitsProcessorList,
    MaxLengthCriteria,
    MinPLogitsWarper,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GROUP_DECODING_OBJECTIVES",
    "UntrainedDecodingError",
    "trained_group_sizes",
    "check_group_size",
    "semi_ar_ranks",
    "GroupDecodingMixin",
    "group_decoding",
    "group_generate",
    "make_logits_processor",
]

# The look-ahead objectives and the group size their plan trains when `plan_params` has no "t". This file is remote
# code and cannot read the package's objectives table (objectives.py); tests/test_objectives.py checks they agree.
GROUP_DECODING_OBJECTIVES = {"ar": 1, "dar": 2}
# The objective whose plan_params are {"mixture": {name: weight}, "components": {name: plan params}}: a checkpoint
# trained on the look-ahead components among them decodes with their group sizes.
MIXTURE_OBJECTIVE = "mixture"


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
    params = getattr(config, "plan_params", None) or {}
    if objective == MIXTURE_OBJECTIVE:  # the union over its look-ahead components of positive weight
        components = params.get("components") or {}
        sizes = set()
        for name, weight in (params.get("mixture") or {}).items():
            if name in GROUP_DECODING_OBJECTIVES and float(weight) > 0:
                sizes.update(_sizes_of(name, components.get(name) or {}))
        return tuple(sorted(sizes))
    if objective not in GROUP_DECODING_OBJECTIVES:
        return ()
    return _sizes_of(objective, params)


def _sizes_of(objective: str, params: dict) -> tuple[int, ...]:
    t = params.get("t", GROUP_DECODING_OBJECTIVES[objective])
    return (int(t),) if isinstance(t, int) else tuple(int(x) for x in t)


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
    elif not sizes:
        _refuse_or_warn(f"this checkpoint was pretrained with the {objective!r} objective, not a (semi-)autoregressive "
                        "one: fill positions with hf_lookaround.decoding.infill instead of group decoding",
                        allow_untrained)
    elif group_size not in sizes:
        _refuse_or_warn(f"group_size={group_size} was not trained: this {objective!r} checkpoint was pretrained with "
                        f"group sizes {list(sizes)}", allow_untrained)


# ----------------------------------------------------------------------------------------------
# Pieces shared by both decoders
# ----------------------------------------------------------------------------------------------
def _device(model) -> torch.device:
    return next(model.parameters()).device


def make_logits_processor(do_sample: bool, temperature=None, top_k=None, top_p=None) -> LogitsProcessorList:
    """transformers' warpers for sampling (temperature, top-k, top-p); empty for greedy decoding."""
    if not do_sample:
        given = {k: v for k, v in dict(temperature=temperature, top_k=top_k, top_p=top_p).items() if v is not None}
        if given:
            raise ValueError(f"{sorted(given)} only apply when sampling: pass do_sample=True (CLI: --do_sample)")
        return LogitsProcessorList()
    # transformers' warpers accept top_p > 1 (and 1.5 would silently mean "no top-p"): refuse what is not one
    if top_p is not None and not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}: the share of probability mass kept")
    if top_k is not None and int(top_k) < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k), got {top_k}")
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
    backbone, lm_head = model.base_model, model.lm_head
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
