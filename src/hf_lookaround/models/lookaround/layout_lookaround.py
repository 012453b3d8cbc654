"""Where tokens sit in a decoding forward: the ranks of a semi-AR plan over prompt + continuation, and dar's
one-stream layout (start rows, groups that fill blocks of ``t`` slots) of a prompt and of the next-token view.
Beside the masks (``masking_lookaround``), which turn these ranks into attention."""

from __future__ import annotations

import torch

from .masking_lookaround import one_stream_start_rows

__all__ = ["semi_ar_ranks", "first_group_opening", "one_stream_rows", "one_stream_prompt",
           "one_stream_next_token_layouts"]


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


def first_group_opening(k, group_size: int):
    """The rule of dar's one-stream layout: the first-group size ``s1`` for which token ``k`` of a sequence (BOS at
    ``k = 0``, text from ``k = 1``) opens a group, ``(k - 2) mod t + 1``. Groups open at ``k = 1 + s1 + m t``, so the
    row that predicts token ``k`` (``t`` slots before it) has seen every earlier token exactly then."""
    return torch.remainder(k - 2, group_size) + 1


def one_stream_rows(input_ids, first_real, first_group_size, group_size: int, bos: int, pad: int, lead=0,
                    right_aligned: bool = False):
    """dar's one-stream layout: the rows of these tokens for first-group size ``s1``, ``(ids, before, start)``.

    Row ``b``'s sequence is ``input_ids[b]`` from column ``first_real[b]`` on (``(B, 1)``), its BOS first, or a
    BOS put in front where ``lead[b]`` is 1. :func:`one_stream_start_rows` BOS copies (for ``first_group_size``
    ``s1``, ``(..., B, 1)``: several layouts at once) come before it, so that every group fills a block of ``t``
    slots. Column ``c`` sits at slot ``c + before``; ``start`` is the slot of the first start row. Rows start
    together at slot 0, or with ``right_aligned`` end together at the last slot (a prompt, left-padded); slots
    outside a row hold ``pad``. Every consumer of the layout (the decoder's prompt, the causal LM's next-token view,
    perplexity through it) lays rows out here; the collator's numpy copy (``objectives/dar.py``) is checked equal."""
    length, device = input_ids.shape[-1], input_ids.device
    opening = one_stream_start_rows(group_size, first_group_size) + lead  # BOS slots before the first real column
    if right_aligned:  # the last column at the last slot
        width = int((opening + length - first_real).max())
        before = torch.full_like(opening + first_real, width - length)
    else:  # the first start row at slot 0
        before = opening - first_real
        width = length + int(before.max())
    slot = torch.arange(width, device=device)
    source = slot - before  # the column each slot holds
    start = first_real + before - opening
    tokens = input_ids.expand(*source.shape[:-1], length).gather(-1, source.clamp(0, length - 1))
    ids = torch.where((source >= first_real) & (source < length), tokens,
                      torch.where((slot >= start) & (source < first_real), bos, pad))
    return ids, before, start


def one_stream_prompt(input_ids, attention_mask, group_size: int, bos: int, pad: int):
    """A left-padded prompt in dar's one-stream layout: ``(ids, mask, positions)``, ``(B, U)`` with ``U`` a multiple
    of ``t``. Groups of ``t`` tokens end where each prompt ends: the token after it opens a group
    (:func:`first_group_opening`), which sets ``s1``; :func:`one_stream_rows` lays the rows out, right-aligned, so
    the prompt's last ``t`` rows predict the next group. Rows are left-padded by whole blocks."""
    real = (attention_mask != 0).long().sum(-1, keepdim=True)  # BOS and the text
    first_group = first_group_opening(real, group_size)
    ids, _, start = one_stream_rows(input_ids, input_ids.shape[1] - real, first_group, group_size, bos, pad,
                                    right_aligned=True)
    slot = torch.arange(ids.shape[1], device=input_ids.device)
    return ids, (slot >= start).long(), (slot - start).clamp(min=0)


def one_stream_next_token_layouts(input_ids, attention_mask, group_size: int, bos: int, pad: int):
    """Plain token ids ``(B, T)`` in dar's one-stream layouts, for the next-token (causal) view: ``(layouts, rows)``.

    A row predicts the token ``t`` slots after it, and it has seen every earlier token only when that token opens
    a group (:func:`first_group_opening`). So each row is laid out ``t`` times, once per ``s1`` in ``1..t``
    (:func:`one_stream_rows`, with a BOS in front if it does not start with one: the start rows are its copies,
    as in training). ``layouts`` ``(t * B, W)`` stacks them in the batch dimension, layout ``s1 - 1`` first;
    position ids are the slot indices, as in training. ``rows`` ``(B, T)`` indexes the flattened ``(t * B * W)``
    rows: the one whose state predicts ``input_ids[:, i + 1]`` (past the input, the next token).
    ``attention_mask`` (or None) marks the real tokens, one run per row (left or right padding); a padding
    column's row is a real one."""
    t, device = group_size, input_ids.device
    batch, length = input_ids.shape
    columns = torch.arange(length, device=device)
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    start = torch.where(real.any(-1), real.long().argmax(-1), 0)[:, None]  # (B, 1): the first real column
    lead = (input_ids.gather(1, start) != bos).long()  # 1: a BOS goes in front of the row
    first_group = torch.arange(1, t + 1, device=device)[:, None, None]  # (t, 1, 1): s1 of each layout
    layouts, before, _ = one_stream_rows(input_ids, start, first_group, t, bos, pad, lead=lead)  # (t, B, W)
    # the token after column i is k = i + 1 - start + lead of its sequence; its layout and its predicting row
    k = (columns + 1 - start + lead).clamp(min=1)  # (B, T); padding columns before the row get any valid row
    layout = first_group_opening(k, t) - 1
    sequence = torch.arange(batch, device=device)[:, None]
    slot = (columns + 1 + before[layout, sequence, 0] - t).clamp(min=0)  # (B, T): its slot, less t
    rows = (layout * batch + sequence) * layouts.shape[-1] + slot
    return layouts.reshape(t * batch, -1), rows
