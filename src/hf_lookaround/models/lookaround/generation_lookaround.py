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

The file by job: what a checkpoint was trained for (the refusals); the edges every decoder shares (process and
pick, a stop tracker, the output); ``generate()``'s hook and :func:`group_generate`, which choose the decoder and
check once; then one section per decoder: group decoding (two-stream and one-stream forms) and self-speculative
decoding (draft, verify, commit, and the cache surgery it needs).
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
    "LEGACY_GROUP_DECODING_OBJECTIVES",
    "UntrainedDecodingError",
    "trained_group_sizes",
    "default_group_size",
    "check_group_size",
    "check_draft_group_size",
    "check_decoder",
    "GenerateSpeculativeOutput",
    "SPECULATION_BREAK_EVEN",
    "semi_ar_ranks",
    "GroupDecodingMixin",
    "group_decoding",
    "group_generate",
    "make_logits_processor",
    "process_and_pick",
    "StopTracker",
    "DecodingOptions",
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

# When speculation pays: a verify-and-draft step costs ``1 + c`` plain (t = 1) steps and writes ``1 + a`` tokens per
# row, ``a`` the drafts it keeps, so it pays while ``a > c``. ``c`` is (speculative step time / plain step time) - 1,
# measured on the GPU (docs/generation.md, "Falling back to plain steps"); 0 never falls back.
SPECULATION_BREAK_EVEN = 0.25
SPECULATION_WINDOW = 8  # verify steps whose accepted drafts decide whether speculation pays
SPECULATION_REST = 32  # plain steps before speculation is probed again

# sampling warpers that read only the scores, never the sequence so far
_POSITIONLESS_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                            TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)


class UntrainedDecodingError(ValueError):
    """A decoder the checkpoint was not trained for (pass ``allow_untrained=True`` to run it anyway)."""


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


def process_and_pick(processors, logits: torch.Tensor, context, do_sample: bool, generator=None):
    """``(scores, tokens)``: the processed ``logits`` (N, V) (see :func:`process`) and a token per row, a draw from
    their softmax or the argmax."""
    scores = process(processors, logits, context)
    return scores, _pick(scores, do_sample, generator)


def _pick(scores: torch.Tensor, do_sample: bool, generator=None) -> torch.Tensor:
    """(N, V) processed scores -> (N,) tokens: a draw from their softmax, or the argmax."""
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


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


@dataclass
class DecodingOptions:
    """What a decoder is asked for, once ``generate()`` (:func:`group_decoding`) or :func:`group_generate` has
    prepared it."""

    max_new_tokens: int
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    do_sample: bool
    pad_token_id: int
    use_cache: bool = True
    return_dict: bool = False
    output_scores: bool = False
    output_logits: bool = False
    streamer: object = None
    generator: torch.Generator | None = None
    static_cache: bool = False  # cache_implementation="static": fixed shapes, a compiled step
    compile_config: object = None
    speculation_break_even: float = SPECULATION_BREAK_EVEN  # self-speculative decoding runs plain steps below it


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
        held = model._lookaround_compiled_step = (key, _compiled(prefill, compile_config))
    return prefill, held[1]


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



# ----------------------------------------------------------------------------------------------
# Choosing the decoder: generate()'s hook and group_generate()
# ----------------------------------------------------------------------------------------------
def check_decoder(config, group_size, draft_group_size, allow_untrained: bool = False) -> None:
    """Refuse a decoder the checkpoint was not trained for: self-speculative decoding with ``draft_group_size=k``
    (:func:`check_draft_group_size`; it decodes the AR plan, so no other group size goes with it), else group
    decoding with ``group_size`` (:func:`check_group_size`)."""
    if draft_group_size is None:
        check_group_size(config, group_size, allow_untrained)
        return
    if group_size not in (None, 1):
        raise ValueError(f"draft_group_size={draft_group_size} decodes the AR (t=1) plan with drafts; "
                         f"group_size={group_size} cannot be combined with it (drop one of them)")
    check_draft_group_size(config, draft_group_size, allow_untrained)


class GroupDecodingMixin:
    """``generate(..., group_size=t)`` runs group decoding through the query stream (:func:`group_decoding`);
    ``generate(..., draft_group_size=k)`` runs lossless self-speculative decoding (:class:`_Speculation`).

    The usual preparation of ``generate`` (generation config, logits processors and warpers, stopping criteria
    including ``stop_strings`` with ``tokenizer=``, EOS, ``max_new_tokens``, ``num_return_sequences``) runs, and
    transformers hands decoding to :func:`group_decoding` through its ``custom_generate`` callable hook.
    Without either argument the group size is :func:`default_group_size`: ``1`` goes to transformers'
    token-by-token ``GenerationMixin.generate`` unchanged (AR decoding), a checkpoint that never trained ``t = 1``
    decodes with its own group size. ``allow_untrained=True`` decodes with a group size the checkpoint was not
    trained for (warns instead of refusing; see :func:`check_group_size`). ``generator=`` (a ``torch.Generator``)
    draws the samples of group and self-speculative decoding.
    """

    def generate(self, inputs=None, generation_config=None, *args, group_size=None, draft_group_size=None,
                 allow_untrained=False, speculation_break_even=SPECULATION_BREAK_EVEN, **kwargs):
        if group_size is None and draft_group_size is None:
            group_size = default_group_size(self.config)
            if group_size == 1:  # AR decoding: transformers' own loop (static cache, compile, assisted, beams...)
                self._warn_if_prompt_ends_with_eos(inputs if inputs is not None else kwargs.get("input_ids"))
                return super().generate(inputs, generation_config, *args, **kwargs)
            logger.info("generate() without group_size: decoding with group_size=%d, the group size this checkpoint "
                        "was trained for (it never trained t=1)", group_size)
        else:
            check_decoder(self.config, group_size, draft_group_size, allow_untrained)
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
            draft_group_size=draft_group_size, speculation_break_even=speculation_break_even, **kwargs,
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
        _warn_if_prompt_ends_with_eos(input_ids, self.config)


