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

import functools
import logging
from dataclasses import dataclass

import torch
from torch.nn import functional as F
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
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .masking_lookaround import NO_TARGET_RANK, one_stream_start_rows

logger = logging.getLogger(__name__)

__all__ = [
    "GROUP_DECODING_OBJECTIVES",
    "UntrainedDecodingError",
    "trained_group_sizes",
    "default_group_size",
    "check_group_size",
    "check_draft_group_size",
    "GenerateSpeculativeOutput",
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
    if is_one_stream_group_model(config):
        if group_size != config.attention_group_size:
            _refuse_or_warn(f"this one-stream checkpoint (block-causal attention) predicts the token "
                            f"{config.attention_group_size} places ahead: it decodes with group_size="
                            f"{config.attention_group_size} only, not {group_size}", allow_untrained)
    elif getattr(config, "prediction_stream", None) == "content":
        _refuse_or_warn("this checkpoint was trained single-stream (config.prediction_stream='content'): its query "
                        "stream, which group decoding reads, was never trained; use generate() without group_size (CLI: "
                        "drop --group_size / --draft_group_size)",
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


def default_group_size(config) -> int:
    """The group size ``generate()`` / the CLI decode with when none is given: 1 (AR decoding) when the checkpoint
    trained it or records no look-ahead plan, else the smallest group size it trained (a ``dar`` checkpoint trained
    with ``t = 2`` alone decodes with ``t = 2``, never silently with an untrained ``t = 1``)."""
    if is_one_stream_group_model(config):
        return int(config.attention_group_size)
    sizes = trained_group_sizes(config)
    if not sizes or 1 in sizes or getattr(config, "prediction_stream", None) == "content":
        return 1
    return min(sizes)


def is_one_stream_group_model(config) -> bool:
    """dar's one-stream form: block-causal content stream whose row predicts the token ``t`` places ahead."""
    return getattr(config, "prediction_stream", None) == "content" and \
        getattr(config, "default_attention", None) == "block_causal"


def check_draft_group_size(config, draft_group_size, allow_untrained: bool = False) -> None:
    """Refuse self-speculative decoding on a checkpoint that did not train both pathways it reads.

    The drafts are a group of ``k`` query rows of one rank (the ``dar`` plan with ``t = k``), and they are verified
    by the AR (``t = 1``) pathway, whose tokens are the output: both must have been trained."""
    if isinstance(draft_group_size, bool) or not isinstance(draft_group_size, int) or draft_group_size < 2:
        raise ValueError(f"draft_group_size must be an int >= 2 (a group of k query rows: the next token and k - 1 "
                         f"drafts after it), got {draft_group_size!r}")
    if is_one_stream_group_model(config):
        raise UntrainedDecodingError("self-speculative decoding reads the two-stream form's AR and draft query rows; "
                                     "this one-stream (block-causal) checkpoint has neither: decode with group_size")
    try:  # the draft group's own size, and the stream
        check_group_size(config, draft_group_size, allow_untrained)
    except UntrainedDecodingError as error:
        raise UntrainedDecodingError(f"draft_group_size={draft_group_size} drafts with a group of that size: {error}") \
            from None
    sizes = trained_group_sizes(config)
    if sizes and 1 not in sizes:
        _refuse_or_warn(
            f"self-speculative decoding keeps the tokens of the AR (t=1) pathway, which this checkpoint never trained "
            f"(group sizes {list(sizes)}): pretrain with t=1 in the mixture (e.g. --objective dar --group_size 1 "
            f"{draft_group_size}, or --objective mixture with ar), or decode with group_size={min(sizes)}",
            allow_untrained,
        )


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


def _compile_config(model, generation_config):
    """The ``CompileConfig`` a static-cache decoding step is compiled with, or None (eager), as transformers decides
    for its own static cache: compiled on CUDA, or anywhere a ``compile_config`` is given; never with
    ``disable_compile``."""
    if getattr(generation_config, "disable_compile", False):
        return None
    given = getattr(generation_config, "compile_config", None)
    if given is not None:
        return given
    if _device(model).type == "cuda":
        from transformers import CompileConfig

        return CompileConfig()
    return None


def _static_cache(model, batch: int, max_len: int, dtype_like):
    """A StaticCache of ``max_len`` slots, reused across calls of one shape (a compiled step guards on it)."""
    from transformers.cache_utils import StaticCache

    key = (batch, max_len)
    held = getattr(model, "_lookaround_static_cache", None)
    if held is not None and held[0] == key:
        held[1].reset()
        return held[1]
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    model._lookaround_static_cache = (key, cache)
    return cache


def _decoding_step(model, compile_config, one_stream: bool = False):
    """``(prefill, step)``: one decoding forward (content rows join the cache, query rows predict) -> float logits
    of the query rows. ``step`` is compiled with ``compile_config`` (fixed shapes: a static cache and full-width
    ranks and mask); ``prefill``, the first forward over the prompt, runs eager, as in transformers' own loop: it
    has its own width, and it fills the static cache's tensors outside any CUDA graph, which would own them.
    ``one_stream``: dar's one-stream form: block-causal content rows join the cache and the last ``t`` of them
    predict (``forward(input_ids, attention_mask, position_ids, cache)``)."""
    backbone, lm_head = model.base_model, model.lm_head

    def prefill(input_ids, attention_mask, group_ids, position_ids, cache, query_position_ids, query_group_ids):
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, group_ids=group_ids,
                       position_ids=position_ids, past_key_values=cache, use_cache=True,
                       query_position_ids=query_position_ids, query_group_ids=query_group_ids, content_output=False)
        return lm_head(out.query_hidden_state).float()

    def one_stream_prefill(input_ids, attention_mask, position_ids, cache):
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       attention_pattern="block_causal", past_key_values=cache, use_cache=cache is not None)
        return lm_head(out.last_hidden_state[:, -model.config.attention_group_size:]).float()

    if one_stream:
        prefill = one_stream_prefill
    if compile_config is None:
        return prefill, prefill
    held = getattr(model, "_lookaround_compiled_step", None)
    key = repr((one_stream, sorted(compile_config.to_dict().items())))
    if held is None or held[0] != key:
        options = compile_config.to_dict()
        compiled = torch.compile(prefill, fullgraph=options["fullgraph"], dynamic=False, backend=options["backend"],
                                 mode=options["mode"] if options["backend"] == "inductor" else None,
                                 options=options["options"])

        def step(*args):
            # a CUDA-graph step ("reduce-overhead") reuses its output memory at the next call: start a new
            # step, and copy the logits out of the graph's memory before it is replayed
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args).clone()

        held = model._lookaround_compiled_step = (key, step)
    return prefill, held[1]


