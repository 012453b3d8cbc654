"""What every decoder of the model bundle shares (DESIGN.md, "Decoding with the streams").

- :class:`DecodingStrategy`, the interface through which a decoder plugs into ``generate()``: ``check`` refuses a
  checkpoint it was not trained for, ``decode`` runs it on a checked, left-padded prompt with the options
  ``generate()`` prepared (transformers' ``CandidateGenerator`` and dllm's ``BaseSampler`` reduced to the two calls
  these decoders need). Group decoding (``generation_lookaround``), self-speculative decoding
  (``speculation_lookaround``) and the package's infilling (``hf_lookaround.decoding.infill``) are strategies; a
  new decoder (a masked-diffusion sampler) is one module with one subclass, passed as ``generate(decoding=...)``.
- What a checkpoint was trained for: the group sizes it decodes (recorded from its objective's ``Params`` in
  ``config.decoding_group_sizes``) and the refusals.
- The edges of every decoding loop: process and pick, a stop tracker, the output, the prompt checks, the static
  cache and the compiled step.

The layouts (semi-AR ranks, dar's one-stream prompt and next-token view) are ``layout_lookaround``'s.
"""

from __future__ import annotations

import logging

import torch
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

from .inputs_lookaround import PreparedInputs

logger = logging.getLogger(__name__)

__all__ = [
    "DecodingStrategy",
    "LEGACY_GROUP_DECODING_OBJECTIVES",
    "UntrainedDecodingError",
    "trained_group_sizes",
    "default_group_size",
    "check_group_size",
    "is_one_stream_group_model",
    "make_logits_processor",
    "process_and_pick",
    "sampling_noise",
    "kept_compiled",
    "StopTracker",
    "build_output",
]

# What a checkpoint can group-decode is recorded in `config.decoding_group_sizes`, from the objective's parameters
# (objectives/base.py, `ObjectiveParams.config_fields`). Configs written before that field existed fall back to
# these frozen facts: the look-ahead objectives of that time and the group size their plan trained when
# `plan_params` has no "t".
LEGACY_GROUP_DECODING_OBJECTIVES = {"ar": 1, "dar": 2}
# The objective whose plan_params are {"mixture": {name: weight}, "components": {name: plan params}}: an old
# mixture checkpoint decodes with the group sizes of its look-ahead components.
MIXTURE_OBJECTIVE = "mixture"


# sampling warpers that read only the scores, never the sequence so far
_POSITIONLESS_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                            TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


class UntrainedDecodingError(ValueError):
    """A decoder the checkpoint was not trained for (pass ``allow_untrained=True`` to run it anyway)."""


class DecodingStrategy:
    """One decoder, as ``generate(..., decoding=strategy)`` runs it (``group_size=t`` and ``draft_group_size=k`` are
    shorthands for the bundle's own two). ``generate()`` (or :func:`group_generate`) prepares the options (the
    logits processors and warpers, stopping criteria, ``max_new_tokens``, the cache), calls :meth:`check` once, checks
    the prompt (shape, left padding, length) and calls :meth:`decode`."""

    def check(self, config, allow_untrained: bool = False) -> None:
        """Refuse (an :class:`UntrainedDecodingError`, or a warning with ``allow_untrained``) a checkpoint this
        decoder reads a pathway of that it was never trained for."""
        raise NotImplementedError

    def decode(self, model, input_ids: torch.LongTensor, attention_mask: torch.LongTensor, options):
        """Decode ``options.max_new_tokens`` tokens after the left-padded prompt ``input_ids`` ``(B, P)``:
        the sequences ``(B, P + n)``, or with ``options.return_dict`` transformers' output (:func:`build_output`).
        ``options``: a ``DecodingOptions`` (``generation_lookaround``)."""
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------
# What a checkpoint was trained for
# ----------------------------------------------------------------------------------------------
def trained_group_sizes(config) -> tuple[int, ...] | None:
    """Group sizes ``t`` the checkpoint's plan trained: ``config.decoding_group_sizes`` (recorded from the objective's
    parameters; ``()`` for masked / GVP objectives); ``None`` when the config records neither it nor an objective."""
    recorded = getattr(config, "decoding_group_sizes", None)
    if recorded is not None:
        return tuple(int(t) for t in recorded)
    return _legacy_group_sizes(config)