def _warn_if_prompt_ends_with_eos(input_ids, config) -> None:
    # the package's tokenizers wrap text as <s> ... </s>; a continuation of a finished text is rarely meant
    eos = config.eos_token_id
    if torch.is_tensor(input_ids) and input_ids.dim() == 2 and input_ids.shape[1] and eos is not None:
        if bool((input_ids[:, -1] == eos).any()):
            logger.warning(_EOS_PROMPT_WARNING)


_EOS_PROMPT_WARNING = (
    "a prompt ends with the EOS token: the continuation starts after the end of a finished text. Encode prompts "
    "without it (tokenizers of hf-lookaround >= issue 19 add none; for an older one pass add_special_tokens=False "
    "and put BOS in front)"
)

# features transformers' own loop has and these decoders do not: a clear error rather than a silent None
_UNSUPPORTED = {
    "output_attentions": "attention weights of each step",
    "output_hidden_states": "hidden states of each step",
    "prompt_lookup_num_tokens": "prompt-lookup drafting (use draft_group_size)",
}


def _refuse_what_group_decoding_lacks(generation_config, model_kwargs) -> None:
    if generation_config.num_beams > 1:
        raise ValueError("group decoding takes the argmax or samples; beam search (num_beams > 1) is not supported")
    for name, what in _UNSUPPORTED.items():
        if getattr(generation_config, name, None):
            raise ValueError(f"{name}: {what} is not supported with group_size / draft_group_size; drop it, or "
                             "decode token by token (generate() without them)")
    if getattr(generation_config, "guidance_scale", None) not in (None, 1, 1.0):
        raise ValueError("guidance_scale (classifier-free guidance) runs the model token by token beside the decoder: "
                         "not supported with group_size / draft_group_size")
    if getattr(generation_config, "cache_implementation", None) not in (None, "dynamic", "static"):
        raise ValueError(
            f"group decoding keeps a DynamicCache, or a StaticCache with cache_implementation='static' (compiled, "
            f"fixed shapes); cache_implementation={generation_config.cache_implementation!r} serves token-by-token "
            "generate() only"
        )
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("group decoding starts from input_ids (the cache holds content of known tokens); "
                         "pass input_ids instead of inputs_embeds")
    past = model_kwargs.get("past_key_values")
    if past is not None and past.get_seq_length() > 0:
        raise ValueError("group decoding builds its cache from the prompt; pass no filled past_key_values")


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
    generator: torch.Generator | None = None,
    speculation_break_even: float = SPECULATION_BREAK_EVEN,
    **model_kwargs,
):
    """transformers' ``custom_generate`` callable: ``GenerationMixin.generate`` has prepared everything."""
    _refuse_what_group_decoding_lacks(generation_config, model_kwargs)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # what transformers' own loop does first (TextStreamer skips it, skip_prompt)
    pad = generation_config._pad_token_tensor
    eos = generation_config._eos_token_tensor
    pad_id = int(pad) if pad is not None else (int(eos.flatten()[0]) if eos is not None else 0)
    use_cache = model_kwargs.get("use_cache")
    static = getattr(generation_config, "cache_implementation", None) == "static"
    options = DecodingOptions(
        max_new_tokens=generation_config.max_length - input_ids.shape[1],
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        do_sample=generation_config.do_sample,
        pad_token_id=pad_id,
        use_cache=True if use_cache is None else bool(use_cache),  # unset: group decoding keeps a KV cache
        return_dict=generation_config.return_dict_in_generate,
        output_scores=generation_config.output_scores,
        output_logits=generation_config.output_logits,
        streamer=streamer,
        generator=generator,
        static_cache=static,
        compile_config=_compile_config(model, generation_config) if static else None,
        speculation_break_even=_check_break_even(speculation_break_even),
    )
    return _decode(model, input_ids, model_kwargs.get("attention_mask"), options, group_size, draft_group_size)


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
    speculation_break_even: float = SPECULATION_BREAK_EVEN,
):
    """Group decoding on any LookAround LM head (``LookAroundForPreTraining`` included), without ``generate()``.

    ``group_size`` defaults to :func:`default_group_size`; ``draft_group_size=k`` runs self-speculative decoding
    instead. ``input_ids`` ``(B, P)`` left-padded (or a list of ids for one row); ``eos_token_id`` /
    ``pad_token_id`` default to the config's (``eos_token_id=[]``: no EOS, always ``max_new_tokens``);
    ``logits_processor`` runs after the sampling warpers built from ``temperature``/``top_k``/``top_p``. Returns
    the sequences ``(B, P + n)``, or a ``GenerateDecoderOnlyOutput``. ``speculation_break_even``: with
    ``draft_group_size``, the accepted drafts per verify step below which plain (t = 1) steps run for a while
    (:data:`SPECULATION_BREAK_EVEN`; 0: always speculate).
    """
    config = model.config
    if group_size is None and draft_group_size is None:
        group_size = default_group_size(config)
    check_decoder(config, group_size, draft_group_size, allow_untrained)
    device = _device(model)
    input_ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask, device=device)
        attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
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
    options = DecodingOptions(
        max_new_tokens=max_new_tokens, logits_processor=processors, stopping_criteria=criteria, do_sample=do_sample,
        pad_token_id=int(pad_token_id), use_cache=use_cache, return_dict=return_dict_in_generate,
        output_scores=output_scores, output_logits=output_logits, generator=generator,
        speculation_break_even=_check_break_even(speculation_break_even),
    )
    return _decode(model, input_ids, attention_mask, options, group_size, draft_group_size)


def _decode(model, input_ids, attention_mask, options: DecodingOptions, group_size, draft_group_size):
    """Run the decoder, after the checks every caller needs: the cache it keeps, the prompt's shape and length."""
    if draft_group_size is not None and not options.use_cache:
        raise ValueError("self-speculative decoding verifies drafts against a KV cache: use_cache=False "
                         "is not supported with draft_group_size")
    if options.static_cache and not options.use_cache:
        raise ValueError("cache_implementation='static' needs use_cache=True")
    attention_mask = _checked_prompt(input_ids, attention_mask, options.max_new_tokens, model.config)
    _warn_if_prompt_ends_with_eos(input_ids, model.config)
    if draft_group_size is not None:
        return _Speculation(model, input_ids, attention_mask, draft_group_size, options).run()
    return _group_decode(model, input_ids, attention_mask, group_size, options)