# ----------------------------------------------------------------------------------------------
# Group decoding
# ----------------------------------------------------------------------------------------------
def _checked_prompt(input_ids, attention_mask, max_new_tokens: int, config) -> torch.Tensor:
    """The prompt's attention mask (ones if none), after the checks both decoders need: its shape, left padding,
    max_new_tokens >= 1 and a total length within max_position_embeddings."""
    prompt_len = input_ids.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(device=input_ids.device, dtype=torch.long)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    _check_left_padded(attention_mask)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    _check_length(prompt_len, config, "the prompt")
    _check_length(prompt_len + max_new_tokens, config, f"the prompt ({prompt_len} tokens) + max_new_tokens")
    return attention_mask


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
    the dar plan (``objectives/dar.py``) draws. ``t = 1`` gives ``g[i] = i`` (the AR plan). Padding gets rank 0
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


def one_stream_prompt(input_ids, attention_mask, group_size: int, bos: int, pad: int):
    """A left-padded prompt in dar's one-stream layout: ``(ids, mask, positions)``, ``(B, U)`` with ``U`` a multiple
    of ``t``. Groups of ``t`` tokens end where each prompt ends (the first text group holds ``1..t`` tokens, as the
    plan draws it), and :func:`one_stream_start_rows` BOS copies come before the prompt's BOS, so every group fills
    a block and the prompt's last ``t`` rows predict the next group. Rows are left-padded by whole blocks."""
    batch, prompt_len = input_ids.shape
    real = (attention_mask != 0).long().sum(-1, keepdim=True)  # BOS and the text
    first_group = torch.remainder(real - 2, group_size) + 1  # s1: (text - 1) mod t + 1
    row_len = one_stream_start_rows(group_size, first_group) + real
    width = int(row_len.max())
    from_end = torch.arange(width - 1, -1, -1, device=input_ids.device).expand(batch, width)
    source = (prompt_len - 1 - from_end).clamp(min=0)
    ids = torch.where(from_end < real, input_ids.gather(1, source), torch.where(from_end < row_len, bos, pad))
    positions = (torch.arange(width, device=input_ids.device) - (width - row_len)).clamp(min=0)
    return ids, (from_end < row_len).long(), positions


