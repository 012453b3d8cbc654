"""Lossless self-speculative decoding, what ``generate(..., draft_group_size=k)`` runs: the tokens of AR
(``t = 1``) decoding, up to ``k`` of them per forward (draft with a ``dar`` group of the query stream, verify with
the AR query rows, commit, drop the rejected drafts' keys; :class:`Speculation`). A :class:`SpeculativeDecoding`
strategy (``decoding_lookaround.DecodingStrategy``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerateDecoderOnlyOutput

from .decoding_lookaround import (
    DecodingStrategy,
    StopTracker,
    UntrainedDecodingError,
    kept_compiled,
    _decoding_step,
    _refuse_or_warn,
    _static_cache,
    build_output,
    check_group_size,
    is_one_stream_group_model,
    process,
    reads_only_scores,
    trained_group_sizes,
)
from .masking_lookaround import NO_TARGET_RANK

logger = logging.getLogger(__name__)

__all__ = ["SPECULATION_BREAK_EVEN", "GenerateSpeculativeOutput", "SpeculativeDecoding", "check_draft_group_size"]

# When speculation pays: a verify-and-draft step costs ``1 + c`` plain (t = 1) steps and writes ``1 + a`` tokens per
# row, ``a`` the drafts it keeps, so it pays while ``a > c``. ``c`` is (speculative step time / plain step time) - 1,
# measured on the GPU (docs/generation.md, "Falling back to plain steps"); 0 never falls back.
SPECULATION_BREAK_EVEN = 0.25
SPECULATION_WINDOW = 8  # verify steps whose accepted drafts decide whether speculation pays
SPECULATION_REST = 32  # plain steps before speculation is probed again


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


class SpeculativeDecoding(DecodingStrategy):
    """``generate(..., draft_group_size=k)``: lossless self-speculative decoding (:class:`_Speculation`)."""

    def __init__(self, draft_group_size: int):
        self.draft_group_size = draft_group_size

    def check(self, config, allow_untrained: bool = False) -> None:
        check_draft_group_size(config, self.draft_group_size, allow_untrained)

    def decode(self, model, input_ids, attention_mask, options):
        if not options.use_cache:
            raise ValueError("self-speculative decoding verifies drafts against a KV cache: use_cache=False "
                             "is not supported with draft_group_size")
        return _Speculation(model, input_ids, attention_mask, self.draft_group_size, options).run()


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

    def __init__(self, model, input_ids, attention_mask, draft_group_size: int, options):
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
    return kept_compiled(model, "_lookaround_speculation_steps", compile_config, _Speculation._speculative_step,
                         _Speculation._plain_step)