# ----------------------------------------------------------------------------------------------
# Group decoding
# ----------------------------------------------------------------------------------------------
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


def one_stream_next_token_layouts(input_ids, attention_mask, group_size: int, bos: int, pad: int):
    """Plain token ids ``(B, T)`` in dar's one-stream layouts, for the next-token (causal) view: ``(layouts, rows)``.

    A row predicts the token ``t`` slots after it, and it has seen every earlier token only when that token opens
    a group. Token ``k`` of a sequence (BOS at ``k = 0``) opens a group when the first text group has
    ``s1 = (k - 2) mod t + 1`` tokens, the rule :func:`one_stream_prompt` applies to a prompt ending at ``k - 1``.
    So each row is laid out ``t`` times, once per ``s1`` in ``1..t``: :func:`one_stream_start_rows` BOS copies,
    then the row (with a BOS in front if it does not start with one: the start rows are its copies, as in
    training). ``layouts`` ``(t * B, W)`` stacks them in the batch dimension, layout ``s1 - 1`` first; position ids
    are the slot indices, as in training. ``rows`` ``(B, T)`` indexes the flattened ``(t * B * W)`` rows: the
    one whose state predicts ``input_ids[:, i + 1]`` (past the input, the next token). ``attention_mask`` (or None)
    marks the real tokens, one run per row (left or right padding); a padding column's row is a real one."""
    t, device = group_size, input_ids.device
    batch, length = input_ids.shape
    columns = torch.arange(length, device=device)
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    start = torch.where(real.any(-1), real.long().argmax(-1), 0)[:, None]  # (B, 1): the first real column
    lead = (input_ids.gather(1, start) != bos).long()  # 1: a BOS goes in front of the row
    first_group = torch.arange(1, t + 1, device=device)[:, None, None]  # (t, 1, 1): s1 of each layout
    before = one_stream_start_rows(t, first_group) + lead - start  # (t, B, 1): slot of column c is c + before
    width = length + int(before.max())
    source = torch.arange(width, device=device) - before  # (t, B, W): the column each slot holds
    tokens = input_ids.expand(t, batch, length).gather(2, source.clamp(0, length - 1))
    layouts = torch.where(source < start, bos, torch.where(source < length, tokens, pad))
    # the token after column i is k = i + 1 - start + lead of its sequence; its layout and its predicting row
    k = (columns + 1 - start + lead).clamp(min=1)  # (B, T); padding columns before the row get any valid row
    layout = torch.remainder(k - 2, t)  # s1 - 1
    sequence = torch.arange(batch, device=device)[:, None]
    slot = (columns + 1 + before[layout, sequence, 0] - t).clamp(min=0)  # (B, T): its slot, less t
    rows = (layout * batch + sequence) * width + slot
    return layouts.reshape(t * batch, width), rows



def _group_decode(model, input_ids, attention_mask, group_size: int, options: DecodingOptions):
    """Group decoding: each forward predicts the next group of ``t`` tokens (the last one may be cut by
    ``max_new_tokens``), which are picked together and written; their content joins the cache at the next forward.
    The forward is the two-stream form's or the one-stream form's (:func:`_group_forward`)."""
    batch, prompt_len = input_ids.shape
    total = prompt_len + options.max_new_tokens
    forward = _group_forward(model, input_ids, attention_mask, group_size, options)
    # one buffer for the whole output: a step writes its columns, views give the sequence so far (no copies)
    buffer = input_ids.new_full((batch, total), options.pad_token_id)
    buffer[:, :prompt_len] = input_ids
    mask = attention_mask.new_zeros((batch, total))  # generated columns become valid as they are written
    mask[:, :prompt_len] = attention_mask
    tracker = StopTracker(options.stopping_criteria, total, batch, input_ids.device, options.streamer)
    all_scores, all_logits = [], []
    length = prompt_len  # columns decided
    while length < total and not tracker.done:
        width = min(group_size, total - length)
        logits = forward(buffer, mask, length, width)
        all_scores.extend(_write_group(buffer, mask, length, logits, options, tracker))
        all_logits.extend(logits.unbind(1) if options.output_logits else ())
        tracker.put(buffer[:, length : length + width])
        length += width
    tracker.end()
    return build_output(options, buffer[:, :length], forward.cache, all_scores, all_logits)


def _write_group(buffer, mask, length: int, logits, options: DecodingOptions, tracker: StopTracker) -> list:
    """Pick the group's tokens from its ``logits`` (B, width, V), write them at ``length`` (pad in rows that have
    stopped) and return the scores of each slot. Processors that read the sequence see, for each slot, the tokens
    picked before it; a criterion other than EOS is asked after each slot, as in transformers' loop."""
    batch, width = logits.shape[:2]
    processors, pad = options.logits_processor, options.pad_token_id
    one_call = reads_only_scores(processors)  # warpers that never read input_ids treat the slots in one call
    if one_call:
        scores, tokens = process_and_pick(processors, logits.flatten(0, 1), None, options.do_sample, options.generator)
        scores, tokens = scores.view(batch, width, -1), tokens.view(batch, width)
        if not tracker.others:
            # EOS and the token budget only: the group is written in one set of operations, not one per token (at
            # batch 8 a small model's compiled step is short, and per-token bookkeeping was most of a group)
            count, ended = tracker.until_eos(tokens, torch.where(tracker.unfinished, width, 0))
            keep = torch.arange(width, device=tokens.device) < count[:, None]
            buffer[:, length : length + width] = torch.where(keep, tokens, pad)
            mask[:, length : length + width] = 1
            tracker.stop(ended)
            return list(scores.unbind(1)) if options.output_scores else []
    per_slot = []
    for j in range(width):
        if one_call:
            slot_scores, token = scores[:, j], tokens[:, j]
        else:
            slot_scores, token = process_and_pick(processors, logits[:, j], buffer[:, : length + j], options.do_sample,
                                                  options.generator)
        buffer[:, length + j] = torch.where(tracker.unfinished, token, torch.full_like(token, pad))
        mask[:, length + j] = 1
        per_slot.append(slot_scores)
        tracker.after_token(buffer[:, : length + j + 1], slot_scores)
    return per_slot if options.output_scores else []