class GroupDecodingMixin:
    """``generate(..., group_size=t)`` runs group decoding through the query stream (:func:`group_decoding`);
    ``generate(..., draft_group_size=k)`` runs lossless self-speculative decoding (:func:`speculative_decode`).

    The usual preparation of ``generate`` (generation config, logits processors and warpers, stopping criteria
    including ``stop_strings`` with ``tokenizer=``, EOS, ``max_new_tokens``, ``num_return_sequences``) runs, and
    transformers hands decoding to :func:`group_decoding` through its ``custom_generate`` callable hook.
    Without either argument the group size is :func:`default_group_size`: ``1`` goes to transformers'
    token-by-token ``GenerationMixin.generate`` unchanged (AR decoding), a checkpoint that never trained ``t = 1``
    decodes with its own group size. ``allow_untrained=True`` decodes with a group size the checkpoint was not
    trained for (warns instead of refusing; see :func:`check_group_size`).
    """

    def generate(self, inputs=None, generation_config=None, *args, group_size=None, draft_group_size=None,
                 allow_untrained=False, **kwargs):
        if draft_group_size is not None:
            if group_size not in (None, 1):
                raise ValueError(f"draft_group_size={draft_group_size} decodes the AR (t=1) plan with drafts; "
                                 f"group_size={group_size} cannot be combined with it (drop one of them)")
            check_draft_group_size(self.config, draft_group_size, allow_untrained)
        elif group_size is None:
            group_size = default_group_size(self.config)
            if group_size == 1:  # AR decoding: transformers' own loop (static cache, compile, assisted, beams...)
                self._warn_if_prompt_ends_with_eos(inputs if inputs is not None else kwargs.get("input_ids"))
                return super().generate(inputs, generation_config, *args, **kwargs)
            logger.info("generate() without group_size: decoding with group_size=%d, the group size this checkpoint "
                        "was trained for (it never trained t=1)", group_size)
        else:
            check_group_size(self.config, group_size, allow_untrained)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("group_size / draft_group_size select group decoding; they cannot be combined with "
                             "custom_generate")
        if kwargs.get("assistant_model") is not None:
            raise ValueError("assistant_model cannot be combined with group decoding; draft_group_size=k drafts with "
                             "the model's own query stream instead")
        # transformers hands a custom_generate callable only the keys its signature adds to `_sample`'s, so the
        # streamer would be dropped: it travels bound to the callable
        decoder = functools.partial(group_decoding, streamer=kwargs.pop("streamer", None))
        self._stop_strings_to_criteria(generation_config, kwargs)
        return super().generate(
            inputs, generation_config, *args, custom_generate=decoder, group_size=group_size or 1,
            draft_group_size=draft_group_size, **kwargs,
        )

    def _stop_strings_to_criteria(self, generation_config, kwargs) -> None:
        """Build the stop-string criterion here: with a custom_generate callable, transformers drops ``tokenizer=``
        before it builds its stopping criteria (and then finds none)."""
        tokenizer = kwargs.pop("tokenizer", None)
        stop_strings = kwargs.get("stop_strings")
        if stop_strings is None:
            stop_strings = getattr(generation_config or self.generation_config, "stop_strings", None)
        if not stop_strings:
            return
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate() (or to the "
                             "text-generation pipeline's call), as transformers' own decoding does")
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
        kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None

    def _warn_if_prompt_ends_with_eos(self, input_ids) -> None:
        eos = self.config.eos_token_id
        if torch.is_tensor(input_ids) and input_ids.dim() == 2 and input_ids.shape[1] and eos is not None:
            if bool((input_ids[:, -1] == eos).any()):
                logger.warning(_EOS_PROMPT_WARNING)


_EOS_PROMPT_WARNING = (
    "a prompt ends with the EOS token: the continuation starts after the end of a finished text. Encode prompts "
    "without it (tokenizers of hf-lookaround >= issue 19 add none; for an older one pass add_special_tokens=False "
    "and put BOS in front)"
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
    draft_group_size: int | None = None,
    **model_kwargs,
):
    """transformers' ``custom_generate`` callable: ``GenerationMixin.generate`` has prepared everything."""
    if generation_config.num_beams > 1:
        raise ValueError("group decoding takes the argmax or samples; beam search (num_beams > 1) is not supported")
    # features transformers' own loop has and these decoders do not: a clear error rather than a silent None
    unsupported = {
        "output_attentions": "attention weights of each step",
        "output_hidden_states": "hidden states of each step",
        "prompt_lookup_num_tokens": "prompt-lookup drafting (use draft_group_size)",
    }
    for name, what in unsupported.items():
        if getattr(generation_config, name, None):
            raise ValueError(f"{name}: {what} is not supported with group_size / draft_group_size; drop it, or "
                             "decode token by token (generate() without them)")
    if getattr(generation_config, "guidance_scale", None) not in (None, 1, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) runs the model token by token beside the decoder: "
                         "not supported with group_size / draft_group_size")
    cache_implementation = getattr(generation_config, "cache_implementation", None)
    if cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            f"group decoding keeps a DynamicCache, or a StaticCache with cache_implementation='static' (compiled, "
            f"fixed shapes); cache_implementation={cache_implementation!r} serves token-by-token generate() only"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("group decoding starts from input_ids (the cache holds content of known tokens); "
                         "pass input_ids instead of inputs_embeds")
    past = model_kwargs.get("past_key_values")
    if past is not None and past.get_seq_length() > 0:
        raise ValueError("group decoding builds its cache from the prompt; pass no filled past_key_values")
    if streamer is not None:
        streamer.put(input_ids.cpu())  # what transformers' own loop does first (TextStreamer skips it, skip_prompt)
    pad = generation_config._pad_token_tensor
    eos = generation_config._eos_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)
    common = dict(
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=generation_config.do_sample,
        pad_token_id=pad_id,
        return_dict=generation_config.return_dict_in_generate,
        output_scores=generation_config.output_scores,
        output_logits=generation_config.output_logits,
        streamer=streamer,
    )
    use_cache = model_kwargs.get("use_cache")
    use_cache = True if use_cache is None else bool(use_cache)  # unset: group decoding keeps a KV cache
    if cache_implementation == "static":
        common["compile_config"] = _compile_config(model, generation_config)
        common["static_cache"] = True
    if draft_group_size is not None:
        if not use_cache:
            raise ValueError("self-speculative decoding crops rejected drafts from the KV cache: use_cache=False "
                             "is not supported with draft_group_size")
        return _speculative_decode(model, input_ids, model_kwargs.get("attention_mask"),
                                   draft_group_size=draft_group_size, **common)
    return _group_decode(model, input_ids, model_kwargs.get("attention_mask"), group_size=group_size,
                         use_cache=use_cache, **common)