def _legacy_group_sizes(config) -> tuple[int, ...] | None:
    """The group sizes of a config written before ``decoding_group_sizes``: ``(1,)`` for ``ar``,
    ``plan_params["t"]`` (an int or a list) for ``dar``, the union over look-ahead components for a mixture."""
    objective = getattr(config, "objective", None)
    if objective is None:
        return None
    params = getattr(config, "plan_params", None) or {}
    if objective == MIXTURE_OBJECTIVE:  # the union over its look-ahead components of positive weight
        components = params.get("components") or {}
        sizes = set()
        for name, weight in (params.get("mixture") or {}).items():
            if name in LEGACY_GROUP_DECODING_OBJECTIVES and float(weight) > 0:
                sizes.update(_sizes_of(name, components.get(name) or {}))
        return tuple(sorted(sizes))
    if objective not in LEGACY_GROUP_DECODING_OBJECTIVES:
        return ()
    return _sizes_of(objective, params)


def _sizes_of(objective: str, params: dict) -> tuple[int, ...]:
    t = params.get("t", LEGACY_GROUP_DECODING_OBJECTIVES[objective])
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


def is_block_diffusion_model(config) -> bool:
    """BD3-LM's one-stream form: the content stream reads ``x_t ⊕ x_0`` (``default_attention="block_diffusion"``)."""
    return getattr(config, "prediction_stream", None) == "content" and \
        getattr(config, "default_attention", None) == "block_diffusion"


# ----------------------------------------------------------------------------------------------
# The edges every decoder shares: process and pick, when to stop, what to return
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


def reads_only_scores(processors: LogitsProcessorList) -> bool:
    """Whether every processor reads the scores alone, never the sequence so far (sampling warpers): then the rows of
    a group, or of drafts, are processed in one call."""
    return all(isinstance(p, _POSITIONLESS_PROCESSORS) for p in processors)


def process(processors: LogitsProcessorList, scores: torch.Tensor, context=None) -> torch.Tensor:
    """``scores`` (N, V) after the logits processors and warpers, each row after its own ``context``: the ids it
    follows, as one (N, L) tensor, or as a list of N 1-D prefixes when rows have advanced by different numbers of
    tokens (each row is then processed alone); None when the processors read only the scores."""
    if not len(processors):
        return scores
    if context is None:
        return processors(scores.new_zeros((scores.shape[0], 1), dtype=torch.long), scores)
    if isinstance(context, list):
        return torch.cat([processors(prefix[None], row[None]) for prefix, row in zip(context, scores)])
    return processors(context, scores)


def process_and_pick(processors, logits: torch.Tensor, context, do_sample: bool, generator=None, noise=None):
    """``(scores, tokens)``: the processed ``logits`` (N, V) (see :func:`process`) and a token per row, a draw from
    their softmax or the argmax (``noise``: see :func:`_pick`)."""
    scores = process(processors, logits, context)
    return scores, _pick(scores, do_sample, generator, noise)


