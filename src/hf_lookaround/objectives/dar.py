"""``dar``: diversity-enhanced autoregressive / semi-autoregressive pretraining (paper (a) Eq. 3 and 6).

The first group has size ``s1 ~ U{1..t}`` and rank 0; then consecutive groups of ``t`` tokens, each predicted
from all earlier groups. ``t = 1`` is AR.

Two forms draw the same plan:

- ``two_stream`` (the papers'): the query row of each target reads the content of the earlier groups.
- ``single_stream`` (SAT: Wang, Zhang and Chen, EMNLP 2018): one row per token. The rows are laid out so that
  every group fills one block of ``t`` consecutive slots; a row sees its own block and every earlier one
  (block-causal attention, ``config.default_attention = "block_causal"``), and the row ``t`` slots before a
  target predicts it: it has seen exactly the groups before the target's. Start rows (copies of BOS) come first:
  one block of ``t`` (the condition, which predicts the first group) and ``t - s1`` more that pad the first text
  group to ``t``. Every run then uses one mask, built once (no padding reaches a target's row).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PlanCollator
from ..models.lookaround.masking_lookaround import one_stream_start_rows as start_rows
from ..plans import Plan, check_lengths, inside_positions
from .base import CAUSAL_HEAD, LOOK_AHEAD, SINGLE_STREAM, TWO_STREAM, Objective, ObjectiveParams, check_form, flag

DEFAULT_T = 2  # paper (a)'s group size


def group_sizes(t) -> list[int]:
    sizes = [t] if isinstance(t, int) else list(t)
    if not sizes or any(not isinstance(s, (int, np.integer)) or int(s) < 1 for s in sizes):
        raise ValueError(f"group size t must be a positive int or a non-empty list of them, got {t!r}")
    return [int(s) for s in sizes]


def ranks(position, s1, size, num_condition_tokens: int = 0):
    """The rank rule: ``g = 1 + (i - s1) // t`` after a first group of ``s1`` tokens at rank 0, for positions
    ``i`` counted after the condition prefix (which has rank 0; the objective's ranks then start at 1).
    Broadcasts over numpy arrays (the plan, the theory module's exact distributions)."""
    return np.where(position < s1, 0, 1 + (position - s1) // size) + (1 if num_condition_tokens else 0)


def plan(lengths, seq_len: int, t=DEFAULT_T, num_condition_tokens: int = 0, generator=None) -> Plan:
    """Diversity-enhanced AR. ``t`` may be a list: a group size is drawn uniformly from it for each sequence
    (a mixture of t values). Targets have rank >= 1."""
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    sizes = group_sizes(t)
    batch, c = lengths.numel(), num_condition_tokens
    if len(sizes) == 1:
        size = torch.full((batch,), sizes[0], dtype=torch.long)
    else:
        size = torch.tensor(sizes)[torch.randint(len(sizes), (batch,), generator=generator)]
    # s1 = 1 + (r mod t) with r uniform on [0, lcm of the sizes): exactly uniform on 1..t for every t
    # of the mixture. Drawn for non-empty rows only, in row order (as the per-row loop drew it).
    drawn = lengths > c
    s1 = torch.ones(batch, dtype=torch.long)
    if drawn.any():
        r = torch.randint(math.lcm(*sizes), (int(drawn.sum()),), generator=generator)
        s1[drawn] = 1 + r % size[drawn]
    rank = ranks(np.arange(seq_len) - c, s1.numpy()[:, None], size.numpy()[:, None], c)
    inside = inside_positions(lengths, seq_len, c)
    return Plan(torch.from_numpy(np.where(inside, rank, 0)), torch.from_numpy(inside & (rank >= 1)))


def exact_plans(n: int, num_condition_tokens: int = 0, t=DEFAULT_T) -> list:
    """Every plan of a sequence of ``n`` tokens with its probability: ``t`` uniform over the list, then
    ``s1 ~ U{1..t}`` (the theory module's enumeration)."""
    c, sizes = num_condition_tokens, group_sizes(t)
    after_prefix = np.arange(n) >= c
    plans = []
    for size in sizes:
        for s1 in range(1, size + 1):
            rank = np.zeros(n, dtype=np.int64)
            rank[c:] = ranks(np.arange(n - c), s1, size, c)
            plans.append((1.0 / len(sizes) / size, rank, after_prefix & (rank >= 1)))
    return plans


@dataclass
class Params(ObjectiveParams):
    SPEC = "dar:T, dar:T1,T2"

    group_size: list[int] = flag(default_factory=lambda: [DEFAULT_T], help="dar: group size t, or several (a mixture)",
                                 aliases=["--group_sizes"])
    dar_form: str = flag(
        TWO_STREAM,
        help="dar: two_stream (the query stream predicts each group from the earlier ones; the papers' form) or "
             "single_stream (SAT: block-causal attention, the row t places before a token predicts it; one row per "
             "token, LookAroundForCausalLM; one group size only)")

    def __post_init__(self):
        try:
            sizes = group_sizes(list(self.group_size))
        except (TypeError, ValueError):
            raise ValueError(f"--group_size must be one or more positive integers, got {self.group_size!r}") from None
        check_form("dar_form", self.dar_form)
        if self.dar_form == SINGLE_STREAM and len(sizes) > 1:
            # a row of this form does not know which t it predicts for (the two-stream query row carries its
            # target's position); a learned group-size embedding would change the architecture for one flag
            raise ValueError(f"--dar_form single_stream takes one group size, got --group_size {sizes}: a row of "
                             "this form predicts the token t places ahead and cannot tell which t a sequence drew; "
                             "train several group sizes with --dar_form two_stream")

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        return cls(group_size=[int(x) for x in arg.split(",")] if arg else [DEFAULT_T])

    def plan_params(self) -> dict:
        sizes = group_sizes(list(self.group_size))
        return {"t": sizes[0] if len(sizes) == 1 else sizes}

    def collator_params(self) -> dict:
        return {"group_size": self.plan_params()["t"], "form": self.dar_form}

    @classmethod
    def decoding_group_sizes(cls, plan_params: dict) -> tuple[int, ...]:
        return tuple(group_sizes(plan_params.get("t", DEFAULT_T)))

    def config_fields(self) -> dict:
        if self.dar_form != SINGLE_STREAM:
            return super().config_fields()
        return {**super().config_fields(), "default_attention": "block_causal",
                "attention_group_size": self.plan_params()["t"]}

    def input_width(self, block_size: int) -> int:
        t = self.plan_params()["t"]
        return block_size + start_rows(t, 1) if self.dar_form == SINGLE_STREAM else block_size

    @property
    def form(self) -> str:
        return self.dar_form

    def check_block_size(self, block_size: int) -> None:
        """A group larger than a block's predictable tokens (block_size - 1, after BOS) cannot be formed."""
        if max(self.group_size) > block_size - 1:
            raise ValueError(
                f"--group_size {max(self.group_size)} is larger than a block's {block_size - 1} predicted tokens "
                f"(--block_size {block_size} minus BOS): use a group size <= {block_size - 1} or a larger --block_size"
            )


def one_stream_layout(input_ids: np.ndarray, is_target: np.ndarray, s1: np.ndarray, t: int, bos: int, pad: int):
    """The one-stream form of a batch: ``(inputs, labels)``, both ``(B, T + 2t - 2)``.

    ``input_ids`` ``(B, T)`` rows that start with BOS; ``s1`` ``(B,)`` the size of each row's first text group;
    ``is_target`` ``(B, T)`` the positions that carry a loss. Row ``b`` is shifted right by
    ``start_rows(t, s1[b])`` BOS copies, so its groups fill blocks of ``t`` slots; the label of the token at slot
    ``j`` goes to ``labels[:, j - t + 1]``: with transformers' shift inside the causal LM's loss, the row at slot
    ``j - t`` (one block earlier) predicts it. Slots past a row's end hold ``pad``: only rows of the last blocks,
    which predict nothing, can see them. The numpy copy of the model bundle's layout
    (``layout_lookaround.one_stream_rows``), kept for the collator's speed; tests/test_one_stream_layout.py checks
    them equal."""
    batch, length = input_ids.shape
    width = length + start_rows(t, 1)
    shift = start_rows(t, np.clip(s1, 1, t))
    inputs = np.full((batch, width), pad, dtype=np.int64)
    columns = np.arange(length)[None, :] + shift[:, None]
    rows = np.arange(batch)[:, None]
    inputs[np.arange(width)[None, :] < shift[:, None]] = bos
    inputs[rows, columns] = input_ids
    labels = np.full((batch, width), -100, dtype=np.int64)
    b, p = np.nonzero(is_target)
    labels[b, p + shift[b] - t + 1] = input_ids[b, p]
    return inputs, labels


@dataclass
class SemiAutoregressiveCollator(PlanCollator):
    """Diversity-enhanced (semi-)autoregressive, paper (a) Eq. 3 and 6.

    ``group_size`` is ``t`` (the paper uses 2), or a list of values: ``t`` is then drawn uniformly
    from it for each sequence (a mixture). The first group size ``s1 ~ U{1..t}`` is drawn per sequence.

    ``form="two_stream"`` (default): the plan's batch for ``LookAroundForPreTraining``. ``form="single_stream"``:
    the same plan in SAT's one-stream form (:func:`one_stream_layout`) for ``LookAroundForCausalLM`` with
    ``default_attention="block_causal"``: ``input_ids`` and ``labels`` of width ``T + 2t - 2``, no attention mask
    (the block-causal mask is the same for every batch), one group size.
    """

    group_size: int | Sequence[int] = DEFAULT_T
    form: str = TWO_STREAM
    objective = "dar"
    plan_function = staticmethod(plan)

    def __post_init__(self):
        sizes = [self.group_size] if isinstance(self.group_size, int) else list(self.group_size)
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"group_size must be a positive int or a non-empty list of them, got {self.group_size!r}")
        check_form("form", self.form)
        if self.form == SINGLE_STREAM and len(sizes) > 1:
            raise ValueError(f"the single-stream form takes one group size, got {sizes}")

    def plan_params(self):
        t = self.group_size if isinstance(self.group_size, int) else list(self.group_size)
        return {"t": t}

    def _finish(self, input_ids, attention_mask, plan, generator):
        if self.form == TWO_STREAM:
            return super()._finish(input_ids, attention_mask, plan, generator)
        (t,) = group_sizes(self.group_size)  # one size: __post_init__ refuses several for this form
        bos = getattr(self.tokenizer, "bos_token_id", None)
        lengths = attention_mask.numpy().sum(1)
        if bos is None or (input_ids.numpy()[lengths > 0, 0] != bos).any():
            raise ValueError("dar's single-stream form needs every row to start with the BOS token (its start rows "
                             "are copies of it): pack blocks with BOS (hf-lookaround pretrain does) or use "
                             "form='two_stream'")
        group_ids = plan.group_ids.numpy()
        s1 = (group_ids == 1).sum(1)  # the first text group (rank 1 after BOS)
        inputs, labels = one_stream_layout(input_ids.numpy(), plan.is_target.numpy(), s1, t, bos, self._pad_id())
        return {"input_ids": torch.from_numpy(inputs), "labels": torch.from_numpy(labels)}


OBJECTIVE = Objective(
    name="dar",
    family=LOOK_AHEAD,
    title="diversity-enhanced autoregressive / semi-autoregressive (DAR)",
    card_text="the first group, of size `s1 ~ U{1..t}`, has rank 0; then consecutive groups of `t` tokens: "
              "`g[i] = 1 + (i - s1) // t`; a group is predicted from all earlier groups (paper (a) Eq. 3 and 6).",
    Params=Params,
    plan=plan,
    collator=SemiAutoregressiveCollator,
    presets={"dar-t2": ("diversity-enhanced AR, t=2", {"group_size": [2]}),
             "dar-t2-1s": ("diversity-enhanced AR, t=2, one stream (SAT)", {"group_size": [2],
                                                                           "dar_form": SINGLE_STREAM})},
    single_stream_head=CAUSAL_HEAD,
    exact_plans=exact_plans,
)