@torch.no_grad()
def group_generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    group_size: int | None = None,
    draft_group_size: int | None = None,
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

    ``group_size`` defaults to :func:`default_group_size`; ``draft_group_size=k`` runs self-speculative decoding
    (:func:`speculative_decode`) instead. ``input_ids`` ``(B, P)`` left-padded (or a list of ids for one row);
    ``eos_token_id`` / ``pad_token_id``
    default to the config's (``eos_token_id=[]``: no EOS, always ``max_new_tokens``); ``logits_processor`` runs
    after the sampling warpers built from
    ``temperature``/``top_k``/``top_p``. Returns the sequences ``(B, P + n)``, or a ``GenerateDecoderOnlyOutput``.
    """
    if draft_group_size is not None:
        if group_size not in (None, 1):
            raise ValueError(f"draft_group_size={draft_group_size} decodes the AR (t=1) plan with drafts; "
                             f"group_size={group_size} cannot be combined with it (drop one of them)")
        check_draft_group_size(model.config, draft_group_size, allow_untrained)
        if not use_cache:
            raise ValueError("self-speculative decoding crops rejected drafts from the KV cache: use_cache=False "
                             "is not supported with draft_group_size")
    else:
        group_size = default_group_size(model.config) if group_size is None else group_size
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
    common = dict(
        max_new_tokens=max_new_tokens, logits_processor=processors, stopping_criteria=criteria, do_sample=do_sample,
        pad_token_id=int(pad_token_id), return_dict=return_dict_in_generate, output_scores=output_scores,
        output_logits=output_logits, generator=generator,
    )
    if draft_group_size is not None:
        return _speculative_decode(model, input_ids, attention_mask, draft_group_size=draft_group_size, **common)
    return _group_decode(model, input_ids, attention_mask, group_size=group_size, use_cache=use_cache, **common)


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
    static_cache=False,
    compile_config=None,
):
    backbone, lm_head = model.base_model, model.lm_head
    config = model.config
    batch, prompt_len = input_ids.shape
    if static_cache and not use_cache:
        raise ValueError("cache_implementation='static' needs use_cache=True")
    device = input_ids.device
    attention_mask = _checked_prompt(input_ids, attention_mask, max_new_tokens, config)

    if config.eos_token_id is not None and bool((input_ids[:, -1] == config.eos_token_id).any()):
        # the package's tokenizers wrap text as <s> ... </s>; a continuation of a finished text is rarely meant
        logger.warning(_EOS_PROMPT_WARNING)
    total = prompt_len + max_new_tokens
    first_real = input_ids.gather(1, (attention_mask == 0).sum(-1, keepdim=True)).squeeze(1)
    bos = config.bos_token_id
    has_condition = first_real == bos if bos is not None else torch.zeros(batch, dtype=torch.bool, device=device)
    # the whole plan is known up front: ranks and positions of every column, prompt and continuation
    ranks, positions = semi_ar_ranks(attention_mask, total, group_size, has_condition)
    one_stream = is_one_stream_group_model(config)
    if one_stream:
        if bos is None or not bool(has_condition.all()):
            raise ValueError("a one-stream (block-causal) checkpoint decodes prompts that start with the BOS token "
                             "(its start rows are copies of it): put tokenizer.bos_token in front of each prompt")
        stream_ids, stream_mask, stream_positions = one_stream_prompt(input_ids, attention_mask, group_size, bos,
                                                                      pad_token_id)
        stream_prefill, stream_step = _decoding_step(model, compile_config if static_cache else None, one_stream=True)
        # the positions of the generated columns continue each row's prompt
        generated_positions = stream_positions[:, -1:] + 1 + torch.arange(max_new_tokens, device=device)

    # one buffer for the whole output: a step writes its columns, views give the sequence so far (no copies)
    buffer = input_ids.new_full((batch, total), pad_token_id)
    buffer[:, :prompt_len] = input_ids
    mask = attention_mask.new_zeros((batch, total))  # generated columns become valid as they are written
    mask[:, :prompt_len] = attention_mask
    # warpers that never read input_ids treat the slots of a group in one call
    one_call = all(isinstance(p, _POSITIONLESS_PROCESSORS) for p in logits_processor)
    # with EOS and the token budget as the only criteria, a group's tokens are written in one set of operations, not
    # one per token: at batch 8 a small model's compiled step is short, and per-token bookkeeping was most of a group
    eos_ids, other_criteria = _split_criteria(stopping_criteria, total)
    whole_group = one_call and not other_criteria
    eos_ids = None if eos_ids is None else eos_ids.to(device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    cache = DynamicCache(config=config) if use_cache else None
    if static_cache and one_stream:  # a slot for every key: the laid-out prompt and every new token
        cache = _static_cache(model, batch, stream_ids.shape[1] + max_new_tokens, input_ids.dtype)
    elif static_cache:
        # fixed shapes, so that a compiled step is reused: every key of the plan is passed (the cache has a slot for
        # each column), and the query rows of a last, cut group are padded to t
        cache = _static_cache(model, batch, total, input_ids.dtype)
        prefill, step = _decoding_step(model, compile_config)
        query_positions = F.pad(positions, (0, group_size), value=0)
        query_ranks = F.pad(ranks, (0, group_size), value=NO_TARGET_RANK)
    length, past = prompt_len, 0  # columns decided / columns whose content is in the cache
    all_scores, all_logits = [], []
    while True:
        width = min(group_size, total - length)  # the last group may be cut by max_new_tokens
        if width <= 0:
            break
        slots = slice(length, length + width)
        if one_stream:
            # the rows of the group written last (the prompt's last block at first) predict the next group
            keys = mask[:, prompt_len:] if static_cache else mask[:, prompt_len:length]
            key_mask = torch.cat([stream_mask, keys], 1)
            if past and cache is not None:
                ids = buffer[:, past:length]
                position_ids = generated_positions[:, past - prompt_len : length - prompt_len]
            else:  # the prompt (and without a cache, everything written since)
                ids = torch.cat([stream_ids, buffer[:, prompt_len:length]], 1)
                position_ids = torch.cat([stream_positions, generated_positions[:, : length - prompt_len]], 1)
            forward = stream_step if (past and static_cache) else stream_prefill
            logits = forward(ids, key_mask, position_ids, cache)[:, :width]
            past = length
        elif static_cache:
            forward = step if past else prefill  # the prompt's forward has its own width
            logits = forward(buffer[:, past:length], mask, ranks, positions[:, past:length], cache,
                             query_positions[:, length : length + group_size],
                             query_ranks[:, length : length + group_size])[:, :width]
            past = length
        elif cache is not None:
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
        if not (static_cache or one_stream):
            logits = lm_head(out.query_hidden_state[:, :width]).float()
        if one_call:
            group_scores = logits.flatten(0, 1)
            if len(logits_processor):
                group_scores = logits_processor(buffer[:, :length].repeat_interleave(width, 0), group_scores)
            group_scores = group_scores.view(batch, width, -1)
            group_tokens = _pick(group_scores.flatten(0, 1), do_sample, generator).view(batch, width)
        if whole_group:
            alive = unfinished[:, None].expand(batch, width)
            if eos_ids is not None:  # a slot is written while no earlier slot of its group ended the row
                ends = torch.isin(group_tokens, eos_ids)
                alive = alive & (ends.long().cumsum(1) - ends.long() == 0)
                unfinished = unfinished & ~ends.any(1)
            buffer[:, slots] = torch.where(alive, group_tokens, pad_token_id)
            mask[:, slots] = 1
            all_scores.extend(group_scores.unbind(1) if output_scores else ())
            all_logits.extend(logits.unbind(1) if output_logits else ())
        else:
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
# Self-speculative decoding
# ----------------------------------------------------------------------------------------------
@dataclass
class GenerateSpeculativeOutput(GenerateDecoderOnlyOutput):
    """What ``generate(..., draft_group_size=k, return_dict_in_generate=True)`` returns: transformers' decoder-only
    output (``sequences``, ``scores`` / ``logits`` of the AR pathway, one entry per new token) and how the drafts
    fared.

    num_drafted (`(B,)`): drafts each row had verified (those within its token budget).
    num_accepted (`(B,)`): drafts the AR pathway accepted.
    num_forwards (`int`): forwards of the model, the prompt's included.
    """

    num_drafted: torch.LongTensor | None = None
    num_accepted: torch.LongTensor | None = None
    num_forwards: int | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over the batch (NaN when nothing was drafted)."""
        drafted = int(self.num_drafted.sum()) if self.num_drafted is not None else 0
        return int(self.num_accepted.sum()) / drafted if drafted else float("nan")


