"""What the package's own callers hand a forward beside a user's inputs: its plumbing, in one object.

A user calls a LookAround forward with token ids, masks, a plan (``group_ids``), targets and a cache. The package's
Trainer, collators and decoders also say how the forward runs: masks built outside a compiled step, whether
anything reads the content stream's output, the layout of a training batch. Those travel in
:class:`PreparedInputs` (``forward(..., prepared=PreparedInputs(...))``), so the public signatures keep what a user
passes. A batch may still carry them as keys (a collator's ``row_kind``, the Trainer's ``prepared_attention`` and
``one_stream_layout``, as ``model(**batch)`` passes them): :meth:`PreparedInputs.take` reads them from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["PreparedInputs"]


@dataclass
class PreparedInputs:
    """How a forward runs, beyond the user's inputs.

    attention (`PreparedAttention`, optional): the masks built beforehand by `prepare_attention` from the same batch
        (outside a compiled step, so that no BlockMask is built inside the graph).
    content_output (`bool`, default True): False when nothing reads the content stream's output (a loss on the
        query stream, a decoding step): the last layer then runs the query rows alone.
    row_kind (`(B,)` int, optional): a one-stream mixture batch (a block-causal config, no padding, no cache):
        `BLOCK_CAUSAL_ROW` (0) rows are dar's one-stream form, `BIDIRECTIONAL_ROW` (1) rows BERT's `[MASK]` form
        (`masking_lookaround.mixed_rows_plan`). A training layout: it implies `one_stream_layout`.
    one_stream_layout (`bool`, dar's one-stream form only): the input is in the training layout (start rows,
        groups filling blocks of `t`), not plain token ids.
    revealed_keys (`(B, K)` bool, optional): attention-mask annealing (`pretrain --attention_annealing_steps`): a
        row sees the keys up to its own position, and a later one only where it is revealed (and the plan allows
        it: `masking_lookaround.annealing_allows`). None: the plan's mask alone. Training only (no cache).
    """

    attention: object = None
    content_output: bool = True
    row_kind: torch.LongTensor | None = None
    one_stream_layout: bool = False
    revealed_keys: torch.BoolTensor | None = None

    # the batch keys that name these fields
    BATCH_KEYS = {"prepared_attention": "attention", "content_output": "content_output", "row_kind": "row_kind",
                  "one_stream_layout": "one_stream_layout", "revealed_keys": "revealed_keys"}

    @classmethod
    def take(cls, prepared: PreparedInputs | None, kwargs: dict) -> PreparedInputs:
        """``prepared`` (default: none of it), with the fields a batch carries as keys popped from a forward's
        ``kwargs``."""
        given = {field: kwargs.pop(key) for key, field in cls.BATCH_KEYS.items() if key in kwargs}
        if prepared is None:
            return cls(**given)
        if given:
            raise ValueError(f"pass prepared=PreparedInputs(...) or the batch keys {sorted(given)}, not both")
        return prepared

    def with_content_output(self, content_output: bool) -> PreparedInputs:
        return dataclasses.replace(self, content_output=content_output)
