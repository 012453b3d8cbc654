"""Masked-diffusion decoding of ``mdlm`` and ``bd3lm`` checkpoints, what ``generate(..., decoding=DiffusionDecoding(...))``
(or the shorthands ``diffusion_threshold=`` / ``diffusion_steps=``) runs (DESIGN.md, "Masked diffusion is a plan too").

The new tokens are cut into blocks, decoded left to right: blocks of the checkpoint's ``diffusion_block`` for a
``bd3lm`` checkpoint, one block holding every new token for an ``mdlm`` checkpoint. In ranks (the training plan's):
the prompt is clean text (BOS rank 0, then bd3lm's clean blocks ``2k`` above it, or mdlm's one unmasked rank), new
block ``k``'s committed tokens take rank ``R + 2k`` and its still-masked positions ``R + 2k + 1`` (``R`` above every
prompt rank). So a masked position's query row reads every earlier block and the committed part of its own, never a
later block, and a finished block's content rows, which see the earlier blocks and their whole (clean) block, are
exactly what any later step reads of them: they join the KV cache once (the prompt's content rows at the first
step: prefix caching) and are never recomputed. The current block's content rows are recomputed each step (its
committed set grows) and dropped from the cache after the step.

Inside a block, each step predicts every masked position and commits the most confident (the probability of the
picked token): every one at or above ``threshold`` (Fast-dLLM; at least one per step), or the share of a fixed
``steps`` per block. Each row commits at its own pace; a row that commits EOS stops: its later positions become
padding (never attended, never predicted) and it costs no further commits. The mask token is never committed.
With ``cache_implementation="static"`` the cache has a slot per column and each step after the prompt's is one
compiled graph of fixed shapes, as the speculative step is: the forward (the bundle's ``_decoding_step``), the pick,
the commit rule, the updates and EOS (``_DiffusionRun._commit``), the block at a 0-d device index; two shapes, the
first step of a block, which re-writes the finished block's rows, and the others. The loop reads one small status
per step. Sampling draws ``torch.multinomial``'s own noise before the graph (``sampling_noise``): the same tokens.

A ``bd3lm`` checkpoint of the one-stream form (``x_t ⊕ x_0``, ``default_attention="block_diffusion"``) decodes as
BD3-LM does: the same ranks, with the block's noised rows (its committed tokens and ``[MASK]`` at the masked
positions, all valid keys) in place of query rows; they see each other and the clean keys of lower rank
(``masking_lookaround.may_attend`` with noised keys). The clean rows of a finished block run with the next block's
first step and join the cache; the noised rows are dropped from it after each step. With
``cache_implementation="static"`` it follows the two-stream form's design: a slot per column (at a block's first step
the finished block's clean rows overwrite its noised keys), the same two step shapes after the prompt's, the counter
reset in place, and each step one compiled graph whose forward (:func:`_block_diffusion_forward`) builds its mask
from the full-width ranks and committed and open columns (:func:`one_stream_decoding_plan`, which the dynamic
cache's steps use too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerateDecoderOnlyOutput

from .decoding_lookaround import (
    DecodingStrategy,
    is_block_diffusion_model,
    StopTracker,
    kept_compiled,
    _decoding_step,
    _refuse_or_warn,
    _static_cache,
    build_output,
    process_and_pick,
    reads_only_scores,
    sampling_noise,
)
from .inputs_lookaround import PreparedInputs
from .masking_lookaround import NO_TARGET_RANK, AttentionPlan, build_prepared_attention

logger = logging.getLogger(__name__)

__all__ = ["DiffusionDecoding", "GenerateDiffusionOutput", "diffusion_block_of",
           "diffusion_decoding", "diffusion_ranks", "is_diffusion_model"]

def is_diffusion_model(config) -> bool:
    """Whether ``config`` records a masked-diffusion plan (``diffusion_block_size``, written from its objective's
    parameters at pretraining: ``objectives/mdlm.py``, ``objectives/bd3lm.py``)."""
    return getattr(config, "diffusion_block_size", None) is not None


def decodes_by_diffusion(config) -> bool:
    """Whether ``generate(diffusion_threshold=... | diffusion_steps=...)`` decodes the checkpoint: it records a
    diffusion plan and predicts with the query stream, or is BD3-LM's one-stream ``x_t ⊕ x_0`` form (mdlm's
    ``[MASK]`` form decodes by infilling)."""
    return is_diffusion_model(config) and (getattr(config, "prediction_stream", None) != "content"
                                           or is_block_diffusion_model(config))


def diffusion_block_of(config) -> int | None:
    """The block size a checkpoint was trained with: ``bd3lm``'s b; None for ``mdlm`` (one block: every new
    token) and for checkpoints without a diffusion plan."""
    return getattr(config, "diffusion_block_size", None) or None


def diffusion_ranks(attention_mask: torch.Tensor, max_new_tokens: int, block: int | None, has_condition):
    """``(ranks, positions)`` ``(B, P + n)`` of a left-padded prompt and its ``n`` new columns, the content ranks of
    the diffusion plan with every token clean (module doc); a masked position's query row takes its rank + 1.

    Prompt: BOS (``has_condition``) rank 0, text position ``i >= c`` rank ``c + 2 ((i - c) // b)`` (bd3lm's clean
    blocks), or ``c`` for every text token (``block=None``, mdlm). New block ``k`` (columns ``P + k b ..``): rank
    ``R + 2k``, ``R = 2 P + 2`` above every prompt rank. Position ids count real tokens only."""
    batch, prompt_cols = attention_mask.shape
    device = attention_mask.device
    total = prompt_cols + max_new_tokens
    real = (attention_mask != 0).long().sum(-1, keepdim=True)
    cols = torch.arange(total, device=device).expand(batch, total)
    i = cols - (prompt_cols - real)  # position in the row's own sequence
    c = has_condition.long().view(batch, 1).to(device)
    text = (i - c).clamp(min=0)
    prompt_rank = c + (2 * torch.div(text, block, rounding_mode="floor") if block else 0)
    prompt_rank = torch.where(i < c, torch.zeros_like(prompt_rank), prompt_rank)
    new_block = torch.div((cols - prompt_cols).clamp(min=0), block or max(max_new_tokens, 1), rounding_mode="floor")
    ranks = torch.where(cols < prompt_cols, prompt_rank, 2 * prompt_cols + 2 + 2 * new_block)
    return ranks, i.clamp(min=0)


def one_stream_decoding_plan(ranks, committed, open_, first, start, end, width: int) -> AttentionPlan:
    """The attention plan of one decoding forward of BD3-LM's one-stream form. Keys: columns ``0 .. K`` of
    ``ranks``, ``committed``, ``open_`` ``(B, K)``; the columns ``start .. end`` hold the block's noised rows' keys
    (committed tokens and ``[MASK]`` at the open positions; EOS padding is no key), the others clean keys (the
    committed tokens). Rows: the ``width`` columns from ``first`` (clean rows, then the noised rows at
    ``start .. end``). ``first``, ``start``, ``end``: ints, or 0-d tensors inside a compiled step (no host read).
    ``masking_lookaround.may_attend`` with noised keys says who sees whom."""
    column = torch.arange(ranks.shape[1], device=ranks.device)
    key_is_noised = ((column >= start) & (column < end)).expand_as(committed)
    key_valid = torch.where(key_is_noised, committed | open_, committed)
    rows = first + torch.arange(width, device=ranks.device)
    return AttentionPlan(query_rank=ranks[:, rows], query_is_strict=key_is_noised[:, rows], key_rank=ranks,
                         key_valid=key_valid, key_is_noised=key_is_noised)


def _block_diffusion_forward(model):
    """The one-stream form's forward with a static cache, ``forward(input_ids, position_ids, ranks, committed, open_,
    cache, block)``: the rows of the columns from the cache's counter on (the clean rows entering the cache, then
    the block's ``block`` noised rows), their mask built inside from the full-width ``(B, columns)`` tensors; returns
    the noised rows' float logits. Traced inside the compiled whole step (:func:`_diffusion_steps`)."""
    backbone, lm_head = model.base_model, model.lm_head

    def forward(input_ids, position_ids, ranks, committed, open_, cache, block: int):
        width = input_ids.shape[1]
        end = cache.get_seq_length() + width  # the counter (a 0-d tensor once the cache holds keys) is the first row
        plan = one_stream_decoding_plan(ranks, committed, open_, end - width, end - block, end, width)
        masks = build_prepared_attention(plan, model.config._attn_implementation, model.dtype, width,
                                         with_query_rows=False)
        out = backbone(input_ids=input_ids, position_ids=position_ids, attention_pattern="bidirectional",
                       past_key_values=cache, use_cache=True, prepared=PreparedInputs(attention=masks))
        return lm_head(out.last_hidden_state[:, -block:]).float()

    return forward