def _apply(processors: LogitsProcessorList, positionless: bool, prefixes, scores: torch.Tensor) -> torch.Tensor:
    """Processed ``scores`` (N, V). Processors that read the sequence so far see each row's own ``prefixes``
    (1-D ids; rows of a batch advance by different numbers of tokens); the others take all rows in one call."""
    if not len(processors):
        return scores
    if positionless:
        return processors(scores.new_zeros((scores.shape[0], 1), dtype=torch.long), scores)
    return torch.cat([processors(prefix[None], row[None]) for prefix, row in zip(prefixes, scores)])


def _split_criteria(criteria: StoppingCriteriaList, max_length: int):
    """(EOS ids, other criteria): EOS and the token budget are applied to a whole batch at once; any other criterion
    (stop strings, your own) is asked row by row, token by token, as transformers' loop asks it."""
    eos, others = [], []
    for criterion in criteria:
        if isinstance(criterion, EosTokenCriteria):
            eos.append(torch.as_tensor(criterion.eos_token_id).flatten())
        elif not (isinstance(criterion, MaxLengthCriteria) and criterion.max_length >= max_length):
            others.append(criterion)
    return (torch.cat(eos) if eos else None), others


def _crop_cache(cache, columns: int) -> None:
    """Keep the first ``columns`` columns of every layer (a static cache keeps its slots and forgets the rest)."""
    if isinstance(cache, DynamicCache):
        cache.crop(columns - cache.get_seq_length())
        return
    for layer in cache.layers:
        layer.cumulative_length.fill_(columns)