def _group_forward(model, input_ids, attention_mask, group_size: int, options: DecodingOptions):
    """The forward of a group-decoding step for this checkpoint's form, called as ``forward(buffer, mask, length,
    width)`` -> float logits ``(B, width, V)`` of the group at columns ``length .. length + width``; ``forward.cache``
    is the cache it keeps (None without one)."""
    bos = model.config.bos_token_id
    first_real = input_ids.gather(1, (attention_mask == 0).sum(-1, keepdim=True)).squeeze(1)
    has_condition = first_real == bos if bos is not None else torch.zeros_like(first_real, dtype=torch.bool)
    form = _OneStreamGroups if is_one_stream_group_model(model.config) else _TwoStreamGroups
    return form(model, input_ids, attention_mask, has_condition, group_size, options)


class _TwoStreamGroups:
    """Group decoding in the two-stream form. The whole plan is known up front (:func:`semi_ar_ranks`: ranks and
    positions of every column, prompt and continuation). A step's content rows, those of the group written last
    (the prompt at first), join the cache; the query rows of the next group read every key of lower rank.
    Without a cache every content row is recomputed, and the next group's columns are invalid keys that only hold
    query rows. With a static cache every key of the plan is passed (the cache has a slot for each column) and the
    query rows of a last, cut group are padded to ``t``: fixed shapes, so that a compiled step is reused."""

    def __init__(self, model, input_ids, attention_mask, has_condition, group_size: int, options: DecodingOptions):
        self.backbone, self.lm_head, self.group_size = model.base_model, model.lm_head, group_size
        total = input_ids.shape[1] + options.max_new_tokens
        self.ranks, self.positions = semi_ar_ranks(attention_mask, total, group_size, has_condition)
        self.static, self.past = options.static_cache, 0  # past: columns whose content is in the cache
        self.cache = DynamicCache(config=model.config) if options.use_cache else None
        if self.static:
            self.cache = _static_cache(model, input_ids.shape[0], total, input_ids.dtype)
            self.prefill, self.step = _decoding_step(model, options.compile_config)
            self.query_positions = F.pad(self.positions, (0, group_size), value=0)
            self.query_ranks = F.pad(self.ranks, (0, group_size), value=NO_TARGET_RANK)

    def __call__(self, buffer, mask, length: int, width: int) -> torch.Tensor:
        past, ranks, positions, end = self.past, self.ranks, self.positions, length + width
        if self.static:
            self.past = length
            forward = self.step if past else self.prefill  # the prompt's forward has its own width
            queries = slice(length, length + self.group_size)
            return forward(buffer[:, past:length], mask, ranks, positions[:, past:length], self.cache,
                           self.query_positions[:, queries], self.query_ranks[:, queries])[:, :width]
        if self.cache is not None:
            self.past = length
            out = self.backbone(
                input_ids=buffer[:, past:length], attention_mask=mask[:, :length], group_ids=ranks[:, :length],
                position_ids=positions[:, past:length], past_key_values=self.cache, use_cache=True,
                query_position_ids=positions[:, length:end], query_group_ids=ranks[:, length:end],
            )
        else:
            out = self.backbone(
                input_ids=buffer[:, :end], attention_mask=mask[:, :end], group_ids=ranks[:, :end],
                position_ids=positions[:, :end],
                target_positions=torch.arange(length, end, device=buffer.device).expand(buffer.shape[0], width),
            )
        return self.lm_head(out.query_hidden_state[:, :width]).float()


class _OneStreamGroups:
    """Group decoding in dar's one-stream form (block-causal content rows; the row ``t`` places before a token
    predicts it). The prompt is laid out once (:func:`one_stream_prompt`); a step's content rows, those of the
    group written last, join the cache, and the last ``t`` rows predict the next group. Without a cache the laid-out
    prompt and every token written since run again."""

    def __init__(self, model, input_ids, attention_mask, has_condition, group_size: int, options: DecodingOptions):
        bos = model.config.bos_token_id
        if bos is None or not bool(has_condition.all()):
            raise ValueError("a one-stream (block-causal) checkpoint decodes prompts that start with the BOS token "
                             "(its start rows are copies of it): put tokenizer.bos_token in front of each prompt")
        self.prompt_len = input_ids.shape[1]
        self.ids, self.mask, self.positions = one_stream_prompt(input_ids, attention_mask, group_size, bos,
                                                                options.pad_token_id)
        self.static, self.past = options.static_cache, 0
        self.prefill, self.step = _decoding_step(model, options.compile_config if self.static else None,
                                                 one_stream=True)
        # the positions of the generated columns continue each row's prompt
        self.generated_positions = self.positions[:, -1:] + 1 + torch.arange(options.max_new_tokens,
                                                                             device=input_ids.device)
        self.cache = DynamicCache(config=model.config) if options.use_cache else None
        if self.static:  # a slot for every key: the laid-out prompt and every new token
            self.cache = _static_cache(model, input_ids.shape[0], self.ids.shape[1] + options.max_new_tokens,
                                       input_ids.dtype)

    def __call__(self, buffer, mask, length: int, width: int) -> torch.Tensor:
        past, prompt_len = self.past, self.prompt_len
        keys = mask[:, prompt_len:] if self.static else mask[:, prompt_len:length]
        key_mask = torch.cat([self.mask, keys], 1)
        if past and self.cache is not None:
            ids = buffer[:, past:length]
            position_ids = self.generated_positions[:, past - prompt_len : length - prompt_len]
        else:  # the prompt (and without a cache, everything written since)
            ids = torch.cat([self.ids, buffer[:, prompt_len:length]], 1)
            position_ids = torch.cat([self.positions, self.generated_positions[:, : length - prompt_len]], 1)
        forward = self.step if (past and self.static) else self.prefill
        self.past = length
        return forward(ids, key_mask, position_ids, self.cache)[:, :width]


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
    num_speculative_steps (`int`): verify-and-draft steps after the prompt's forward.
    num_plain_steps (`int`): plain (t = 1) steps, run while speculation did not pay (``speculation_break_even``).
    """

    num_drafted: torch.LongTensor | None = None
    num_accepted: torch.LongTensor | None = None
    num_forwards: int | None = None
    num_speculative_steps: int | None = None
    num_plain_steps: int | None = None

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted over the batch (NaN when nothing was drafted)."""
        drafted = int(self.num_drafted.sum()) if self.num_drafted is not None else 0
        return int(self.num_accepted.sum()) / drafted if drafted else float("nan")