def _diffusion_steps(model, compile_config):
    """A block's first step and its other steps (:meth:`_DiffusionRun._first_step`, :meth:`_DiffusionRun._next_step`),
    each compiled whole as one graph with ``compile_config``, kept on the model so that every run of one shape
    reuses them (as the speculative steps are)."""
    return kept_compiled(model, "_lookaround_diffusion_steps", compile_config, _DiffusionRun._first_step,
                         _DiffusionRun._next_step)


@dataclass
class GenerateDiffusionOutput(GenerateDecoderOnlyOutput):
    """What ``generate(..., decoding=DiffusionDecoding(...), return_dict_in_generate=True)`` returns: the sequences
    and how many forwards made them.

    num_forwards (`int`): forwards of the model (the first one reads the prompt too).
    num_new_tokens (`(B,)`): the tokens each row committed, up to and including its EOS (padding after it not counted).
    """

    num_forwards: int | None = None
    num_new_tokens: torch.LongTensor | None = None

    @property
    def tokens_per_forward(self) -> float:
        """New tokens per forward, over the batch (a row's tokens count once: batch 1 is the decoder's parallelism)."""
        return float(self.num_new_tokens.float().mean()) / max(self.num_forwards, 1)


@dataclass
class DiffusionDecoding(DecodingStrategy):
    """Block-wise masked-diffusion decoding (module doc). Give one of ``threshold`` (commit every masked position
    whose picked token has probability ``>= threshold``, at least one per step; > 1: exactly one) or ``steps`` (a
    fixed number of steps per block, the most confident ``ceil(left / steps left)`` each); neither: one per step.
    ``block`` overrides the checkpoint's block size (bd3lm: ``diffusion_block``; mdlm: every new token in one block);
    any other than the trained one is refused unless ``allow_untrained``."""

    threshold: float | None = None
    steps: int | None = None
    block: int | None = None

    def __post_init__(self):
        if self.threshold is not None and self.steps is not None:
            raise ValueError("diffusion decoding takes a confidence threshold or a fixed number of steps per block, "
                             "not both: drop threshold (--diffusion_threshold) or steps (--diffusion_steps)")
        if self.threshold is not None and (isinstance(self.threshold, bool) or not float(self.threshold) > 0):
            raise ValueError(f"diffusion threshold must be a probability > 0 (> 1: one commit per step), "
                             f"got {self.threshold!r}")
        for name in ("steps", "block"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"diffusion {name} must be an int >= 1, got {value!r}")
        self._block = self.block

    def check(self, config, allow_untrained: bool = False) -> None:
        objective = getattr(config, "objective", None)
        if not is_diffusion_model(config):
            _refuse_or_warn(f"diffusion decoding denoises blocks as mdlm / bd3lm pretraining does; this checkpoint was "
                            f"pretrained with the {objective!r} objective: use group decoding (group_size) or "
                            f"decoding=Infilling(...)", allow_untrained)
        if getattr(config, "prediction_stream", None) == "content" and not is_block_diffusion_model(config):
            raise ValueError("diffusion decoding reads the query stream; this checkpoint was trained single-stream "
                             "([MASK] inputs): fill positions with decoding=Infilling(stream='content') instead")
        trained = diffusion_block_of(config)
        if self.block is not None and self.block != trained:
            _refuse_or_warn(f"block={self.block} was not trained: this {objective!r} checkpoint denoises "
                            + (f"blocks of {trained}" if trained else "every new token as one block"), allow_untrained)
        self._block = self.block if self.block is not None else trained

    def decode(self, model, input_ids, attention_mask, options):
        return _DiffusionRun(model, input_ids, attention_mask, self.threshold, self.steps, self._block, options).run()


