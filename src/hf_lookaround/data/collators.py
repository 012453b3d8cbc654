"""Data collators: the base every objective's collator builds on (each objective module of
:mod:`hf_lookaround.objectives` defines its own), a thin wrapper that pads a batch and draws its plan.

Written in the style of transformers' ``DataCollatorForLanguageModeling``: dataclasses that take
the list of feature dicts ``Trainer`` hands them (``input_ids`` of any length, optional
``attention_mask``), pad on the right with the tokenizer's pad id, and return tensors.

Every collator emits

- ``input_ids`` (B, T) and ``attention_mask`` (B, T);
- ``group_ids`` (B, T): the plan's group rank per token (two-stream forms);
- ``labels`` (B, T): the original token where there is a loss, ``-100`` elsewhere;
- ``target_positions`` (B, M): indices of the loss positions, padded with ``-1``. Set
  ``pad_targets_to`` to a fixed ``M`` (e.g. ``ceil(max_ratio * T)``) so that ``torch.compile``
  sees static shapes;
- ``loss_weights`` (B, T), only where the plan weighs its targets (the diffusion objectives, ``mdlm`` and
  ``bd3lm``): the weight of each label in the loss.

Plans are drawn ONLY through :mod:`hf_lookaround.plans`, so an objective means the same thing
here as in the evaluators and the theory module.

Randomness. Each collator owns a ``torch.Generator`` created lazily in the process that calls it
(``seed + worker id`` inside a DataLoader worker, as transformers does). By default
(``per_batch_seed=True``) the generator is re-seeded before every batch from a hash of
``(seed, epoch, process rank, batch content)``. A batch's plan then depends only on which examples
it holds and on which process draws it, not on how many batches this process has drawn before: a
run resumed from a checkpoint (where ``Trainer`` skips the already-seen batches without collating
them) draws exactly the plans of an uninterrupted run, whatever ``dataloader_num_workers`` is, as
long as the number of processes is the same. The process rank (``torch.distributed``'s rank when
it is initialised, else ``$RANK``, else 0; or ``process_rank`` if given) makes every rank of a
multi-process run draw its own plans: two ranks never repeat the same masks, even on identical
content. ``set_epoch`` (called by :class:`hf_lookaround.training.pretraining.CollatorEpochCallback`) makes
a repeated batch in a later epoch get a fresh plan; the epoch is held in shared memory, so that
persistent DataLoader workers see it too. With ``per_batch_seed=False`` the generator is
a plain stream seeded from ``(seed, rank, worker id)`` (reproducible for one uninterrupted run only).
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from .. import plans

__all__ = [
    "PlanCollator",
    "MASKED_FORMS",
    "labels_for",
    "current_process_rank",
]

MASKED_FORMS = ("two_stream", "single_stream")
PATCH_KEYS = ("pixel_values", "inputs_embeds")


@dataclass
class PlanCollator:
    """Pads a batch and draws the plan of ``objective``; subclasses only supply the plan's parameters.

    Args:
        tokenizer: gives the pad id (right padding) and the special ids that are never masked.
            May be ``None`` for batches of patch features (GVP on images).
        pad_to_multiple_of: pad ``T`` up to a multiple of this.
        pad_targets_to: a fixed width ``M`` for ``target_positions`` (static shapes for compile).
        num_condition_tokens: a prefix of rank 0 that is never a target. ``None`` (default): 1 when
            every row starts with the tokenizer's BOS or CLS token, else 0.
        seed: seed of the collator's generator.
        per_batch_seed: re-seed before each batch from ``(seed, epoch, rank, batch content)`` (see module doc).
        process_rank: the rank mixed into the seed; ``None`` (default): the ``torch.distributed`` rank
            of the process that collates (see :func:`current_process_rank`).
    """

    tokenizer: Any = None
    pad_to_multiple_of: int | None = None
    pad_targets_to: int | None = None
    num_condition_tokens: int | None = None
    seed: int = 0
    per_batch_seed: bool = True
    process_rank: int | None = None
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _epoch: torch.Tensor | None = field(default=None, init=False, repr=False)

    objective: ClassVar[str] = ""
    # the objective's plan function (its module's ``plan``), named by each objective's collator: the collators sit
    # below the objectives table, so they draw through the function itself, not by name
    plan_function: ClassVar[Callable[..., plans.Plan]]

    # ----------------------------------------------------------------------------- plan hooks
    def plan_params(self) -> dict[str, Any]:
        """Keyword arguments of the plan function (besides lengths and condition tokens)."""
        return {}

    def uses_maskable(self) -> bool:
        return False

    # ----------------------------------------------------------------------------- randomness
    @property
    def epoch(self) -> int:
        return 0 if self._epoch is None else int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        # The epoch lives in shared memory: DataLoader workers hold a copy of the collator, and persistent
        # workers (created once, in the first epoch) must still see each new epoch. Trainer calls this
        # before the epoch's first batch is requested, and workers collate only batches they are asked for.
        if self._epoch is None:
            self._epoch = torch.zeros((), dtype=torch.long).share_memory_()
        self._epoch.fill_(int(epoch))

    def _worker_generator(self) -> torch.Generator:
        # Created lazily, in the process that collates: inside a DataLoader worker the seed is
        # seed + worker id, so that workers do not draw identical streams.
        if self._generator is None:
            info = torch.utils.data.get_worker_info()
            # ranks and workers get disjoint seeds (a worker id stays far below 2**20)
            worker = (info.id if info is not None else 0) + (self._rank() << 20)
            self._generator = torch.Generator().manual_seed(self.seed + worker)
        return self._generator

    def _rank(self) -> int:
        return current_process_rank() if self.process_rank is None else int(self.process_rank)

    def _batch_generator(self, content: torch.Tensor, lengths: torch.Tensor) -> torch.Generator:
        generator = self._worker_generator()
        if self.per_batch_seed:
            digest = hashlib.sha256()  # x86 CPUs hash SHA-256 in hardware: twice as fast as BLAKE2b here
            digest.update(f"{self.seed}|{self.epoch}|{self._rank()}|{self.objective}|".encode())
            digest.update(lengths.numpy().tobytes())
            digest.update(memoryview(content.contiguous().numpy()))  # the same bytes as tobytes(), uncopied
            generator.manual_seed(int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1))
        return generator

    # ----------------------------------------------------------------------------- padding
    def _pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            raise ValueError(
                "the tokenizer has no pad token; set one (e.g. tokenizer.pad_token = tokenizer.eos_token) "
                "or use a tokenizer from `hf-lookaround train-tokenizer`, which defines [PAD]"
            )
        return int(pad)

    def _special_ids(self) -> list[int]:
        names = ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id")
        ids = {getattr(self.tokenizer, name, None) for name in names}
        return sorted(int(i) for i in ids if i is not None)

    def _pad_tokens(self, features) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__} needs a tokenizer to pad token ids")
        stacked = _stack_full_rows(features)
        if stacked is not None and padded_width(stacked.shape[1], self.pad_to_multiple_of) == stacked.shape[1]:
            return torch.from_numpy(stacked), torch.from_numpy(np.ones(stacked.shape, dtype=np.int64))
        # numpy reads a list of Python ints several times faster than torch.as_tensor does
        rows, masks = [], []
        for f in features:
            ids = _int64_row(f["input_ids"] if isinstance(f, Mapping) else f)
            mask = f.get("attention_mask") if isinstance(f, Mapping) else None
            if mask is not None:
                mask = _int64_row(mask)
                if mask.size != ids.size:
                    raise ValueError("attention_mask and input_ids of an example have different lengths")
            rows.append(ids)
            masks.append(mask)
        width = padded_width(max(r.size for r in rows), self.pad_to_multiple_of)
        input_ids = np.full((len(rows), width), self._pad_id(), dtype=np.int64)
        attention_mask = np.zeros((len(rows), width), dtype=np.int64)
        for b, (ids, mask) in enumerate(zip(rows, masks)):
            input_ids[b, : ids.size] = ids
            attention_mask[b, : ids.size] = 1 if mask is None else mask
        if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
            raise ValueError("collators expect right padding: attention_mask must be 1...1 0...0 in every row")
        return torch.from_numpy(input_ids), torch.from_numpy(attention_mask)

    def _condition_tokens(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> int:
        if self.num_condition_tokens is not None:
            return int(self.num_condition_tokens)
        starts = {getattr(self.tokenizer, n, None) for n in ("bos_token_id", "cls_token_id")} - {None}
        if not starts or (lengths < 1).any():
            return 0
        return int(set(input_ids[:, 0].tolist()) <= starts)

    # ----------------------------------------------------------------------------- call
    def __call__(self, features) -> dict[str, torch.Tensor]:
        if features is None or len(features) == 0:
            raise ValueError("cannot collate an empty batch")
        input_ids, attention_mask = self._pad_tokens(features)
        lengths = torch.from_numpy(attention_mask.numpy().sum(-1))
        generator = self._batch_generator(input_ids, lengths)
        plan = self._draw(input_ids, lengths, generator)
        return self._finish(input_ids, attention_mask, plan, generator)

    def _draw(self, input_ids: torch.Tensor, lengths: torch.Tensor, generator) -> plans.Plan:
        params = dict(self.plan_params())
        params["num_condition_tokens"] = self._condition_tokens(input_ids, lengths)
        if self.uses_maskable():
            params["maskable"] = self._maskable(input_ids, lengths)
        return self.plan_function(lengths, input_ids.shape[1], generator=generator, **params)

    def _maskable(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        # special tokens (bos/eos/pad/cls/sep/mask) are never masked, nor padding; numpy: less overhead per call,
        # and its table lookup is several times faster than torch.isin or one comparison per special id
        inside = np.arange(input_ids.shape[1])[None, :] < lengths.numpy()[:, None]
        special = np.isin(input_ids.numpy(), np.asarray(self._special_ids(), dtype=np.int64), kind="table")
        return torch.from_numpy(inside & ~special)

    def _finish(self, input_ids, attention_mask, plan: plans.Plan, generator) -> dict[str, torch.Tensor]:
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "group_ids": plan.group_ids,
            "labels": labels_for(input_ids, plan.is_target),
            "target_positions": plan.target_positions(self.pad_targets_to),
        }
        if plan.loss_weights is not None:  # a weight per target (the diffusion objectives)
            batch["loss_weights"] = plan.loss_weights
        return batch


def current_process_rank() -> int:
    """The rank of this process: ``torch.distributed``'s when initialised, else ``$RANK`` (set by torchrun
    and accelerate, and inherited by DataLoader workers), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", 0))