def _compact_cache(cache: DynamicCache, key_valid: torch.Tensor, key_pos: torch.Tensor, columns: int) -> int:
    """Move each row's valid cache columns (of the first ``columns``) to the right end of the new first columns, a
    left-padded layout, and drop the columns no row needs (the holes of rejected drafts). Only the DynamicCache is
    compacted, outside any graph, when its next step would pass max_position_embeddings keys. ``key_valid`` /
    ``key_pos`` (full width) are updated in place; returns the new number of columns."""
    valid = key_valid[:, :columns]
    keep = int(valid.sum(-1).max())
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, columns - keep :]
    for layer in cache.layers:
        index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys = layer.keys[:, :, :columns].gather(2, index)
        layer.values = layer.values[:, :, :columns].gather(2, index)
    key_valid[:, :keep], key_pos[:, :keep] = valid.gather(1, order), key_pos[:, :columns].gather(1, order)
    key_valid[:, keep:] = False
    return keep


class _SpeculationSchedule:
    """Whether the next step speculates or runs plain (t = 1). Deterministic given the tokens, never the clock, so
    that a seeded run repeats: over a window of ``SPECULATION_WINDOW`` steps that verified drafts, if the drafts
    accepted per step (averaged over the rows still decoding) fall below ``break_even``, the next
    ``SPECULATION_REST`` steps are plain; then speculation is probed again."""

    def __init__(self, break_even: float):
        self.break_even, self.window, self.rest = break_even, SPECULATION_WINDOW, SPECULATION_REST
        self.accepted, self.plain_left = [], 0

    @property
    def speculate(self) -> bool:
        return self.plain_left == 0

    def record(self, verified: bool, accepted: float) -> None:
        """After a step: whether it verified drafts, and how many it kept per row."""
        if self.plain_left:
            self.plain_left -= 1
        elif verified:
            self.accepted.append(accepted)
            if len(self.accepted) == self.window:
                if sum(self.accepted) / self.window < self.break_even:
                    self.plain_left = self.rest
                self.accepted = []


def _check_break_even(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"speculation_break_even must be a number >= 0 (accepted drafts per verify step below "
                         f"which plain steps run; 0: never), got {value!r}")
    return float(value)


class _SpeculationState:
    """Every tensor a speculative run changes, allocated once per shape and kept on the model: a compiled step
    holds their addresses (CUDA graphs replay on the same memory, as transformers' StaticCache does), and each run
    refills them in place."""

    def __init__(self, batch: int, prompt_len: int, max_new_tokens: int, k: int, columns: int, vocab: int,
                 do_sample: bool, device):
        def new(*shape, dtype=torch.long):
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(tensor)
            return tensor

        self.out = new(batch, prompt_len + max_new_tokens + 1)  # the prompt, the new tokens, a spare last column
        self.num_new, self.real, self.last_position = new(batch), new(batch), new(batch)
        self.unfinished, self.has_drafts = new(batch, dtype=torch.bool), new(batch, dtype=torch.bool)
        self.drafts = new(batch, k - 1)
        self.draft_probs = new(batch, k - 1, vocab, dtype=torch.float) if do_sample else None
        self.key_valid, self.key_pos = new(batch, columns, dtype=torch.bool), new(batch, columns)
        self.drafted, self.accepted = new(batch), new(batch)

    def reset(self, input_ids, attention_mask, max_new_tokens: int, pad: int) -> None:
        for tensor in (self.num_new, self.unfinished, self.has_drafts, self.drafts, self.key_valid, self.key_pos,
                       self.drafted, self.accepted):
            tensor.zero_()
        self.out.fill_(pad)
        self.out[:, : input_ids.shape[1]] = input_ids
        self.unfinished.fill_(True)
        self.real.copy_(attention_mask.sum(-1))  # prompt tokens of a row; its new token i sits at position real + i
        self.last_position.copy_(self.real + max_new_tokens - 1)  # the last position a row may fill


