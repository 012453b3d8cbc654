"""``generate()`` of the LookAround LM heads: the mixin, its options and group decoding (DESIGN.md, "Decoding with
the streams").

The query stream at position ``i`` predicts token ``i`` from content of lower group rank only, so one forward
predicts every position of the next group. Group decoding (semi-autoregressive, the BD3-LM pattern) serves
look-ahead checkpoints (``ar`` / ``dar``): each step runs the query stream at the next ``t`` positions (rank =
the next group), samples them together, and their content joins a KV cache with one rank for the group, so the
group's content rows see each other and all earlier content, as in training. ``t = 1`` is AR decoding. The ranks
of prompt + continuation form one semi-AR plan whose groups end where the prompt ends (the first group has
``1..t`` tokens, as the plan draws it; ``layout_lookaround``). Entry points: ``model.generate(..., group_size=t)``
on a head with :class:`GroupDecodingMixin` (also from the ``text-generation`` pipeline), or
:func:`group_generate` on any LookAround LM head.

Every decoder is a ``DecodingStrategy`` (``decoding_lookaround``, with what decoders share): ``generate()``
prepares the options, checks the strategy and the prompt once, and calls it. ``group_size=t`` is
:class:`GroupDecoding` (this module), ``draft_group_size=k`` self-speculative decoding
(``speculation_lookaround``), ``decoding=`` any other (the package's infilling, ``hf_lookaround.decoding``).
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
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    StopStringCriteria,
)

from .decoding_lookaround import (
    DecodingStrategy,
    StopTracker,
    _checked_prompt,
    _compile_config,
    kept_compiled,
    _decoding_step,
    _device,
    _static_cache,
    build_output,
    check_group_size,
    default_group_size,
    is_one_stream_group_model,
    make_logits_processor,
    process_and_pick,
    reads_only_scores,
)
from .diffusion_lookaround import diffusion_decoding
from .layout_lookaround import one_stream_prompt, semi_ar_ranks
from .masking_lookaround import NO_TARGET_RANK
from .speculation_lookaround import (
    SPECULATION_BREAK_EVEN,
    SpeculativeDecoding,
    _check_break_even,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GroupDecodingMixin",
    "DecodingOptions",
    "GroupDecoding",
    "group_decoding",
    "group_generate",
    "check_decoder",
    "decoding_strategy",
]


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


# ----------------------------------------------------------------------------------------------
# Choosing the decoder: generate()'s hook and group_generate()
# ----------------------------------------------------------------------------------------------
def decoding_strategy(group_size, draft_group_size) -> DecodingStrategy:
    """The strategy of ``generate()``'s shorthands: self-speculative decoding with ``draft_group_size=k`` (it decodes
    the AR plan, so no other group size goes with it), else group decoding with ``group_size``."""
    if draft_group_size is None:
        return GroupDecoding(group_size)
    if group_size not in (None, 1):
        raise ValueError(f"draft_group_size={draft_group_size} decodes the AR (t=1) plan with drafts; "
                         f"group_size={group_size} cannot be combined with it (drop one of them)")
    return SpeculativeDecoding(draft_group_size)


def check_decoder(config, group_size, draft_group_size, allow_untrained: bool = False) -> None:
    """Refuse a decoder the checkpoint was not trained for: self-speculative decoding with ``draft_group_size=k``
    (:func:`check_draft_group_size`), else group decoding with ``group_size`` (:func:`check_group_size`)."""
    decoding_strategy(group_size, draft_group_size).check(config, allow_untrained)


class GroupDecodingMixin:
    """``generate(..., group_size=t)`` runs group decoding through the query stream (:func:`group_decoding`);
    ``generate(..., draft_group_size=k)`` runs lossless self-speculative decoding (``speculation_lookaround``);
    ``generate(..., decoding=strategy)`` runs any ``DecodingStrategy`` (the package's ``Infilling``, a new decoder);
    ``diffusion_threshold=p`` / ``diffusion_steps=s`` run masked-diffusion decoding (``diffusion_lookaround``).

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
                 decoding: DecodingStrategy | None = None, allow_untrained=False,
                 speculation_break_even=SPECULATION_BREAK_EVEN, diffusion_threshold=None, diffusion_steps=None,
                 **kwargs):
        diffusion = diffusion_decoding(diffusion_threshold, diffusion_steps)  # mdlm / bd3lm checkpoints
        if diffusion is not None:
            if decoding is not None:
                raise ValueError("diffusion_threshold / diffusion_steps are the shorthand of decoding="
                                 "DiffusionDecoding(...): pass one or the other")
            decoding = diffusion
        if decoding is not None:
            if group_size is not None or draft_group_size is not None:
                raise ValueError("decoding= is the decoder; group_size / draft_group_size choose one of the bundle's "
                                 "own: pass one or the other")
            if not isinstance(decoding, DecodingStrategy):
                raise ValueError(f"decoding= takes a DecodingStrategy, got {type(decoding).__name__}")
            decoding.check(self.config, allow_untrained)
        elif group_size is None and draft_group_size is None:
            group_size = default_group_size(self.config)
            if group_size == 1:  # AR decoding: transformers' own loop (static cache, compile, assisted, beams...)
                self._warn_if_prompt_ends_with_eos(inputs if inputs is not None else kwargs.get("input_ids"))
                return super().generate(inputs, generation_config, *args, **kwargs)
            logger.info("generate() without group_size: decoding with group_size=%d, the group size this checkpoint "
                        "was trained for (it never trained t=1)", group_size)
            decoding = GroupDecoding(group_size)
        else:
            decoding = decoding_strategy(group_size, draft_group_size)
            decoding.check(self.config, allow_untrained)
        if kwargs.get("custom_generate") is not None:
            raise ValueError("group_size / draft_group_size / decoding select the decoder; they cannot be combined "
                             "with custom_generate")
        if kwargs.get("assistant_model") is not None:
            raise ValueError("assistant_model cannot be combined with group decoding; draft_group_size=k drafts with "
                             "the model's own query stream instead")
        # transformers hands a custom_generate callable only the keys its signature adds to `_sample`'s, so the
        # streamer would be dropped: it travels bound to the callable, with the strategy
        decoder = functools.partial(group_decoding, streamer=kwargs.pop("streamer", None), decoding=decoding)
        self._stop_strings_to_criteria(generation_config, kwargs)
        return super().generate(inputs, generation_config, *args, custom_generate=decoder,
                                speculation_break_even=speculation_break_even, **kwargs)

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
    decoding: DecodingStrategy | None = None,
    generator: torch.Generator | None = None,
    speculation_break_even: float = SPECULATION_BREAK_EVEN,
    **model_kwargs,
):
    """transformers' ``custom_generate`` callable: ``GenerationMixin.generate`` has prepared everything; ``decoding``
    (checked by the mixin) decodes."""
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
    return _decode(model, input_ids, model_kwargs.get("attention_mask"), options, decoding)


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
    decoding: DecodingStrategy | None = None,
):
    """Group decoding on any LookAround LM head (``LookAroundForPreTraining`` included), without ``generate()``.

    ``group_size`` defaults to :func:`default_group_size`; ``draft_group_size=k`` runs self-speculative decoding
    instead; ``decoding=`` any other strategy, as ``generate(decoding=...)`` (``DiffusionDecoding`` for an mdlm /
    bd3lm checkpoint: lm-eval's ``generate_until`` decodes the loaded pretraining head so). ``input_ids`` ``(B, P)`` left-padded (or a list of ids for one row); ``eos_token_id`` /
    ``pad_token_id`` default to the config's (``eos_token_id=[]``: no EOS, always ``max_new_tokens``);
    ``logits_processor`` runs after the sampling warpers built from ``temperature``/``top_k``/``top_p``. Returns
    the sequences ``(B, P + n)``, or a ``GenerateDecoderOnlyOutput``. ``speculation_break_even``: with
    ``draft_group_size``, the accepted drafts per verify step below which plain (t = 1) steps run for a while
    (:data:`SPECULATION_BREAK_EVEN`; 0: always speculate).
    """
    config = model.config
    if decoding is not None:
        if group_size is not None or draft_group_size is not None:
            raise ValueError("decoding= is the decoder; group_size / draft_group_size choose one of the bundle's "
                             "own: pass one or the other")
    else:
        if group_size is None and draft_group_size is None:
            group_size = default_group_size(config)
        decoding = decoding_strategy(group_size, draft_group_size)
    decoding.check(config, allow_untrained)
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
    return _decode(model, input_ids, attention_mask, options, decoding)


