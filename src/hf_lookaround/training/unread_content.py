"""A Trainer batch transform: leave out the content rows that no prediction reads (``--drop_unread_content``)."""

from __future__ import annotations

import numpy as np
import torch

from ..models.lookaround.modeling_lookaround import NO_TARGET_RANK
from ..plans import host_positions_of

__all__ = ["DropUnreadContent", "drop_unread_content"]


def drop_unread_content(batch: dict, content_width: int | None = None, width_multiple: int | None = None,
                        min_width: int | None = None) -> dict:
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
    `min_width`: without a fixed width, never narrower than this (the objective's bound on the rows it keeps: every
    batch of a run then has this width and a compiled step one graph; a batch that keeps more, e.g. one full of
    special tokens that are never masked, is widened as `width_multiple` says, never cut).
    """
    # on the host, in numpy: a data loader calls this for every batch, and numpy's calls cost a fraction of torch's
    device = batch["input_ids"].device
    input_ids, group_ids, labels = (_host(batch[key]) for key in ("input_ids", "group_ids", "labels"))
    attention_mask = batch.get("attention_mask")
    valid = np.ones(input_ids.shape, dtype=bool) if attention_mask is None else _host(attention_mask) != 0
    top_rank = np.where(valid, group_ids, -1).max(-1, keepdims=True, initial=-1)
    keep = valid & (group_ids < top_rank)
    needed = int(keep.sum(-1).max()) if keep.size else 0
    width = needed if content_width is None else content_width
    if content_width is None and min_width and needed <= min_width:
        width = min(min_width, input_ids.shape[1])
    elif content_width is None and width_multiple:
        width = min(-(-needed // width_multiple) * width_multiple, input_ids.shape[1])
    if width < needed:
        raise ValueError(f"content_width={content_width} is smaller than the {needed} content rows a sequence of this "
                         "batch keeps; raise it (nothing is dropped for you)")
    kept = host_positions_of(keep, width)  # (B, W) original indices, -1 pads
    is_pad, at = kept < 0, np.maximum(kept, 0)
    targets = batch.get("target_positions")
    targets = host_positions_of(labels != -100) if targets is None else _host(targets)
    is_empty, target_at = targets < 0, np.maximum(targets, 0)
    # gathers along the rows as flat indices into the (B * T) values: several times faster than take_along_axis
    row_starts = input_ids.shape[1] * np.arange(input_ids.shape[0])[:, None]
    content, query = at + row_starts, target_at + row_starts
    positions = batch.get("position_ids")
    if positions is None:  # positions are the indices themselves: nothing to gather
        content_positions, query_positions = np.where(is_pad, 0, at), target_at
    else:
        positions = np.broadcast_to(_host(positions), input_ids.shape).reshape(-1)
        content_positions = np.where(is_pad, 0, positions[content])
        query_positions = np.where(is_empty, 0, positions[query])
    input_ids, group_ids, labels = input_ids.reshape(-1), group_ids.reshape(-1), labels.reshape(-1)
    compact = dict(
        input_ids=input_ids[content],
        attention_mask=(~is_pad).astype(np.int64),
        group_ids=np.where(is_pad, 0, group_ids[content]),
        position_ids=content_positions,
        query_position_ids=query_positions,
        query_group_ids=np.where(is_empty, NO_TARGET_RANK, group_ids[query]),
        query_target_ids=np.where(is_empty, -100, labels[query]),
    )
    if "loss_weights" in batch:  # the diffusion objectives' weight per target, now per query row
        compact["loss_weights"] = np.where(is_empty, 0.0, _host(batch["loss_weights"]).reshape(-1)[query])
    return {key: torch.from_numpy(np.ascontiguousarray(value)).to(device) for key, value in compact.items()}


def _host(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy()


class DropUnreadContent:
    """A collator whose batches leave out the content rows no prediction reads (:func:`drop_unread_content`).

    The batch is compacted on the host, in the data loader (in its workers on a GPU): the training step then neither
    compacts it nor waits for the device to say how wide it is. ``width_multiple`` rounds each batch's width up
    (a compiled step then sees a few widths, one static graph each). Other attributes (``set_epoch``, ...) are the
    wrapped collator's."""

    def __init__(self, collator, width_multiple: int | None = None, min_width: int | None = None):
        self.collator = collator
        self.width_multiple = width_multiple
        self.min_width = min_width

    def __call__(self, features):
        return drop_unread_content(self.collator(features), width_multiple=self.width_multiple,
                                   min_width=self.min_width)

    def __getattr__(self, name):
        if name == "collator":  # not set yet (unpickling in a worker): no recursion
            raise AttributeError(name)
        return getattr(self.collator, name)
