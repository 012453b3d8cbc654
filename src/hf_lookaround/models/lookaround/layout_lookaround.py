"""Where tokens sit in a decoding forward: the ranks of a semi-AR plan over prompt + continuation, and dar's
one-stream layout (start rows, groups that fill blocks of ``t`` slots) of a prompt and of the next-token view.
Beside the masks (``masking_lookaround``), which turn these ranks into attention."""

from __future__ import annotations

import torch

from .masking_lookaround import one_stream_start_rows

__all__ = ["semi_ar_ranks", "one_stream_prompt", "one_stream_next_token_layouts"]


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
