"""A Trainer batch transform: leave out the content rows that no prediction reads (``--drop_unread_content``)."""

from __future__ import annotations

import torch

from ..models.lookaround.modeling_lookaround import NO_TARGET_RANK, positions_of

__all__ = ["DropUnreadContent", "drop_unread_content"]


def drop_unread_content(batch: dict, content_width: int | None = None, width_multiple: int | None = None) -> dict:
    """An equivalent two-stream batch without the content rows that no prediction reads.

    A query row of rank r reads content of rank < r, and a content row of rank r reads content of rank <= r; so the
    content rows of each sequence's highest rank (the masked tokens of a masked plan, the last group of GVP) and
    padding feed nothing that reaches a prediction. The new batch keeps the other content rows, compacted to
    `content_width` columns (default: the largest count in the batch) with their original positions, and gives the
    query rows explicitly at the targets (`query_position_ids`, `query_group_ids`, `query_target_ids`), so that
    `LookAroundForPreTraining(**new_batch)` has the loss and gradients of the full batch (MAE's encoder, which sees
    the visible tokens only, is the masked case). Takes a collator's batch (`input_ids`, `attention_mask`,
    `group_ids`, `labels`, optionally `target_positions`, `position_ids`); call it outside a compiled step: it
    checks on the host that `content_width` holds every sequence's kept rows (a fixed width keeps shapes static).
    `width_multiple`: without a fixed width, round the batch's width up to a multiple of this, so that a compiled
    step sees a few shapes only (GVP, whose top group ranges from one token to most of the sequence).
    """
    input_ids, group_ids, labels = batch["input_ids"], batch["group_ids"], batch["labels"]
    attention_mask = batch.get("attention_mask")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    top_rank = torch.where(valid, group_ids, -1).amax(-1, keepdim=True)
    keep = valid & (group_ids < top_rank)
    needed = int(keep.sum(-1).max()) if keep.numel() else 0
    width = needed if content_width is None else content_width
    if content_width is None and width_multiple:
        width = min(-(-needed // width_multiple) * width_multiple, input_ids.shape[1])
    if width < needed:
        raise ValueError(f"content_width={content_width} is smaller than the {needed} content rows a sequence of this "
                         "batch keeps; raise it (nothing is dropped for you)")
    kept = positions_of(keep, width)  # (B, W) original indices, -1 pads
    is_pad, at = kept < 0, kept.clamp(min=0)
    targets = batch.get("target_positions")
    if targets is None:
        targets = positions_of(labels != -100)
    is_empty, target_at = targets < 0, targets.clamp(min=0)
    positions = batch.get("position_ids")
    if positions is None:  # positions are the indices themselves: nothing to gather
        content_positions, query_positions = at.masked_fill(is_pad, 0), target_at
    else:
        positions = positions.expand_as(input_ids)
        content_positions = positions.gather(1, at).masked_fill_(is_pad, 0)
        query_positions = positions.gather(1, target_at).masked_fill_(is_empty, 0)
    return dict(
        input_ids=input_ids.gather(1, at),
        attention_mask=(~is_pad).long(),
        group_ids=group_ids.gather(1, at).masked_fill_(is_pad, 0),
        position_ids=content_positions,
        query_position_ids=query_positions,
        query_group_ids=group_ids.gather(1, target_at).masked_fill_(is_empty, NO_TARGET_RANK),
        query_target_ids=labels.gather(1, target_at).masked_fill_(is_empty, -100),
    )


class DropUnreadContent:
    """A collator whose batches leave out the content rows no prediction reads (:func:`drop_unread_content`).

    The batch is compacted on the host, in the data loader (in its workers on a GPU): the training step then neither
    compacts it nor waits for the device to say how wide it is. ``width_multiple`` rounds each batch's width up
    (a compiled step then sees a few widths, one static graph each). Other attributes (``set_epoch``, ...) are the
    wrapped collator's."""

    def __init__(self, collator, width_multiple: int | None = None):
        self.collator = collator
        self.width_multiple = width_multiple

    def __call__(self, features):
        return drop_unread_content(self.collator(features), width_multiple=self.width_multiple)

    def __getattr__(self, name):
        if name == "collator":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.collator, name)