def _int64_row(values) -> np.ndarray:
    """One example's ids (or mask) as a flat int64 array: a list, a numpy array or a tensor."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def labels_for(input_ids: torch.Tensor, is_target: torch.Tensor) -> torch.Tensor:
    """The token where there is a loss, -100 (ignored) elsewhere (in numpy: single-threaded, see plans.py)."""
    return torch.from_numpy(np.where(is_target.numpy(), input_ids.numpy(), -100))


def _stack_full_rows(features) -> np.ndarray | None:
    """The batch as one (B, T) int64 array when every example is a dict holding only ``input_ids`` of one length,
    as numpy arrays (the blocks ``pretrain`` hands its collator): no padding to do. Else ``None``."""
    first = features[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("input_ids"), np.ndarray):
        return None
    width = first["input_ids"].shape
    rows = []
    for f in features:
        ids = f.get("input_ids") if isinstance(f, Mapping) else None
        if not isinstance(ids, np.ndarray) or ids.shape != width or ids.ndim != 1 or f.get("attention_mask") is not None:
            return None
        rows.append(ids)
    return np.stack(rows).astype(np.int64, copy=False)


def padded_width(width: int, multiple: int | None) -> int:
    if multiple:
        width = int(math.ceil(width / multiple) * multiple)
    return width