def _decode(model, input_ids, attention_mask, options: DecodingOptions, decoding: DecodingStrategy):
    """Run the decoder, after the checks every caller needs: the cache it keeps, the prompt's shape and length."""
    if options.static_cache and not options.use_cache:
        raise ValueError("cache_implementation='static' needs use_cache=True")
    attention_mask = _checked_prompt(input_ids, attention_mask, options.max_new_tokens, model.config)
    _warn_if_prompt_ends_with_eos(input_ids, model.config)
    return decoding.decode(model, input_ids, attention_mask, options)


# ----------------------------------------------------------------------------------------------
# Group decoding
# ----------------------------------------------------------------------------------------------
class GroupDecoding(DecodingStrategy):
    """``generate(..., group_size=t)``: each forward predicts the next group of ``t`` tokens (:func:`_group_decode`)."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def check(self, config, allow_untrained: bool = False) -> None:
        check_group_size(config, self.group_size, allow_untrained)

    def decode(self, model, input_ids, attention_mask, options):
        return _group_decode(model, input_ids, attention_mask, self.group_size, options)


def _group_decode(model, input_ids, attention_mask, group_size: int, options: DecodingOptions):
    """Group decoding: each forward predicts the next group of ``t`` tokens (the last one may be cut by
    ``max_new_tokens``), which are picked together and written; their content joins the cache at the next forward.
    The forward is the two-stream form's or the one-stream form's (:func:`_group_forward`). With a static cache and
    no host work (:func:`_needs_host_work`) each step is one graph instead (:class:`_OneGraphGroups`)."""
    batch, prompt_len = input_ids.shape
    total = prompt_len + options.max_new_tokens
    tracker = StopTracker(options.stopping_criteria, total, batch, input_ids.device, options.streamer)
    one_graph = options.static_cache and not _needs_host_work(options, tracker)
    forward = _group_forward(model, input_ids, attention_mask, group_size, options, one_graph)
    if one_graph:
        return _OneGraphGroups(model, forward, input_ids, attention_mask, options, tracker).run()
    # one buffer for the whole output: a step writes its columns, views give the sequence so far (no copies)
    buffer = input_ids.new_full((batch, total), options.pad_token_id)
    buffer[:, :prompt_len] = input_ids
    mask = attention_mask.new_zeros((batch, total))  # generated columns become valid as they are written
    mask[:, :prompt_len] = attention_mask
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
            buffer[:, length : length + width] = _keep_until_eos(tokens, width, tracker, pad)
            mask[:, length : length + width] = 1
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


def _keep_until_eos(tokens, width, tracker: StopTracker, pad: int) -> torch.Tensor:
    """A group's picked ``tokens`` (B, n) as they are written, by the rule of EOS and the token budget: a row still
    decoding keeps its first ``width`` (the group's slots within ``max_new_tokens``: an int, or a 0-d tensor inside a
    graph) up to and including its first EOS, pad after; a row that has stopped writes pad. The rows that wrote an
    EOS stop (``tracker``)."""
    count, ended = tracker.until_eos(tokens, torch.where(tracker.unfinished, width, 0))
    keep = torch.arange(tokens.shape[1], device=tokens.device) < count[:, None]
    tracker.stop(ended)
    return torch.where(keep, tokens, pad)


class _GroupState:
    """Every tensor a one-graph group-decoding run changes, allocated once per shape and kept on the model: the
    compiled step holds their addresses (CUDA graphs replay on the same memory), and each run refills them in place.
    ``buffer`` / ``mask`` have ``t`` spare columns past the end, which take the slots of a last, cut group."""

    def __init__(self, batch: int, total: int, group_size: int, device):
        def new(*shape, dtype=torch.long):
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(tensor)
            return tensor

        self.buffer, self.mask = new(batch, total + group_size), new(batch, total + group_size)
        self.unfinished, self.length = new(batch, dtype=torch.bool), new()  # length: columns decided

    def reset(self, input_ids, attention_mask, pad: int) -> None:
        prompt_len = input_ids.shape[1]
        self.buffer.fill_(pad)
        self.buffer[:, :prompt_len] = input_ids
        self.mask.zero_()
        self.mask[:, :prompt_len] = attention_mask
        self.unfinished.fill_(True)
        self.length.fill_(prompt_len)


class _OneGraphGroups:
    """Group decoding with a static cache and no host work: after the prompt's forward (eager, as in transformers'
    loop), each step (:meth:`_step`: the form's forward of the next group, pick, EOS and the token budget, write) is
    one compiled graph without a host read, and the loop reads one status tensor per step, as the speculative
    step does (``speculation_lookaround``). Greedy only (:func:`_needs_host_work`); the tokens are those of the loop
    in :func:`_group_decode`."""

    def __init__(self, model, form, input_ids, attention_mask, options: DecodingOptions, tracker: StopTracker):
        batch, self.prompt_len = input_ids.shape
        self.form, self.options, self.tracker, self.group_size = form, options, tracker, form.group_size
        self.total = self.prompt_len + options.max_new_tokens
        key = (batch, self.total, self.group_size, input_ids.device)
        held = getattr(model, "_lookaround_group_state", None)
        if held is None or held[0] != key:
            held = model._lookaround_group_state = (key, _GroupState(*key))
        self.state = held[1]
        self.state.reset(input_ids, attention_mask, options.pad_token_id)
        tracker.unfinished = self.state.unfinished  # EOS stops rows in the state, inside the graph
        compile_config = options.compile_config
        self.step = _group_step(model, compile_config) if compile_config is not None else _OneGraphGroups._step

    def run(self):
        s, t = self.state, self.group_size
        logits = self.form(s.buffer, s.mask[:, : self.total], self.prompt_len, t)  # the prompt's forward
        done = bool(self._commit(logits))
        while not done:
            done = bool(self.step(self))  # the one read per step
        length = int(s.length)
        return build_output(self.options, s.buffer[:, :length].clone(), self.form.cache)

    def _step(self):
        s = self.state
        return self._commit(self.form.next_logits(s.buffer, s.mask, s.length))

    def _commit(self, logits):
        """Pick the group's tokens from ``logits`` (B, t, V) and write them at ``length`` as :func:`_keep_until_eos`
        keeps them (``min(t, tokens left)`` slots count). Returns whether every row is done (0-d)."""
        s, t, options = self.state, self.group_size, self.options
        batch = logits.shape[0]
        _, tokens = process_and_pick(options.logits_processor, logits.flatten(0, 1), None, False)
        tokens = tokens.view(batch, t)
        width = (self.total - s.length).clamp(max=t)
        columns = s.length + torch.arange(t, device=tokens.device)
        s.buffer.index_copy_(1, columns, _keep_until_eos(tokens, width, self.tracker, options.pad_token_id))
        s.mask.index_fill_(1, columns, 1)
        s.length.add_(width)
        return ~s.unfinished.any() | (s.length >= self.total)


def _group_step(model, compile_config):
    """:meth:`_OneGraphGroups._step` compiled whole with ``compile_config``, kept on the model so that every run of
    one shape reuses it."""
    step, = kept_compiled(model, "_lookaround_group_step", compile_config, _OneGraphGroups._step)
    return step


def _needs_host_work(options: DecodingOptions, tracker: StopTracker) -> bool:
    """Whether a step reads tokens on the host: a streamer, scores or logits returned per token, a processor that
    reads the sequence, a stopping criterion other than EOS and the budget (``tracker.others``), or sampling
    (``options.generator`` draws through ``torch.multinomial``, which cannot enter a graph; drawing otherwise would
    change the seeded tokens). Then the static-cache step is the loop of :func:`_group_decode` around a compiled
    forward; otherwise the whole step is one graph (:class:`_OneGraphGroups`)."""
    return bool(options.streamer is not None or options.output_scores or options.output_logits or options.do_sample
                or not reads_only_scores(options.logits_processor) or tracker.others)


def _group_forward(model, input_ids, attention_mask, group_size: int, options: DecodingOptions,
                   one_graph: bool = False):
    """The forward of a group-decoding step for this checkpoint's form, called as ``forward(buffer, mask, length,
    width)`` -> float logits ``(B, width, V)`` of the group at columns ``length .. length + width``; ``forward.cache``
    is the cache it keeps (None without one). ``one_graph``: its forward stays uncompiled, to be traced inside the
    compiled whole step (``forward.next_logits``)."""
    bos = model.config.bos_token_id
    first_real = input_ids.gather(1, (attention_mask == 0).sum(-1, keepdim=True)).squeeze(1)
    has_condition = first_real == bos if bos is not None else torch.zeros_like(first_real, dtype=torch.bool)
    form = _OneStreamGroups if is_one_stream_group_model(model.config) else _TwoStreamGroups
    return form(model, input_ids, attention_mask, has_condition, group_size, options, one_graph)


class _TwoStreamGroups:
    """Group decoding in the two-stream form. The whole plan is known up front (:func:`semi_ar_ranks`: ranks and
    positions of every column, prompt and continuation). A step's content rows, those of the group written last
    (the prompt at first), join the cache; the query rows of the next group read every key of lower rank.
    Without a cache every content row is recomputed, and the next group's columns are invalid keys that only hold
    query rows. With a static cache every key of the plan is passed (the cache has a slot for each column) and the
    query rows of a last, cut group are padded to ``t``: fixed shapes, so that a compiled step is reused."""

    def __init__(self, model, input_ids, attention_mask, has_condition, group_size: int, options: DecodingOptions,
                 one_graph: bool = False):
        self.backbone, self.lm_head, self.group_size = model.base_model, model.lm_head, group_size
        self.total = total = input_ids.shape[1] + options.max_new_tokens
        self.ranks, self.positions = semi_ar_ranks(attention_mask, total, group_size, has_condition)
        self.static, self.past = options.static_cache, 0  # past: columns whose content is in the cache
        self.cache = DynamicCache(config=model.config) if options.use_cache else None
        if self.static:
            self.cache = _static_cache(model, input_ids.shape[0], total, input_ids.dtype)
            self.prefill, self.step = _decoding_step(model, None if one_graph else options.compile_config)
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

    def next_logits(self, buffer, mask, length: torch.Tensor) -> torch.Tensor:
        """A static-cache step after the prompt's, inside one graph: ``length`` (0-d) columns are decided, so the
        content rows are the ``t`` columns before it (the group written last, always whole) and the query rows the
        ``t`` after it. Gathered at a device index, never sliced at a host int: one graph serves every step."""
        t, batch = self.group_size, buffer.shape[0]
        content = (length - t + torch.arange(t, device=buffer.device)).expand(batch, t)
        queries = content + t
        return self.step(buffer.gather(1, content), mask[:, : self.total], self.ranks, self.positions.gather(1, content),
                         self.cache, self.query_positions.gather(1, queries), self.query_ranks.gather(1, queries))


class _OneStreamGroups:
    """Group decoding in dar's one-stream form (block-causal content rows; the row ``t`` places before a token
    predicts it). The prompt is laid out once (:func:`one_stream_prompt`); a step's content rows, those of the
    group written last, join the cache, and the last ``t`` rows predict the next group. Without a cache the laid-out
    prompt and every token written since run again."""

    def __init__(self, model, input_ids, attention_mask, has_condition, group_size: int, options: DecodingOptions,
                 one_graph: bool = False):
        bos = model.config.bos_token_id
        if bos is None or not bool(has_condition.all()):
            raise ValueError("a one-stream (block-causal) checkpoint decodes prompts that start with the BOS token "
                             "(its start rows are copies of it): put tokenizer.bos_token in front of each prompt")
        self.prompt_len, self.group_size = input_ids.shape[1], group_size
        self.total = self.prompt_len + options.max_new_tokens
        self.ids, self.mask, self.positions = one_stream_prompt(input_ids, attention_mask, group_size, bos,
                                                                options.pad_token_id)
        self.static, self.past = options.static_cache, 0
        compile_config = options.compile_config if self.static and not one_graph else None
        self.prefill, self.step = _decoding_step(model, compile_config, one_stream=True)
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

    def next_logits(self, buffer, mask, length: torch.Tensor) -> torch.Tensor:
        """A static-cache step after the prompt's, inside one graph: the content rows are the ``t`` columns before
        ``length`` (0-d; the group written last), at the positions that continue each row's prompt; every key of the
        cache is passed, its mask the laid-out prompt's then the generated columns'."""
        t, batch, prompt_len = self.group_size, buffer.shape[0], self.prompt_len
        content = (length - t + torch.arange(t, device=buffer.device)).expand(batch, t)
        key_mask = torch.cat([self.mask, mask[:, prompt_len : self.total]], 1)
        return self.step(buffer.gather(1, content), key_mask, self.generated_positions.gather(1, content - prompt_len),
                         self.cache)
