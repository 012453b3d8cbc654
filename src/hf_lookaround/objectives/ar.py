"""``ar``: GPT's objective, ``g[i] = i``; every token after the condition prefix is predicted from those before it."""

from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PlanCollator, labels_for
from ..plans import Plan, check_lengths, inside_positions
from .base import CAUSAL_HEAD, LOOK_AHEAD, TWO_STREAM, Objective, ObjectiveParams, check_form, flag


def plan(lengths, seq_len: int, num_condition_tokens: int = 0, generator=None) -> Plan:
    """GPT: ``g[i] = i``; every position with rank >= 1 is a target (so ``i >= 1`` with no prefix)."""
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    c = num_condition_tokens
    inside = inside_positions(lengths, seq_len, c)
    ranks = np.arange(seq_len) - c + (1 if c else 0)
    return Plan(torch.from_numpy(np.where(inside, ranks, 0)), torch.from_numpy(inside & (ranks >= 1)))


def exact_plans(n: int, num_condition_tokens: int = 0) -> list:
    """The one plan of a sequence of ``n`` tokens, with probability 1 (the theory module's enumeration)."""
    c = num_condition_tokens
    ranks = np.zeros(n, dtype=np.int64)
    ranks[c:] = np.arange(n - c) + (1 if c else 0)
    return [(1.0, ranks, (np.arange(n) >= c) & (ranks >= 1))]


@dataclass
class Params(ObjectiveParams):
    SPEC = "ar"

    ar_form: str = flag(
        TWO_STREAM,
        help="ar: two_stream (the query stream predicts, as for every objective here) or single_stream (GPT: the "
             "causal content stream predicts the next token; LookAroundForCausalLM, one stream of work per token)")

    def __post_init__(self):
        check_form("ar_form", self.ar_form)

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        if arg:
            raise ValueError(f"ar takes no parameter, got {arg!r}")
        return cls()

    def collator_params(self) -> dict:
        return {"form": self.ar_form}

    @classmethod
    def decoding_group_sizes(cls, plan_params: dict) -> tuple[int, ...]:
        return (1,)  # AR decoding

    @property
    def form(self) -> str:
        return self.ar_form


@dataclass
class AutoregressiveCollator(PlanCollator):
    """GPT's objective: ``g[i] = i``; every token after the condition prefix is a target.

    ``form="two_stream"`` (default): the plan's batch for ``LookAroundForPreTraining``. ``form="single_stream"``:
    GPT's batch for ``LookAroundForCausalLM`` (``input_ids``, ``attention_mask`` and the plan's ``labels``, which
    the model shifts: the state at ``i - 1`` predicts token ``i``); no ``group_ids`` or ``target_positions``."""

    form: str = TWO_STREAM
    objective = "ar"
    plan_function = staticmethod(plan)

    def __post_init__(self):
        check_form("form", self.form)

    def _finish(self, input_ids, attention_mask, plan, generator):
        if self.form == TWO_STREAM:
            return super()._finish(input_ids, attention_mask, plan, generator)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels_for(input_ids, plan.is_target)}


OBJECTIVE = Objective(
    name="ar",
    family=LOOK_AHEAD,
    title="autoregressive (AR, \"look ahead\")",
    card_text="`g[i] = i`: each token is predicted from the tokens before it; targets are positions `i >= 1`.",
    Params=Params,
    plan=plan,
    collator=AutoregressiveCollator,
    presets={"ar": ("autoregressive", {})},
    single_stream_head=CAUSAL_HEAD,
    exact_plans=exact_plans,
)
