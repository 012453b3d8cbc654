"""Any-order infilling (the MaskGIT / MDLM / LLaDA pattern) for masked, variable-mask and GVP checkpoints
(DESIGN.md, "Decoding with the streams"): every step predicts all remaining hidden positions from the visible
ones (visible rank 0, hidden rank 1, query rows at the hidden positions; the content of a hidden position is
never seen by anyone) and commits some of them, by confidence, at random or left to right, on a cosine or
linear schedule. Entry points: :func:`infill`, or ``model.generate(..., decoding=Infilling(...))``, which fills the
``max_new_tokens`` positions after a prompt in any order. Group decoding (ar / dar checkpoints) is ``generate()``'s
(:mod:`hf_lookaround.decoding`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from transformers.generation import (
    LogitsProcessorList,
)

from .. import objectives
from ..models.lookaround.decoding_lookaround import (
    DecodingStrategy,
    StopTracker,
    _check_length,
    _device,
    _refuse_or_warn,
    build_output,
    make_logits_processor,
    process_and_pick,
)
from ..models.lookaround.masking_lookaround import infilling_ranks
from ..models.lookaround.modeling_lookaround import positions_of  # the model's own (B, T) bool -> (B, M) slots

logger = logging.getLogger(__name__)

ORDERS = ("confidence", "random", "left_to_right")
SCHEDULES = ("cosine", "linear")


def check_infill_objective(config, allow_untrained: bool = False) -> None:
    """Infilling shows every visible token at rank 0 (bidirectional content), as masked and GVP pretraining do."""
    objective = getattr(config, "objective", None)
    if objective is None:
        logger.warning("the config records no pretraining objective: cannot check that it was trained to infill")
    elif objectives.INFILLING not in (objectives.decoders(objective, getattr(config, "plan_params", None)) or ()):
        _refuse_or_warn(f"this checkpoint was pretrained with the {objective!r} objective, whose content stream never "
                        "saw a bidirectional context: continue text with group decoding "
                        "(model.generate(..., group_size=t)) instead of infilling", allow_untrained)


@dataclass
class InfillOutput:
    """sequences ``(B, T)`` with every hidden position filled; ``commit_step`` ``(B, T)``: the step (1-based) at
    which each position was committed, 0 for positions that were visible; ``text``: the decoded rows if a
    tokenizer was given (a str for a str input, else a list); ``num_steps``: forwards run; ``logits``: each
    step's logits with ``output_logits``."""

    sequences: torch.LongTensor
    commit_step: torch.LongTensor
    num_steps: int
    text: list[str] | str | None = None
    logits: tuple[torch.Tensor, ...] | None = None


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
        # "a [MASK] b" encodes as a, " ", [MASK], " b": the space before a mask token is its own token, and a filled
        # word brings its own leading space ("Ġsat"): drop that space token, or the text reads "a  sat b"
        space = tokenizer(" ", add_special_tokens=False)["input_ids"]
        for text in texts:
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
            if mask_id is not None and len(space) == 1:
                ids = [t for i, t in enumerate(ids) if not (t == space[0] and i + 1 < len(ids) and ids[i + 1] == mask_id)]
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
    output_logits: bool = False,
    block_length: int | None = None,
    confidence_noise: float = 0.0,
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
    The ranks are those of masked / GVP pretraining (:func:`masking_lookaround.infilling_ranks`): a row that starts with a
    visible BOS gives it rank 0 alone, the visible tokens rank 1 and the hidden positions rank 2.
    ``output_logits``: also return each step's logits ``(B, T, V)`` (NaN at positions not predicted that step).

    Semi-autoregressive blocks (LLaDA): ``block_length=L`` splits each row's hidden positions, left to right, into
    blocks of ``L``; the blocks are filled one after the other, each in ``steps`` steps (LLaDA's steps per block;
    default: one commit per step), and a step commits only in the current block while every hidden position,
    later blocks included, stays hidden from the others. ``confidence_noise=τ`` adds MaskGIT's annealed
    Gumbel noise to the log-confidence of ``order="confidence"`` (``τ · (1 - s/S) · Gumbel``), so that
    commits are not always the most confident: more diverse samples, at τ = 0 none.

    (The steps: :func:`_infill_inputs`, :func:`_block_schedules`, then :func:`_fill_in_steps`, whose every step
    is :func:`_infill_logits`, :func:`process_and_pick` and :func:`_commit_now`.)
    """
    _check_infill_options(order, block_length, confidence_noise, num_tokens)
    check_infill_objective(model.config, allow_untrained)
    config, device = model.config, _device(model)
    stream = _prediction_stream(config, stream)
    ids, remaining, valid = _infill_inputs(tokenizer, text_or_ids, hidden, num_tokens, attention_mask, add_bos,
                                           config, device)
    blocks = _block_schedules(remaining, block_length, steps, schedule)
    processors, generator = _sampling(do_sample, temperature, top_k, top_p, logits_processor, seed, generator,
                                      device)
    if stream == "content" and config.mask_token_id is None:
        raise ValueError("the content-stream pathway reads [MASK] inputs, but config.mask_token_id is None")
    is_condition = _condition_tokens(ids, remaining, valid, tokenizer, config)
    commit_step, ran, all_logits = _fill_in_steps(
        model, stream, ids, remaining, valid, is_condition, blocks, processors, do_sample=do_sample,
        generator=generator, order=order, confidence_noise=confidence_noise, output_logits=output_logits)
    return InfillOutput(sequences=ids, commit_step=commit_step, num_steps=ran,
                        text=_decoded_text(tokenizer, ids, valid, text_or_ids),
                        logits=tuple(all_logits) if output_logits else None)


def _infill_inputs(tokenizer, text_or_ids, hidden, num_tokens, attention_mask, add_bos, config, device):
    """The rows to fill, checked: ids (B, T), the hidden positions (B, T) bool and the valid ones (B, T) bool."""
    ids, remaining, valid = _encode_infill_inputs(
        tokenizer, text_or_ids, hidden, num_tokens, attention_mask, add_bos, config, device
    )
    _check_length(ids.shape[1], config, "the sequence to infill")
    if not remaining.any():
        raise ValueError("nothing to fill: no position is hidden")
    return ids, remaining, valid


def _sampling(do_sample, temperature, top_k, top_p, logits_processor, seed, generator, device):
    """The logits processors (``generate()``'s warpers, then the caller's) and the random generator of a call."""
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    processors = make_logits_processor(do_sample, temperature, top_k, top_p)
    processors.extend(logits_processor or [])
    return processors, generator


def _condition_tokens(ids, remaining, valid, tokenizer, config) -> torch.Tensor:
    """(B, T) bool: the condition token (rank 0) of each row."""
    # a row that starts with a visible BOS has its condition token, as every pretraining block had
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    bos = config.bos_token_id if bos is None else bos
    is_condition = torch.zeros_like(remaining)
    if bos is not None:
        is_condition[:, 0] = (ids[:, 0] == bos) & valid[:, 0] & ~remaining[:, 0]
    return is_condition


def _fill_in_steps(model, stream, ids, remaining, valid, is_condition, blocks, processors, *, do_sample, generator,
                   order, confidence_noise, output_logits):
    """Fill the hidden positions block by block, each block in its steps; ``ids`` and ``remaining`` change in place.
    -> ``(commit_step (B, T), forwards run, each forward's logits (B, T, V) with output_logits)``."""
    block_of, num_blocks, steps, schedules = blocks
    mask_token_id = model.config.mask_token_id
    commit_step = torch.zeros_like(ids)
    all_logits, ran = [], 0
    for block, step in ((b, s) for b in range(num_blocks) for s in range(1, steps + 1)):
        in_block = remaining & (block_of == block)
        if not in_block.any():
            continue
        ran += 1
        slots = positions_of(remaining)  # (B, M), -1 pads
        logits = _infill_logits(model, stream, ids, remaining, valid, is_condition, slots)
        if output_logits:
            all_logits.append(_logits_at_positions(logits, slots, ids.shape[1]))
        if mask_token_id is not None:  # a hidden position is never filled with the mask token itself
            logits[..., mask_token_id] = float("-inf")
        context = ids.repeat_interleave(slots.shape[1], 0)  # processors see the row's current sequence
        scores, tokens = process_and_pick(processors, logits.flatten(0, 1), context, do_sample, generator)
        commit = _commit_now(scores, tokens.view_as(slots), slots, in_block, order, confidence_noise, step, steps,
                             schedules[:, block, step - 1 : step], generator)
        rows, at = rows_of(slots)[commit], slots.clamp(min=0)[commit]
        ids[rows, at] = tokens.view_as(slots)[commit]
        remaining[rows, at] = False
        commit_step[rows, at] = ran
    return commit_step, ran, all_logits


def _decoded_text(tokenizer, ids, valid, text_or_ids):
    """The filled rows as text (``None`` without a tokenizer): one string for a string input, else a list."""
    if tokenizer is None:
        return None
    text = [tokenizer.decode(row[v].tolist(), skip_special_tokens=True) for row, v in zip(ids, valid)]
    return text[0] if isinstance(text_or_ids, str) else text  # one string in, one string out


def _check_infill_options(order, block_length, confidence_noise, num_tokens) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if block_length is not None and (isinstance(block_length, bool) or int(block_length) != block_length
                                     or block_length < 1):
        raise ValueError(f"block_length must be a positive integer (hidden positions per block), got {block_length!r}")
    if not confidence_noise >= 0:
        raise ValueError(f"confidence_noise must be >= 0 (a Gumbel temperature), got {confidence_noise!r}")
    if confidence_noise and order != "confidence":
        raise ValueError(f"confidence_noise perturbs order='confidence'; order={order!r} does not read confidence")
    if num_tokens is not None and num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")


def _block_schedules(remaining, block_length, steps, schedule):
    """``(block_of, num_blocks, steps, schedules)``: each hidden position's block (the blocks of ``block_length``
    hidden positions, left to right; one block without), the steps per block (default: one commit per step; never
    more than the most hidden positions of a block) and the commits of each row, block and step ``(B, blocks, S)``."""
    index = remaining.long().cumsum(-1) - 1
    block_of = torch.where(remaining, index // block_length if block_length else torch.zeros_like(index), -1)
    num_blocks = int(block_of.max()) + 1
    counts = torch.stack([(block_of == b).sum(-1) for b in range(num_blocks)], 1)  # (B, blocks)
    max_hidden = int(counts.max())
    steps = max_hidden if steps is None else int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    steps = min(steps, max_hidden)  # a step commits at least one position, so more steps than positions never run
    schedules = torch.tensor(
        [[commit_schedule(int(n), steps, schedule) for n in row] for row in counts.tolist()], device=remaining.device
    )
    return block_of, num_blocks, steps, schedules


def _infill_logits(model, stream, ids, remaining, valid, is_condition, slots):
    """One forward: float logits ``(B, M, V)`` at the hidden positions ``slots`` (``-1`` pads)."""
    backbone, lm_head, config = model.base_model, model.lm_head, model.config
    if stream == "query":
        # the plan masked / GVP pretraining trained: BOS rank 0, visible tokens the next rank (bidirectional
        # among themselves), hidden positions the rank after; hidden content is an invalid key, never read
        out = backbone(
            input_ids=ids, attention_mask=(valid & ~remaining).long(),
            group_ids=infilling_ranks(remaining, is_condition), target_positions=slots,
        )
        return lm_head(out.query_hidden_state).float()
    masked = torch.where(remaining, torch.full_like(ids, config.mask_token_id), ids)
    out = backbone(input_ids=masked, attention_mask=valid.long(), attention_pattern="bidirectional")
    at = slots.clamp(min=0)[..., None].expand(-1, -1, config.hidden_size)
    return lm_head(out.last_hidden_state.gather(1, at)).float()


def _logits_at_positions(logits, slots, seq_len: int) -> torch.Tensor:
    """``(B, M, V)`` logits at ``slots`` -> ``(B, T, V)``, NaN at positions not predicted."""
    is_slot = slots >= 0
    step_logits = logits.new_full((logits.shape[0], seq_len, logits.shape[-1]), float("nan"))
    step_logits[rows_of(slots)[is_slot], slots[is_slot]] = logits[is_slot]
    return step_logits


def _commit_now(scores, tokens, slots, in_block, order, confidence_noise, step, steps, quota, generator):
    """Which of the step's predicted ``slots`` commit: the ``quota`` (B, 1) first of the current block by
    ``order``: most confident (with MaskGIT's annealed noise), at random, or leftmost."""
    batch, width = tokens.shape
    at = slots.clamp(min=0)
    if order == "confidence":
        chosen_prob = torch.softmax(scores.float(), -1).gather(1, tokens.flatten()[:, None]).view(batch, width)
        priority = chosen_prob.clamp(min=1e-30).log()
        if confidence_noise:  # MaskGIT's annealed noise: exploratory early, greedy at the block's last step
            uniform = torch.rand(batch, width, device=tokens.device, generator=generator).clamp(1e-20, 1 - 1e-7)
            priority = priority - confidence_noise * (1 - step / steps) * (-uniform.log()).log()
    elif order == "random":
        priority = torch.rand(batch, width, device=tokens.device, generator=generator)
    else:
        priority = -at.float()  # leftmost first
    eligible = (slots >= 0) & in_block.gather(1, at)  # only the current block commits
    priority = torch.where(eligible, priority, torch.full_like(priority, -math.inf))
    rank_in_step = torch.argsort(torch.argsort(priority, dim=-1, descending=True, stable=True), dim=-1)
    return eligible & (rank_in_step < quota)


def rows_of(slots: torch.Tensor) -> torch.Tensor:
    return torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)


@dataclass
class Infilling(DecodingStrategy):
    """``model.generate(prompt, decoding=Infilling(...), max_new_tokens=n)``: the ``n`` positions after each prompt
    are hidden and filled in any order by :func:`infill` (its ``steps``, ``order``, ``schedule``, ``block_length``,
    ``confidence_noise``, ``stream``); sampling, the logits processors and ``generator`` come from ``generate()``.
    A row keeps its tokens up to its first EOS among the new ones; padding follows."""

    steps: int | None = None
    order: str = "confidence"
    schedule: str = "cosine"
    block_length: int | None = None
    confidence_noise: float = 0.0
    stream: str = "auto"
    _allow_untrained: bool = field(default=False, init=False, repr=False)  # what check() was told

    def check(self, config, allow_untrained: bool = False) -> None:
        _check_infill_options(self.order, self.block_length, self.confidence_noise, None)
        check_infill_objective(config, allow_untrained)
        self._allow_untrained = allow_untrained

    def decode(self, model, input_ids, attention_mask, options):
        if options.output_scores or options.output_logits:
            raise ValueError("output_scores / output_logits: infilling commits positions in any order, not one token "
                             "per step; call hf_lookaround.decoding.infill(..., output_logits=True) for its logits")
        new = options.max_new_tokens
        rows = []
        for ids, mask in zip(input_ids, attention_mask):  # each row unpadded: its BOS is the condition token
            out = infill(model, text_or_ids=ids[mask != 0], num_tokens=new, steps=self.steps, order=self.order,
                         schedule=self.schedule, do_sample=options.do_sample,
                         logits_processor=options.logits_processor, generator=options.generator, add_bos=False,
                         stream=self.stream, allow_untrained=self._allow_untrained,
                         block_length=self.block_length, confidence_noise=self.confidence_noise)
            rows.append(out.sequences[0, -new:])
        tokens = torch.stack(rows)
        tracker = StopTracker(options.stopping_criteria, input_ids.shape[1] + new, len(rows), input_ids.device,
                              options.streamer)
        count, _ = tracker.until_eos(tokens, torch.full_like(tokens[:, 0], new))
        tokens = torch.where(torch.arange(new, device=tokens.device) < count[:, None], tokens, options.pad_token_id)
        sequences = torch.cat([input_ids, tokens], 1)
        tracker.put(tokens[0])
        tracker.end()
        return build_output(options, sequences, None)