def diffusion_decoding(threshold=None, steps=None) -> DiffusionDecoding | None:
    """The strategy of ``generate()``'s shorthands ``diffusion_threshold=`` / ``diffusion_steps=`` (None if neither)."""
    if threshold is None and steps is None:
        return None
    return DiffusionDecoding(threshold=threshold, steps=steps)


class _DiffusionState:
    """Every tensor a diffusion run changes, allocated once per shape and kept on the model: a compiled step holds
    their addresses (CUDA graphs replay on the same memory, as transformers' StaticCache does), and each run refills
    them in place. ``buffer`` holds the tokens (masked positions hold the mask token, never read: their keys are
    invalid), ``committed`` the columns that are valid keys, ``open`` the masked positions still to predict,
    ``start`` the current block's first column and ``step`` the steps taken in it (0-d: no host int in a graph)."""

    def __init__(self, batch: int, columns: int, device):
        def new(*shape, dtype=torch.long):
            tensor = torch.zeros(shape, dtype=dtype, device=device)
            torch._dynamo.mark_static_address(tensor)
            return tensor

        self.buffer, self.ranks, self.positions = new(batch, columns), new(batch, columns), new(batch, columns)
        self.committed, self.open = new(batch, columns, dtype=torch.bool), new(batch, columns, dtype=torch.bool)
        self.unfinished, self.start, self.step = new(batch, dtype=torch.bool), new(), new()