def _pick(scores: torch.Tensor, do_sample: bool, generator=None, noise=None) -> torch.Tensor:
    """(N, V) processed scores -> (N,) tokens: a draw from their softmax, or the argmax. ``noise``: the
    :func:`sampling_noise` of the draw, drawn before a compiled step (a ``torch.Generator`` cannot enter its graph);
    the token is then ``torch.multinomial``'s own, bit for bit."""
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores.float(), dim=-1)
    if noise is not None:
        return (probs / noise).argmax(-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def sampling_noise(shape, device, generator=None) -> torch.Tensor:
    """What ``torch.multinomial(probs, 1, generator=generator)`` draws for ``probs`` of ``shape`` (N, V) float32:
    exponential noise ``q``, its token ``argmax(probs / q)`` (the Gumbel-max trick; torch's one-sample path,
    ``aten/native/Distributions.cpp``). Drawn outside a graph, it gives the eager draw's tokens inside one."""
    return torch.empty(shape, dtype=torch.float32, device=device).exponential_(1, generator=generator)


class StopTracker:
    """Which rows are still decoding, and what the streamer is shown.

    EOS and the token budget are applied to a whole batch at once (a decoder stops at ``max_length`` itself); any
    other criterion (stop strings, your own) is asked as transformers' loop asks it, after each token."""

    def __init__(self, stopping_criteria: StoppingCriteriaList, max_length: int, batch: int, device, streamer=None):
        self.criteria, self.streamer = stopping_criteria, streamer
        eos, self.others = [], []
        for criterion in stopping_criteria:
            if isinstance(criterion, EosTokenCriteria):
                eos.append(torch.as_tensor(criterion.eos_token_id).flatten())
            elif not (isinstance(criterion, MaxLengthCriteria) and criterion.max_length >= max_length):
                self.others.append(criterion)
        self.eos_ids = torch.cat(eos).to(device) if eos else None
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)

    def until_eos(self, tokens: torch.Tensor, count: torch.Tensor):
        """Of each row's first ``count`` candidate ``tokens`` (B, n), how many it keeps: up to and including its
        first EOS. Returns ``(count, ended)``, ``ended`` the rows that wrote an EOS."""
        if self.eos_ids is None:
            return count, torch.zeros_like(self.unfinished)
        slot = torch.arange(tokens.shape[1], device=tokens.device)
        is_eos = torch.isin(tokens, self.eos_ids) & (slot < count[:, None])
        ended = is_eos.any(-1)
        return torch.where(ended, is_eos.long().argmax(-1) + 1, count), ended

    def until_other_stop(self, sequences: torch.Tensor, starts: torch.Tensor, count: torch.Tensor, scores):
        """Ask the other criteria after each of the ``count[b]`` tokens that row ``b`` of ``sequences`` holds from
        column ``starts[b]`` (``scores[b, i]`` those of its token ``i``). Returns ``(count, stopped)``: a row that
        stops keeps the tokens up to the one that stopped it."""
        stopped = torch.zeros_like(self.unfinished)
        if not self.others:
            return count, stopped
        count = count.clone()
        for b in self.unfinished.nonzero().flatten().tolist():
            for i in range(int(count[b])):
                end = int(starts[b]) + i + 1
                if any(bool(c(sequences[b : b + 1, :end], scores[b, i][None]).any()) for c in self.others):
                    count[b], stopped[b] = i + 1, True
                    break
        return count, stopped

    def after_token(self, sequences: torch.Tensor, scores: torch.Tensor) -> None:
        """Every criterion, on the whole batch, after one more token per row (transformers' own loop)."""
        self.stop(self.criteria(sequences, scores))

    def stop(self, rows: torch.Tensor) -> None:
        self.unfinished &= ~rows  # in place: a compiled speculative step holds its address

    @property
    def done(self) -> bool:
        return not bool(self.unfinished.any())

    def put(self, tokens: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


def build_output(options, sequences, cache, scores=None, logits=None, output_class=None, **extra):
    """What a decoder returns: the sequences, or with ``return_dict_in_generate`` transformers' decoder-only output
    (``scores`` / ``logits``: one (B, V) tensor per new token, where asked for)."""
    if not options.return_dict:
        return sequences
    return (output_class or GenerateDecoderOnlyOutput)(
        sequences=sequences,
        scores=tuple(scores) if options.output_scores else None,
        logits=tuple(logits) if options.output_logits else None,
        past_key_values=cache,
        **extra,
    )


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
                       query_position_ids=query_position_ids, query_group_ids=query_group_ids,
                       prepared=_QUERY_ROWS_ONLY)
        return lm_head(out.query_hidden_state).float()

    def one_stream_prefill(input_ids, attention_mask, position_ids, cache):
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       attention_pattern="block_causal", past_key_values=cache, use_cache=cache is not None)
        return lm_head(out.last_hidden_state[:, -model.config.attention_group_size:]).float()

    if one_stream:
        prefill = one_stream_prefill
    if compile_config is None:
        return prefill, prefill
    step, = kept_compiled(model, "_lookaround_compiled_step", compile_config, prefill, extra_key=one_stream)
    return prefill, step


_QUERY_ROWS_ONLY = PreparedInputs(content_output=False)  # a decoding step reads the query rows alone


def kept_compiled(model, name: str, compile_config, *functions, extra_key=None) -> tuple:
    """``functions``, each compiled whole with ``compile_config`` (:func:`_compiled`), kept on the model as
    ``name`` so that every run of one shape reuses them; compiled again when the config (or ``extra_key``) changes."""
    key = repr((extra_key, sorted(compile_config.to_dict().items())))
    held = getattr(model, name, None)
    if held is None or held[0] != key:
        held = (key, *(_compiled(function, compile_config) for function in functions))
        setattr(model, name, held)
    return held[1:]


def _compiled(function, compile_config):
    """``function`` compiled with the ``CompileConfig`` (fixed shapes), called as a step of a CUDA-graph tree."""
    options = compile_config.to_dict()
    compiled = torch.compile(function, fullgraph=options["fullgraph"], dynamic=False, backend=options["backend"],
                             mode=options["mode"] if options["backend"] == "inductor" else None,
                             options=options["options"])

    def step(*args):
        # a CUDA-graph step ("reduce-overhead") reuses its output memory at the next call: start a new step, and
        # copy the output out of the graph's memory before it is replayed
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args).clone()

    return step



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