def _speculation_state(model, key: tuple, device) -> _SpeculationState:
    """The state of the last shape, reused across runs of that shape (as :func:`_static_cache` reuses its cache)."""
    held = getattr(model, "_lookaround_speculation_state", None)
    if held is None or held[0] != (key, device):
        held = model._lookaround_speculation_state = ((key, device), _SpeculationState(*key, device=device))
    return held[1]


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token per row of ``probs`` (N, V) from uniforms ``u`` (N,) in [0, 1), by the inverse CDF: the uniforms
    are drawn before a compiled step (a ``torch.Generator`` cannot enter its graph), the same ones give the same
    tokens, and ``1 - u > 0`` never lands on a token of probability 0."""
    cdf = probs.cumsum(-1)
    return (cdf < (1 - u)[:, None] * cdf[:, -1:]).sum(-1).clamp(max=probs.shape[-1] - 1)


class _Speculation:
    """Lossless self-speculative decoding: the tokens of AR (``t = 1``) decoding, up to ``k`` of them per forward.

    Ranks follow the AR plan (a token's rank is its position), so the content in the cache is that of AR decoding.
    A verify-and-draft step (:meth:`_speculative_step`) is one forward whose content rows are the token picked last
    and the ``k - 1`` drafts after it (causal among themselves, as AR content is), and whose query rows are ``k``
    groups of ``k`` rows: group ``a`` sits at the ``k`` positions after the last token and the first ``a`` drafts,
    with one rank, so it reads exactly those. Its first row is the AR pathway's prediction there: group ``a``'s
    first row verifies draft ``a + 1`` (greedy: equal to the argmax; sampling: accepted with probability
    ``min(1, p/q)``, else the token is drawn from ``max(0, p - q)``, the standard speculative rule, so the output is
    distributed as ``t = 1`` sampling). After ``a`` accepted drafts, the group at ``a`` also holds the next drafts
    (its other ``k - 1`` rows, the ``dar`` plan's look-ahead), so drafting costs no extra forward. A plain step
    (:meth:`_plain_step`) is t = 1: the last token's content, one query row after it; the schedule
    (:class:`_SpeculationSchedule`) runs plain steps while speculation does not pay.

    Every step appends its content rows to the cache at the same columns for every row; rejected drafts stay there
    as invalid keys (holes in ``key_valid``, positions from ``key_pos``), so no row's cache is moved or cropped and
    a static cache keeps fixed shapes: with ``cache_implementation="static"`` each kind of step is one compiled
    graph without host syncs, and the loop in :meth:`run` reads one small status tensor per step. A DynamicCache
    is compacted (outside any graph) only when its next step would pass ``max_position_embeddings`` keys.
    """

    def __init__(self, model, input_ids, attention_mask, draft_group_size: int, options: DecodingOptions):
        batch, prompt_len = input_ids.shape
        if options.streamer is not None and batch > 1:
            raise ValueError("a streamer takes one row: stream with batch size 1 (and num_return_sequences=1)")
        self.k, self.options, self.batch, self.prompt_len = draft_group_size, options, batch, prompt_len
        self.device, self.limit = input_ids.device, model.config.max_position_embeddings
        max_new_tokens = options.max_new_tokens
        self.tracker = StopTracker(options.stopping_criteria, prompt_len + max_new_tokens, batch, self.device,
                                   options.streamer)
        self.positionless = reads_only_scores(options.logits_processor)
        self.rows = torch.arange(batch, device=self.device)
        # every step writes >= 1 token per row still decoding and appends at most k columns
        columns = prompt_len + draft_group_size * max_new_tokens
        self.state = _speculation_state(model, (batch, prompt_len, max_new_tokens, draft_group_size, columns,
                                                model.config.vocab_size, options.do_sample), self.device)
        self.state.reset(input_ids, attention_mask, max_new_tokens, options.pad_token_id)
        self.tracker.unfinished = self.state.unfinished
        self.spare = self.state.out.shape[1] - 1  # takes the writes past a row's end
        if options.static_cache:
            self.cache = _static_cache(model, batch, columns, input_ids.dtype)
        else:
            self.cache = DynamicCache(config=model.config)
        # what reads tokens on the host after each step keeps the step eager (only its forward is compiled)
        host_work = (not self.positionless or bool(self.tracker.others) or options.streamer is not None
                     or options.output_scores or options.output_logits)
        compile_config = options.compile_config if options.static_cache else None
        one_graph = compile_config is not None and not host_work
        self.prefill, self.forward = _decoding_step(model, None if one_graph else compile_config)
        if one_graph:  # the forward is traced inside each compiled step
            self.speculative_step, self.plain_step = _speculation_steps(model, compile_config)
        else:
            self.speculative_step, self.plain_step = _Speculation._speculative_step, _Speculation._plain_step
        self.schedule = _SpeculationSchedule(options.speculation_break_even)
        self.steps = {"speculative": 0, "plain": 0}
        self.records = []
        self.first_content = (input_ids, attention_mask)

    def run(self):
        done = self._prefill()[0]
        while not done:
            speculate = self.schedule.speculate
            width = self._width(self.k if speculate else 1)
            step = self.speculative_step if speculate else self.plain_step
            done, accepted, verified = step(self, width, self._uniforms()).tolist()  # the one read per step
            self.steps["speculative" if speculate else "plain"] += 1
            self.schedule.record(bool(verified), accepted)
        return self._output()

    # the two steps: each is one graph when compiled -------------------------------------------------------------
    def _speculative_step(self, width: int, uniforms):
        """Verify the drafts and draft the next ones: content rows are the last token and ``width - 1`` drafts,
        query rows a group of ``k`` after each."""
        ids, positions, valid = self._content(width)
        logits = self._forward(self.forward, ids, positions, valid, groups=width, rows=self.k)
        return self._advance(logits, uniforms)

    def _plain_step(self, width: int, uniforms):
        """t = 1: the last token's content row and one query row after it (no drafts to verify, none drafted)."""
        ids, positions, valid = self._content(1)
        logits = self._forward(self.forward, ids, positions, valid, groups=1, rows=1)
        return self._advance(logits, uniforms)

    def _prefill(self):
        """The prompt's forward (its own width, eager): its content, one group of ``k`` query rows after it."""
        input_ids, attention_mask = self.first_content
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        logits = self._forward(self.prefill, input_ids, positions, attention_mask != 0, groups=1, rows=self.k)
        return self._advance(logits, self._uniforms()).tolist()

    def _width(self, width: int) -> int:
        """Content rows of the next step: ``width``; a DynamicCache first drops its holes when the step would pass
        max_position_embeddings keys, and takes fewer drafts if still short of room."""
        if self.options.static_cache:
            return width
        columns = self.cache.get_seq_length()
        if columns + width > self.limit:
            columns = _compact_cache(self.cache, self.state.key_valid, self.state.key_pos, columns)
        return min(width, self.limit - columns)

    def _uniforms(self):
        """The step's random numbers, drawn outside its graph: ``k - 1`` to verify drafts, one for the token,
        ``k - 1`` for the next drafts (None when greedy)."""
        if not self.options.do_sample:
            return None
        return torch.rand((self.batch, 2 * self.k - 1), device=self.device, generator=self.options.generator)

    # a step's parts ---------------------------------------------------------------------------------------------
    def _content(self, width: int):
        """The content rows: each row's last token and the first ``width - 1`` drafts, causal among themselves, at
        the positions after its last committed token. A row that finished, a position past the row's budget, or a
        draft column after a plain step (no drafts) is an invalid key."""
        s = self.state
        last = s.out.gather(1, (self.prompt_len + s.num_new - 1)[:, None])
        ids = torch.cat([last, s.drafts[:, : width - 1]], 1)
        positions = (s.real + s.num_new - 1)[:, None] + torch.arange(width, device=self.device)
        is_draft = torch.arange(width, device=self.device) > 0
        valid = (positions <= s.last_position[:, None]) & s.unfinished[:, None] & (s.has_drafts[:, None] | ~is_draft)
        return ids, positions.clamp(max=self.limit - 1), valid

    def _queries(self, groups: int, rows: int):
        """``groups`` groups of ``rows`` query rows; group ``a`` has rank ``nxt + a`` (``nxt``: the position after
        the row's last committed token) and sits at positions ``nxt + a ..``. Slots past the budget predict
        nothing."""
        s = self.state
        group_rank = (s.real + s.num_new)[:, None] + torch.arange(groups, device=self.device)
        positions = (group_rank[:, :, None] + torch.arange(rows, device=self.device)).flatten(1)
        ranks = group_rank[:, :, None].expand(-1, -1, rows).flatten(1)
        is_slot = (positions <= s.last_position[:, None]) & s.unfinished[:, None]
        return torch.where(is_slot, positions, 0), torch.where(is_slot, ranks, NO_TARGET_RANK)

    def _forward(self, forward, ids, positions, valid, groups: int, rows: int):
        """The content rows join the cache at its next columns (a static cache's own column counter, a tensor: no
        host read); the query rows' logits come back as ``(B, groups, rows, V)``."""
        s, width = self.state, ids.shape[1]
        start = self.cache.get_seq_length()
        columns = start + torch.arange(width, device=self.device)
        s.key_valid.index_copy_(1, columns, valid)
        s.key_pos.index_copy_(1, columns, positions)
        keys = s.key_valid.shape[1] if self.options.static_cache else start + width
        query_positions, query_ranks = self._queries(groups, rows)
        logits = forward(ids, s.key_valid[:, :keys].long(), s.key_pos[:, :keys], positions, self.cache,
                         query_positions, query_ranks)
        return logits.view(self.batch, groups, rows, -1)

    def _advance(self, logits, uniforms):
        """Everything after the forward: verify, commit, drop the rejected drafts' keys, draft the next ones.
        Returns the status the loop reads: ``[all rows done, drafts accepted per verifying row, any row
        verified]``."""
        groups, rows = logits.shape[1:3]
        ar_logits = logits[:, :, 0]
        ar_scores = self._ar_scores(ar_logits)
        num_ok, token = self._verify(ar_scores, uniforms)
        accepted, verifying = self._commit(ar_logits, ar_scores, num_ok, token)
        self._drop_rejected(num_ok, groups)
        if rows > 1:
            self._draft(logits, num_ok, uniforms)
        else:
            self.state.has_drafts.fill_(False)
        rate = accepted.sum() / verifying.sum().clamp(min=1)
        return torch.stack([~self.state.unfinished.any(), rate, verifying.any()]).float()

    def _ar_scores(self, ar_logits):
        """The AR pathway's logits after the processors; those that read the sequence see each row's committed
        tokens and the drafts before the group (host work: per-row prefixes)."""
        processors, s = self.options.logits_processor, self.state
        if self.positionless:
            return process(processors, ar_logits.flatten(0, 1), None).view_as(ar_logits)
        committed = [s.out[b, : self.prompt_len + int(s.num_new[b])] for b in range(self.batch)]
        context = [torch.cat([committed[b], s.drafts[b, :a]]) for b in range(self.batch)
                   for a in range(ar_logits.shape[1])]
        return process(processors, ar_logits.flatten(0, 1), context).view_as(ar_logits)

    def _verify(self, ar_scores, uniforms):
        """The AR pathway's verdict: the first row of group ``a`` predicts position ``nxt + a``, after the first
        ``a`` drafts. Returns the drafts accepted before the first rejection ``(B,)`` and the token after them: AR's
        own pick, or a draw from ``max(0, p - q)`` where a draft was rejected."""
        s, groups, do_sample = self.state, ar_scores.shape[1], self.options.do_sample
        ar_probs = torch.softmax(ar_scores, -1) if do_sample else None
        num_ok = torch.zeros_like(s.num_new)
        if groups > 1:
            to_verify = s.drafts[:, : groups - 1]
            if do_sample:
                p = ar_probs[:, : groups - 1].gather(-1, to_verify[..., None]).squeeze(-1)
                q = s.draft_probs[:, : groups - 1].gather(-1, to_verify[..., None]).squeeze(-1)
                ok = uniforms[:, : groups - 1] * q < p  # accepted with probability min(1, p / q)
            else:
                ok = to_verify == ar_scores[:, : groups - 1].argmax(-1)
            num_ok = (ok & s.has_drafts[:, None]).long().cumprod(-1).sum(-1)
        if not do_sample:
            return num_ok, ar_scores[self.rows, num_ok].argmax(-1)
        dist = ar_probs[self.rows, num_ok]
        if groups > 1:
            residual = (dist - s.draft_probs[self.rows, num_ok.clamp(max=groups - 2)]).clamp(min=0)
            use = (num_ok < groups - 1) & s.has_drafts & (residual.sum(-1) > 0)
            dist = torch.where(use[:, None], residual, dist)
        return num_ok, _draw(dist, uniforms[:, self.k - 1])

    def _commit(self, ar_logits, ar_scores, num_ok, token):
        """Write the accepted drafts and the token, within each row's budget, up to EOS (or another stop, host
        work); count the drafts. Returns the drafts each row kept and the rows that verified any."""
        s, options, tracker, groups = self.state, self.options, self.tracker, ar_scores.shape[1]
        pad, running = options.pad_token_id, s.unfinished.clone()
        budget = options.max_new_tokens - s.num_new
        candidates = torch.cat([s.drafts[:, : groups - 1], token[:, None]], 1)
        candidates = candidates.scatter(1, num_ok[:, None], token[:, None])
        count, ended = tracker.until_eos(candidates, torch.where(running, torch.minimum(num_ok + 1, budget), 0))
        slot = torch.arange(groups, device=self.device)
        keep = slot < count[:, None]
        starts = self.prompt_len + s.num_new
        s.out.scatter_(1, torch.where(keep, starts[:, None] + slot, self.spare), torch.where(keep, candidates, pad))
        stopped = torch.zeros_like(running)
        if tracker.others:  # stop strings, your own criteria: asked on the host after each token
            count, stopped = tracker.until_other_stop(s.out, starts, count, ar_scores)
            columns = torch.arange(s.out.shape[1], device=self.device)
            after_stop = (columns >= (starts + count)[:, None]) & (columns < self.spare)
            s.out.masked_fill_(stopped[:, None] & after_stop, pad)
        if options.output_scores or options.output_logits:
            self.records.append((s.num_new.clone(), count.clone(), ar_scores if options.output_scores else None,
                                 ar_logits if options.output_logits else None))
        if tracker.streamer is not None and int(count[0]):
            tracker.put(s.out[0, int(starts[0]) : int(starts[0] + count[0])])
        verifiable = (budget - 1).clamp(min=0, max=groups - 1) * (running & s.has_drafts)
        accepted = torch.minimum(num_ok, verifiable)
        s.drafted.add_(verifiable)
        s.accepted.add_(accepted)
        s.num_new.add_(count)
        tracker.stop(ended | stopped | (s.num_new >= options.max_new_tokens))
        return accepted, verifiable > 0

    def _drop_rejected(self, num_ok, groups: int) -> None:
        """Rejected drafts become holes: of the step's ``groups`` content columns a row keeps its last token and the
        drafts it accepted. A row that finished keeps none (it is never read again, and it would hold accepted drafts
        past its EOS: keys a DynamicCache would have to make room for)."""
        if groups == 1:
            return
        key_valid = self.state.key_valid
        columns = self.cache.get_seq_length() - groups + torch.arange(groups, device=self.device)
        kept = (torch.arange(groups, device=self.device) < (num_ok + 1)[:, None]) & self.state.unfinished[:, None]
        key_valid.index_copy_(1, columns, key_valid.index_select(1, columns) & kept)

    def _draft(self, logits, num_ok, uniforms) -> None:
        """The next drafts: the other rows of the group after the accepted ones (it never saw the token picked
        now). Processors that read the sequence see, slot by slot, the drafts before the slot (host work)."""
        s, options, k = self.state, self.options, self.k
        draft_logits = logits[self.rows, num_ok, 1:]  # (B, k - 1, V)
        draft_u = uniforms[:, k:] if options.do_sample else None
        if self.positionless:
            scores = process(options.logits_processor, draft_logits.flatten(0, 1), None).view_as(draft_logits)
            drafts = self._choose(scores, draft_u)
        else:
            drafts, scores = num_ok.new_zeros((self.batch, k - 1)), torch.empty_like(draft_logits)
            for j in range(k - 1):
                context = [torch.cat([s.out[b, : self.prompt_len + int(s.num_new[b])], drafts[b, :j]])
                           for b in range(self.batch)]
                scores[:, j] = process(options.logits_processor, draft_logits[:, j], context)
                u = None if draft_u is None else draft_u[:, j : j + 1]
                drafts[:, j] = self._choose(scores[:, j : j + 1], u)[:, 0]
        if options.do_sample:
            s.draft_probs.copy_(torch.softmax(scores, -1))
        s.drafts.copy_(drafts)
        s.has_drafts.fill_(True)

    def _choose(self, scores, u):
        """(B, n, V) processed scores -> (B, n) tokens: the argmax, or draws with the uniforms ``u`` (B, n)."""
        if u is None:
            return scores.argmax(-1)
        return _draw(torch.softmax(scores, -1).flatten(0, 1), u.flatten()).view(scores.shape[:2])

    # what the run returns ---------------------------------------------------------------------------------------
    def _output(self):
        self.tracker.end()
        s, steps = self.state, self.steps
        # the state is refilled by the next run: hand out copies
        num_new, drafted, accepted = s.num_new.clone(), s.drafted.clone(), s.accepted.clone()
        forwards = 1 + steps["speculative"] + steps["plain"]
        if int(drafted.sum()) > 0:
            logger.info("self-speculative decoding (k=%d): %d of %d drafts accepted (%.1f%%), %d forwards for %d "
                        "tokens (%d speculative steps, %d plain)", self.k, int(accepted.sum()), int(drafted.sum()),
                        100.0 * int(accepted.sum()) / int(drafted.sum()), forwards, int(num_new.sum()),
                        steps["speculative"], steps["plain"])
        scores, logits = self._per_token(num_new) if self.records else (None, None)
        sequences = s.out[:, : self.prompt_len + int(num_new.max())].clone()
        return build_output(self.options, sequences, self.cache, scores, logits, GenerateSpeculativeOutput,
                            num_drafted=drafted, num_accepted=accepted, num_forwards=forwards,
                            num_speculative_steps=steps["speculative"], num_plain_steps=steps["plain"])

    def _per_token(self, num_new):
        """The recorded AR scores / logits as one ``(B, V)`` tensor per new token (rows took different steps)."""
        vocab = next(v for record in self.records for v in record[2:] if v is not None).shape[-1]
        stacked = {name: torch.zeros(int(num_new.max()), self.batch, vocab, device=self.device)
                   for name in ("scores", "logits")}
        for start, count, step_scores, step_logits in self.records:
            slot = torch.arange((step_scores if step_scores is not None else step_logits).shape[1], device=self.device)
            b_idx, i_idx = (slot[None] < count[:, None]).nonzero(as_tuple=True)
            for name, values in (("scores", step_scores), ("logits", step_logits)):
                if values is not None:
                    stacked[name][start[b_idx] + i_idx, b_idx] = values[b_idx, i_idx]
        return stacked["scores"], stacked["logits"]


def _speculation_steps(model, compile_config):
    """The verify-and-draft step and the plain step, each compiled whole as one graph with ``compile_config``, kept
    on the model so that every run of one shape reuses them."""
    key = repr(sorted(compile_config.to_dict().items()))
    held = getattr(model, "_lookaround_speculation_steps", None)
    if held is None or held[0] != key:
        held = model._lookaround_speculation_steps = (key, _compiled(_Speculation._speculative_step, compile_config),
                                                      _compiled(_Speculation._plain_step, compile_config))
    return held[1], held[2]