def _diffusion_state(model, batch: int, columns: int, device) -> _DiffusionState:
    """The state of the last shape, reused across runs of that shape (as :func:`_static_cache` reuses its cache)."""
    key = (batch, columns, device)
    held = getattr(model, "_lookaround_diffusion_state", None)
    if held is None or held[0] != key:
        held = model._lookaround_diffusion_state = (key, _DiffusionState(*key))
    return held[1]


class _DiffusionRun:
    """One diffusion decode of a left-padded batch (module doc), its tensors in a :class:`_DiffusionState`.

    A step is a forward and :meth:`_commit` (pick, confidence, the commit rule, the updates, EOS), which returns the
    status the loop reads, once per step: whether a row still decoding has a masked position in the block, and
    whether any row still decodes. With ``cache_implementation="static"`` each step after the prompt's (eager, its
    own width) is one compiled graph (:meth:`_first_step`, :meth:`_next_step`: fixed shapes, columns gathered at
    the 0-d ``start``); sampling draws its noise before the graph (:func:`sampling_noise`), so the tokens are the
    dynamic cache's, which runs the same :meth:`_commit` eager after its forward."""

    def __init__(self, model, input_ids, attention_mask, threshold, steps, block, options):
        config = model.config
        if not reads_only_scores(options.logits_processor):
            raise ValueError("diffusion decoding takes sampling warpers only (temperature, top_k, top_p, ...): a "
                             "processor that reads the sequence so far (repetition penalty, ...) has no sequence "
                             "order to read; drop it")
        if options.output_scores or options.output_logits:
            raise ValueError("output_scores / output_logits: diffusion decoding commits positions in any order, "
                             "not one token per step; drop them")
        if config.mask_token_id is None:
            raise ValueError("diffusion decoding needs config.mask_token_id (the token it never commits)")
        self.model, self.options, self.threshold, self.steps = model, options, threshold, steps
        self.batch, self.prompt_len = input_ids.shape
        self.new = options.max_new_tokens
        self.block = block or self.new
        self.total = self.prompt_len + self.new
        # the columns, padded to whole blocks: every step has the same shapes (the padding is never valid or open)
        self.columns = self.prompt_len + -(-self.new // self.block) * self.block
        self.device = input_ids.device
        self.mask_id = config.mask_token_id
        self.tracker = StopTracker(options.stopping_criteria, self.total, self.batch, self.device, options.streamer)
        if self.tracker.others:
            raise ValueError("diffusion decoding stops at EOS and max_new_tokens only; stop strings and other "
                             "stopping criteria read tokens in order, which diffusion does not write: drop them")
        bos = config.bos_token_id
        first = input_ids.gather(1, (attention_mask == 0).sum(-1, keepdim=True)).squeeze(1)
        has_condition = first == bos if bos is not None else torch.zeros_like(first, dtype=torch.bool)
        ranks, positions = diffusion_ranks(attention_mask, self.columns - self.prompt_len, block, has_condition)
        s = self.state = _diffusion_state(model, self.batch, self.columns, self.device)
        s.ranks.copy_(ranks)
        s.positions.copy_(positions.clamp(max=config.max_position_embeddings - 1))  # the block padding's: never read
        s.buffer.fill_(self.mask_id)
        s.buffer[:, : self.prompt_len] = input_ids
        s.committed.zero_()
        s.committed[:, : self.prompt_len] = attention_mask != 0
        s.open.zero_()
        s.open[:, self.prompt_len : self.total] = True
        s.unfinished.fill_(True)
        self.tracker.unfinished = s.unfinished  # EOS stops rows in the state, inside the graph
        self.static = options.static_cache
        self.one_stream = is_block_diffusion_model(config)
        if self.static:  # a slot per column; each step after the prompt's is one compiled graph of fixed shapes
            self.cache = _static_cache(model, self.batch, self.columns, input_ids.dtype)
            # the forward, traced inside the compiled whole step; the prompt's runs eager (its own width)
            self.forward = _block_diffusion_forward(model) if self.one_stream else _decoding_step(model, None)[0]
            if options.compile_config is not None:
                self.first_step, self.next_step = _diffusion_steps(model, options.compile_config)
            else:
                self.first_step, self.next_step = _DiffusionRun._first_step, _DiffusionRun._next_step
        else:
            self.cache = DynamicCache(config=config) if options.use_cache else None
        self.cached = 0  # columns whose content is in the cache (clean: earlier blocks, the prompt)
        self.forwards = 0

    def run(self):
        s = self.state
        for start in range(self.prompt_len, self.total, self.block):
            # no read before a block: a row still decoding has committed no EOS (a row with one stops once the
            # masked columns before it, all in the EOS's block, are filled), so the new block is all masked for it
            s.start.fill_(start)
            s.step.zero_()
            block_open, first = True, True
            while block_open:
                status = self._step(start, first)
                block_open, decoding = status.tolist()  # the one read per step
                first = False
                self.forwards += 1
            if not decoding:
                break
        return self._output()

    def _step(self, start: int, first: bool) -> torch.Tensor:
        """One step of the block at ``start``: its forward and :meth:`_commit`; the status (module doc)."""
        prompt = first and start == self.prompt_len
        if self.static and not prompt:
            return (self.first_step if first else self.next_step)(self, self._noise())
        if self.static:  # the prompt's forward, its own width, eager
            logits = self._static_forward(self.forward, torch.arange(start + self.block, device=self.device))
        else:
            logits = self._forward(start, start + self.block)
        return self._commit(logits, self._noise())

    # the two compiled steps: each is one graph -----------------------------------------------------------------
    def _first_step(self, noise):
        """A block's first step: the finished block's clean rows join the cache with the new block's."""
        return self._commit(self._static_forward(self.forward, self._columns(-self.block, 2 * self.block)), noise)

    def _next_step(self, noise):
        """The other steps of a block: its own rows."""
        return self._commit(self._static_forward(self.forward, self._columns(0, self.block)), noise)

    def _columns(self, offset: int, width: int) -> torch.Tensor:
        return self.state.start + offset + torch.arange(width, device=self.device)

    def _static_forward(self, forward, rows: torch.Tensor) -> torch.Tensor:
        """The static cache's forward of the content rows at the columns ``rows`` (the last ``block`` are the
        block's), every key of the plan passed (a slot per column); the block's own columns are then forgotten:
        the cache's counter reset in place to ``start``, where the next forward writes. Float logits ``(B, b, V)``
        of the block's columns."""
        s, block = self.state, self.block
        columns = self._columns(0, block)
        if self.one_stream:  # the step builds its own mask from the full-width tensors
            logits = forward(s.buffer.index_select(1, rows), s.positions.index_select(1, rows), s.ranks, s.committed,
                             s.open, self.cache, block)
        else:
            query_ranks = torch.where(s.open.index_select(1, columns), s.ranks.index_select(1, columns) + 1,
                                      NO_TARGET_RANK)
            logits = forward(s.buffer.index_select(1, rows), s.committed.long(), s.ranks,
                             s.positions.index_select(1, rows), self.cache, s.positions.index_select(1, columns),
                             query_ranks)
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(s.start)
        return logits

    def _noise(self):
        """The step's sampling noise, drawn outside its graph (None when greedy)."""
        if not self.options.do_sample:
            return None
        vocab = self.model.lm_head.weight.shape[0]  # the logits' width
        return sampling_noise((self.batch * self.block, vocab), self.device, self.options.generator)

    # the dynamic cache (or none) ---------------------------------------------------------------------------------
    def _forward(self, start: int, end: int) -> torch.Tensor:
        """One forward: the content rows from the first column not cached to the block's end (committed columns are
        valid keys), query rows at the block's columns (masked positions; the others predict nothing). The cache
        keeps the columns before the block (clean); the block's own are dropped. Float logits ``(B, w, V)``."""
        s, past = self.state, self.cached if self.cache is not None else 0
        if self.one_stream:
            return self._one_stream_forward(past, start, end)
        query_ranks = torch.where(s.open[:, start:end], s.ranks[:, start:end] + 1, NO_TARGET_RANK)
        out = self.model.base_model(
            input_ids=s.buffer[:, past:end], attention_mask=s.committed[:, :end].long(),
            group_ids=s.ranks[:, :end], position_ids=s.positions[:, past:end],
            past_key_values=self.cache, use_cache=self.cache is not None,
            query_position_ids=s.positions[:, start:end], query_group_ids=query_ranks,
        )
        self._drop_block(start)
        return self.model.lm_head(out.query_hidden_state).float()

    def _one_stream_forward(self, past: int, start: int, end: int) -> torch.Tensor:
        """One forward of the one-stream form (module doc): clean rows for the columns ``past .. start`` (not cached
        yet), then the block's noised rows; keys: the cache, then those rows. The clean rows join the cache."""
        s = self.state
        plan = one_stream_decoding_plan(s.ranks[:, :end], s.committed[:, :end], s.open[:, :end], past,
                                        start, end, end - past)
        masks = build_prepared_attention(plan, self.model.config._attn_implementation, self.model.dtype,
                                         end - past, with_query_rows=False)
        out = self.model.base_model(
            input_ids=s.buffer[:, past:end], position_ids=s.positions[:, past:end],
            attention_pattern="bidirectional", past_key_values=self.cache, use_cache=self.cache is not None,
            prepared=PreparedInputs(attention=masks),
        )
        self._drop_block(start)
        return self.model.lm_head(out.last_hidden_state[:, start - past:]).float()

    def _drop_block(self, start: int) -> None:
        """Keep the clean columns before the block in the DynamicCache, drop the block's own (crop takes a
        negative count in 5.x)."""
        if self.cache is not None:
            drop = self.cache.get_seq_length() - start
            if drop > 0:
                self.cache.crop(-drop)
            self.cached = start

    # every step's bookkeeping ------------------------------------------------------------------------------------
    def _commit(self, logits, noise=None) -> torch.Tensor:
        """Pick a token at every masked position of the block, commit the most confident (threshold or schedule),
        and stop the rows that committed EOS (their later positions become padding). No host read: the block is at
        the 0-d ``start``. Returns the status ``[a row still decoding has a masked position in the block, a row
        still decodes]``."""
        s, options, block = self.state, self.options, self.block
        columns = self._columns(0, block)
        logits[..., self.mask_id] = float("-inf")  # never commit the mask token
        scores, tokens = process_and_pick(options.logits_processor, logits.flatten(0, 1), None, options.do_sample,
                                          options.generator, noise)
        scores, tokens = scores.view(self.batch, block, -1), tokens.view(self.batch, block)
        confidence = torch.softmax(scores, -1).gather(-1, tokens[..., None]).squeeze(-1)
        eligible = s.open.index_select(1, columns) & s.unfinished[:, None]
        confidence = torch.where(eligible, confidence, -1.0)
        order = torch.argsort(torch.argsort(confidence, dim=-1, descending=True, stable=True), dim=-1)  # 0: most confident
        if self.threshold is not None:
            commit = eligible & ((confidence >= self.threshold) | (order == 0))
        else:
            left = eligible.sum(-1, keepdim=True)
            steps = self.steps if self.steps is not None else (self.total - s.start).clamp(max=block)  # real width
            quota = -torch.div(-left, (steps - s.step).clamp(min=1), rounding_mode="floor")  # ceil: done at the last
            commit = eligible & (order < quota)
        s.buffer.index_copy_(1, columns, torch.where(commit, tokens, s.buffer.index_select(1, columns)))
        s.committed.index_copy_(1, columns, s.committed.index_select(1, columns) | commit)
        s.open.index_copy_(1, columns, s.open.index_select(1, columns) & ~commit)
        s.step.add_(1)
        self._stop_at_eos()
        block_open = (s.open.index_select(1, columns) & s.unfinished[:, None]).any()
        return torch.stack([block_open, s.unfinished.any()])

    def _stop_at_eos(self) -> None:
        """A row's first committed EOS ends it: every column after it becomes padding (an invalid key, not
        predicted); the row is finished once nothing before its EOS is still masked."""
        if self.tracker.eos_ids is None:
            return
        s, new = self.state, slice(self.prompt_len, self.total)  # the padding columns after it stay closed
        is_eos = torch.isin(s.buffer[:, new], self.tracker.eos_ids) & s.committed[:, new]
        has_eos = is_eos.any(-1)
        first = torch.where(has_eos, is_eos.long().argmax(-1), self.new)  # (B,) index among the new columns
        after = torch.arange(self.new, device=self.device) > first[:, None]
        s.buffer[:, new] = torch.where(after, self.options.pad_token_id, s.buffer[:, new])
        s.committed[:, new] &= ~after
        s.open[:, new] &= ~after
        self.tracker.stop(has_eos & ~s.open[:, new].any(-1))

    def _output(self):
        s = self.state  # refilled by the next run: hand out copies
        # the columns any row wrote (rows that ended early hold padding up to there)
        written = torch.where(s.committed[:, self.prompt_len : self.total], 1, 0)
        num_new = torch.where(written.any(-1), self.new - written.flip(-1).argmax(-1), 0)
        width = self.prompt_len + int(num_new.max())
        sequences = s.buffer[:, :width].clone()
        # a row that stopped holds padding where nothing was committed
        sequences[:, self.prompt_len :] = torch.where(s.committed[:, self.prompt_len : width],
                                                      sequences[:, self.prompt_len :], self.options.pad_token_id)
        self.tracker.put(sequences[0, self.prompt_len :])
        self.tracker.end()
        logger.info("diffusion decoding: %d forwards for %d new tokens per row (%.2f tokens per forward)",
                    self.forwards, int(num_new.float().mean()), float(num_new.float().mean()) / max(self.forwards, 1))
        return build_output(self.options, sequences, self.cache, output_class=GenerateDiffusionOutput,
                            num_forwards=self.forwards, num_new_tokens=num_new)