def _compact_cache(cache, key_valid: torch.Tensor, key_pos: torch.Tensor, columns: int) -> int:
    """Move each row's valid cache columns (of the first ``columns``) to the right end of the new first columns, a
    left-padded layout, and drop the columns no row needs: rows that kept different numbers of drafts leave holes,
    which would otherwise grow every step. ``key_valid`` / ``key_pos`` (full width) are updated in place; returns the
    new number of columns."""
    valid = key_valid[:, :columns]
    keep = int(valid.sum(-1).max())
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, columns - keep :]
    for layer in cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        keys, values = layer.keys[:, :, :columns].gather(2, index), layer.values[:, :, :columns].gather(2, index)
        if isinstance(cache, DynamicCache):
            layer.keys, layer.values = keys, values
        else:  # a static cache keeps its tensors (a compiled step holds their addresses)
            layer.keys[:, :, :keep].copy_(keys)
            layer.values[:, :, :keep].copy_(values)
    if not isinstance(cache, DynamicCache):
        _crop_cache(cache, keep)
    key_valid[:, :keep], key_pos[:, :keep] = valid.gather(1, order), key_pos[:, :columns].gather(1, order)
    key_valid[:, keep:] = False
    return keep


def _speculative_decode(
    model,
    input_ids,
    attention_mask,
    *,
    draft_group_size,
    max_new_tokens,
    logits_processor,
    stopping_criteria,
    do_sample,
    pad_token_id,
    return_dict=False,
    output_scores=False,
    output_logits=False,
    streamer=None,
    generator=None,
    static_cache=False,
    compile_config=None,
):
    """Lossless self-speculative decoding: the tokens of AR (``t = 1``) decoding, up to ``k`` of them per forward.

    Ranks follow the AR plan (a token's rank is its position), so the content in the cache is that of AR decoding.
    Each step is one forward whose content rows are the token picked last and the ``k - 1`` drafts after it
    (causal among themselves, as AR content is), and whose query rows are ``k`` groups of ``k`` rows: group ``a``
    sits at the ``k`` positions after the last token and the first ``a`` drafts, with one rank, so it reads exactly
    those. Its first row is the AR pathway's prediction there: group ``a``'s first row verifies draft ``a + 1``
    (greedy: equal to the argmax; sampling: accepted with probability ``min(1, p/q)``, else the token is drawn from
    ``max(0, p - q)``, the standard speculative rule, so the output is distributed as ``t = 1`` sampling). After
    ``a`` accepted drafts, the group at ``a`` also holds the next drafts (its other ``k - 1`` rows, the ``dar``
    plan's look-ahead), so drafting costs no extra forward. Rejected drafts leave the cache; rows of a batch keep
    different numbers of them (the cache is compacted to a left-padded layout).
    """
    config = model.config
    k = draft_group_size
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    attention_mask = _checked_prompt(input_ids, attention_mask, max_new_tokens, config)
    if streamer is not None and batch > 1:
        raise ValueError("a streamer takes one row: stream with batch size 1 (and num_return_sequences=1)")
    if config.eos_token_id is not None and bool((input_ids[:, -1] == config.eos_token_id).any()):
        logger.warning(_EOS_PROMPT_WARNING)
    limit = config.max_position_embeddings
    eos_ids, other_criteria = _split_criteria(stopping_criteria, prompt_len + max_new_tokens)
    eos_ids = eos_ids.to(device) if eos_ids is not None else None
    positionless = all(isinstance(p, _POSITIONLESS_PROCESSORS) for p in logits_processor)
    rows = torch.arange(batch, device=device)

    real = attention_mask.sum(-1)  # prompt tokens of each row; its new token i sits at position real + i
    last_position = real + max_new_tokens - 1  # the last position a row may fill
    # the output: left-padded prompt, then each row's new tokens; a spare last column takes writes past a row's end
    out = input_ids.new_full((batch, prompt_len + max_new_tokens + 1), pad_token_id)
    out[:, :prompt_len] = input_ids
    spare = out.shape[1] - 1
    num_new = torch.zeros(batch, dtype=torch.long, device=device)
    unfinished = torch.ones(batch, dtype=torch.bool, device=device)
    drafted, accepted = torch.zeros_like(num_new), torch.zeros_like(num_new)
    # ranks are positions (the AR plan); the cache's columns: which hold a kept token, and its position. At most
    # prompt + new tokens - 1 columns are kept, and a step appends k before its rejected drafts leave
    max_columns = prompt_len + max_new_tokens + k
    key_valid = attention_mask.new_zeros((batch, max_columns), dtype=torch.bool)
    key_pos = attention_mask.new_zeros((batch, max_columns))
    columns = 0  # columns in the cache
    if static_cache:
        # fixed shapes for a compiled step: full-width ranks and mask, always k content rows and k groups of k
        cache = _static_cache(model, batch, max_columns, input_ids.dtype)
        prefill, step = _decoding_step(model, compile_config)
    else:
        cache = DynamicCache(config=config)
        prefill, step = _decoding_step(model, None)
    # the first forward: the prompt's content, one group of k query rows after it
    step_ids, step_pos, step_valid = input_ids, (attention_mask.cumsum(-1) - 1).clamp(min=0), attention_mask != 0
    drafts = draft_probs = None
    records, forwards = [], 0
    while True:
        groups = step_ids.shape[1] if drafts is not None else 1  # last token + (groups - 1) drafts to verify
        nxt = real + num_new  # the position after each row's last committed token
        group_rank = nxt[:, None] + torch.arange(groups, device=device)  # (B, groups)
        query_pos = (group_rank[:, :, None] + torch.arange(k, device=device)).flatten(1)  # (B, groups * k)
        query_rank = group_rank[:, :, None].expand(-1, -1, k).flatten(1)
        is_slot = (query_pos <= last_position[:, None]) & unfinished[:, None]
        query_pos, query_rank = torch.where(is_slot, query_pos, 0), torch.where(is_slot, query_rank, NO_TARGET_RANK)
        if static_cache and drafts is not None and groups < k:  # pad to k content rows and k groups
            step_ids = F.pad(step_ids, (0, k - groups), value=pad_token_id)
            step_pos = F.pad(step_pos, (0, k - groups), value=0)
            step_valid = F.pad(step_valid, (0, k - groups), value=False)
            query_pos = F.pad(query_pos, (0, (k - groups) * k), value=0)
            query_rank = F.pad(query_rank, (0, (k - groups) * k), value=NO_TARGET_RANK)
        width = step_ids.shape[1]
        key_valid[:, columns : columns + width], key_pos[:, columns : columns + width] = step_valid, step_pos
        keys = slice(None) if static_cache else slice(0, columns + width)
        forward = step if drafts is not None else prefill  # the prompt's forward has its own width
        logits = forward(step_ids, key_valid[:, keys].long(), key_pos[:, keys], step_pos, cache, query_pos, query_rank)
        forwards += 1
        columns += width
        # the columns of the last token and the drafts (after the prompt: its last token), which rejections crop
        first_new = columns - 1 if drafts is None else columns - width
        logits = logits[:, : groups * k].view(batch, groups, k, -1)

        # verify: the first row of group a is the AR pathway at position nxt + a, after the first a drafts
        ar_logits = logits[:, :, 0]
        committed = [out[b, : prompt_len + int(num_new[b])] for b in range(batch)] if not positionless else None
        prefixes = None if positionless else [
            torch.cat([committed[b], drafts[b, :a]]) if a else committed[b] for b in range(batch) for a in range(groups)
        ]
        ar_scores = _apply(logits_processor, positionless, prefixes, ar_logits.flatten(0, 1)).view_as(ar_logits)
        ar_probs = torch.softmax(ar_scores, -1) if do_sample else None
        if groups > 1:
            to_verify = drafts[:, : groups - 1]
            if do_sample:
                p = ar_probs[:, : groups - 1].gather(-1, to_verify[..., None]).squeeze(-1)
                q = draft_probs[:, : groups - 1].gather(-1, to_verify[..., None]).squeeze(-1)
                u = torch.rand(p.shape, device=device, generator=generator)
                ok = u * q < p  # accepted with probability min(1, p / q)
            else:
                ok = to_verify == ar_scores[:, : groups - 1].argmax(-1)
            num_ok = ok.long().cumprod(-1).sum(-1)  # drafts accepted before the first rejection
        else:
            num_ok = torch.zeros_like(num_new)
        # the token after the accepted drafts: AR's own pick, or a draw from max(0, p - q) where a draft was rejected
        if do_sample:
            dist = ar_probs[rows, num_ok]
            if groups > 1:
                residual = (dist - draft_probs[rows, num_ok.clamp(max=groups - 2)]).clamp(min=0)
                use = (num_ok < groups - 1) & (residual.sum(-1) > 0)
                dist = torch.where(use[:, None], residual, dist)
            token = torch.multinomial(dist, 1, generator=generator).squeeze(-1)
        else:
            token = ar_scores[rows, num_ok].argmax(-1)

        # commit the accepted drafts and the token, within each row's budget, up to EOS
        budget = max_new_tokens - num_new
        candidates = torch.cat([drafts[:, : groups - 1], token[:, None]], 1) if groups > 1 else token[:, None]
        candidates = candidates.scatter(1, num_ok[:, None], token[:, None])
        slot = torch.arange(groups, device=device)
        count = torch.where(unfinished, torch.minimum(num_ok + 1, budget), 0)
        stopped = torch.zeros_like(unfinished)
        if eos_ids is not None:
            is_eos = torch.isin(candidates, eos_ids) & (slot < count[:, None])
            has_eos = is_eos.any(-1)
            count = torch.where(has_eos, is_eos.long().argmax(-1) + 1, count)
            stopped |= has_eos
        keep = slot < count[:, None]
        out_columns = torch.where(keep, prompt_len + num_new[:, None] + slot, spare)
        out.scatter_(1, out_columns, torch.where(keep, candidates, pad_token_id))
        if other_criteria:  # asked as transformers' loop asks: each row, after each token
            for b in unfinished.nonzero().flatten().tolist():
                for i in range(int(count[b])):
                    end = prompt_len + int(num_new[b]) + i + 1
                    if any(bool(c(out[b : b + 1, :end], ar_scores[b, i][None]).any()) for c in other_criteria):
                        out[b, end:spare] = pad_token_id
                        count[b], stopped[b] = i + 1, True
                        break
        verifiable = torch.minimum(torch.full_like(budget, groups - 1), budget - 1).clamp(min=0)
        drafted += torch.where(unfinished, verifiable, 0)
        accepted += torch.where(unfinished, torch.minimum(num_ok, verifiable), 0)
        if output_scores or output_logits:
            records.append((num_new.clone(), count.clone(), ar_scores if output_scores else None,
                            ar_logits if output_logits else None))
        if streamer is not None and int(count[0]):
            streamer.put(out[0, prompt_len + int(num_new[0]) : prompt_len + int(num_new[0] + count[0])].cpu())
        num_new = num_new + count
        unfinished = unfinished & ~stopped & (num_new < max_new_tokens)
        if not bool(unfinished.any()):
            break

        # rejected drafts leave the cache: a row keeps its last token and the drafts it accepted
        kept = num_ok + 1
        most = int(kept[unfinished].max())
        kept = torch.where(unfinished, kept, most)  # finished rows are never read again
        # (a row that finished keeps none: its content is never read again)
        key_valid[:, first_new:columns] &= (torch.arange(columns - first_new, device=device) < kept[:, None]) \
            & unfinished[:, None]
        if bool((kept == most).all()):  # every row keeps as many: crop (always so at batch 1)
            if first_new + most < columns:
                columns = first_new + most
                _crop_cache(cache, columns)
                key_valid[:, columns:] = False
        if not bool((kept == most).all()) or columns + k > min(max_columns, limit):
            # holes: compact (also when rows that finished or lag behind leave too little room for the next step)
            columns = _compact_cache(cache, key_valid, key_pos, columns)

        # the next drafts: the other rows of the group after the accepted ones (it never saw `token`, sampled now)
        draft_logits = logits[rows, num_ok, 1:]  # (B, k - 1, V)
        new_drafts = token.new_zeros((batch, k - 1))
        if positionless:
            draft_scores = _apply(logits_processor, True, None, draft_logits.flatten(0, 1)).view_as(draft_logits)
            new_drafts = _pick(draft_scores.flatten(0, 1), do_sample, generator).view(batch, k - 1)
        else:
            draft_scores = torch.empty_like(draft_logits)
            for s in range(k - 1):  # slot by slot: processors see the drafts before the slot
                prefixes = [torch.cat([out[b, : prompt_len + int(num_new[b])], new_drafts[b, :s]]) for b in range(batch)]
                draft_scores[:, s] = _apply(logits_processor, False, prefixes, draft_logits[:, s])
                new_drafts[:, s] = _pick(draft_scores[:, s], do_sample, generator)
        draft_probs = torch.softmax(draft_scores, -1) if do_sample else None
        drafts = new_drafts

        # the next forward: content of the token and of the drafts, causal among themselves, at positions after it
        last = out.gather(1, (prompt_len + num_new - 1)[:, None]).squeeze(1)
        # fewer drafts near the end: none past the largest budget left, no more keys than positions
        width = min(k, int((max_new_tokens - num_new)[unfinished].max()), limit - columns)
        step_ids = torch.cat([last[:, None], drafts], 1)[:, :width]
        step_pos = (nxt + count - 1)[:, None] + torch.arange(width, device=device)
        # a finished row's content is never read: left invalid, it never widens the cache
        step_valid = (step_pos <= last_position[:, None]) & unfinished[:, None]
        step_pos = step_pos.clamp(max=limit - 1)

    length = prompt_len + int(num_new.max())
    sequences = out[:, :length]
    if streamer is not None:
        streamer.end()
    if drafted.sum() > 0:
        logger.info("self-speculative decoding (k=%d): %d of %d drafts accepted (%.1f%%), %d forwards for %d tokens",
                    k, int(accepted.sum()), int(drafted.sum()), 100.0 * int(accepted.sum()) / int(drafted.sum()),
                    forwards, int(num_new.sum()))
    if not return_dict:
        return sequences
    scores = logits_out = None
    if records:
        total = int(num_new.max())
        vocab = logits.shape[-1]
        stacked = {name: torch.zeros(total, batch, vocab, device=device) for name in ("scores", "logits")}
        for start, count, step_scores, step_logits in records:
            slot = torch.arange(step_scores.shape[1] if step_scores is not None else step_logits.shape[1], device=device)
            mask = slot[None] < count[:, None]
            b_idx, i_idx = mask.nonzero(as_tuple=True)
            for name, values in (("scores", step_scores), ("logits", step_logits)):
                if values is not None:
                    stacked[name][start[b_idx] + i_idx, b_idx] = values[b_idx, i_idx]
        scores = tuple(stacked["scores"]) if output_scores else None
        logits_out = tuple(stacked["logits"]) if output_logits else None
    return GenerateSpeculativeOutput(
        sequences=sequences, scores=scores, logits=logits_out, past_key_values=cache,
        num_drafted=drafted, num_accepted=accepted, num_forwards=forwards,
    )
