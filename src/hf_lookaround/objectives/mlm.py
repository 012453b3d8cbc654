"""``mlm``: masked language modelling with a fixed ratio (BERT/MAE, "look around").

Unmasked tokens have rank 0, masked tokens rank 1: the masked tokens are predicted from the rest. This module
also holds what the masked family shares: the masked plan's ranks, the ``[MASK]`` single-stream form and its
flags (``vmlm`` and ``span`` build on them).
"""

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PlanCollator
from ..plans import Plan, check_lengths, expected_masked_count, inside_positions, numpy_rng, random_subsets
from .base import MASKED, MASKED_HEAD, SINGLE_STREAM, TWO_STREAM, Objective, ObjectiveParams, check_form, flag


def check_ratio(name: str, value: float) -> None:
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")


def candidates_of(lengths, seq_len: int, num_condition_tokens: int, maskable=None):
    """(inside, candidates), both (B, T) bool: the positions the plan ranks, and those of them that may be
    masked (special tokens never are)."""
    inside = inside_positions(lengths, seq_len, num_condition_tokens)
    if maskable is None:
        return inside, inside
    maskable = torch.as_tensor(maskable, dtype=torch.bool)
    if maskable.shape != inside.shape:
        raise ValueError(f"maskable must have shape {tuple(inside.shape)}, got {tuple(maskable.shape)}")
    return inside, inside & maskable.numpy()


def masked_ranks(inside: np.ndarray, candidates: np.ndarray, chosen: np.ndarray, num_condition_tokens: int) -> Plan:
    """The masked family's plan from the chosen (masked) positions: condition 0, visible 1 (0 without a condition
    prefix), masked one above; a row with no candidate keeps rank 0 everywhere (nothing to predict or rank)."""
    available = candidates.sum(1)
    group_ids = (inside & (available > 0)[:, None]) * (1 if num_condition_tokens else 0) + chosen
    return Plan(torch.from_numpy(group_ids.astype(np.int64)), torch.from_numpy(chosen))


def draw_masked(lengths, seq_len, draw_ratios, num_condition_tokens, maskable, generator) -> Plan:
    """``round(ratio * n)`` (at least 1) of each row's ``n`` candidates, a uniform random subset; the ratio of
    each row from ``draw_ratios(batch)``."""
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    inside, candidates = candidates_of(lengths, seq_len, num_condition_tokens, maskable)
    ratio = draw_ratios(lengths.numel()).numpy()
    available = candidates.sum(1)
    # expected_masked_count, row by row: round half to even (as Python's round) in float64
    count = np.minimum(available, np.maximum(np.round(ratio * available), 1).astype(np.int64))
    chosen = np.zeros(candidates.shape, dtype=bool)
    if available.max() > 0:
        chosen[candidates] = random_subsets(numpy_rng(generator), count, available)
    return masked_ranks(inside, candidates, chosen, num_condition_tokens)


def plan(lengths, seq_len: int, mask_ratio: float = 0.15, num_condition_tokens: int = 0, maskable=None,
         generator=None) -> Plan:
    """BERT/MAE with a fixed ratio: ``round(ratio * n)`` (at least 1) positions drawn without
    replacement get rank 1 and are the targets; the rest have rank 0."""
    check_ratio("mask_ratio", mask_ratio)

    def ratios(batch: int) -> torch.Tensor:
        return torch.full((batch,), float(mask_ratio), dtype=torch.float64)

    return draw_masked(lengths, seq_len, ratios, num_condition_tokens, maskable, generator)


def exact_masked_plans(n: int, num_condition_tokens: int, counts: dict[int, float]) -> list:
    """The masked family's plans of a sequence of ``n`` tokens, every position after the prefix maskable: a count
    ``m`` with probability ``counts[m]``, then every subset of ``m`` positions uniformly (``masked_ranks``' ranks)."""
    c, base = num_condition_tokens, 1 if num_condition_tokens else 0
    plans = []
    for m, p_m in sorted(counts.items()):
        subsets = list(itertools.combinations(range(c, n), m))
        for chosen in subsets:
            ranks = np.zeros(n, dtype=np.int64)
            ranks[c:] = base
            ranks[list(chosen)] = base + 1
            plans.append((p_m / len(subsets), ranks, ranks == base + 1))
    return plans


def exact_plans(n: int, num_condition_tokens: int = 0, mask_ratio: float = 0.15) -> list:
    """Every plan with its probability: every subset of ``expected_masked_count(ratio, n)`` positions, uniformly."""
    check_ratio("mask_ratio", float(mask_ratio))
    count = expected_masked_count(float(mask_ratio), n - num_condition_tokens)
    return exact_masked_plans(n, num_condition_tokens, {count: 1.0})


@dataclass
class MaskedFormParams(ObjectiveParams):
    """The flags of the masked family's forms (shared by mlm, vmlm and span)."""

    masked_form: str = flag(TWO_STREAM, help="mlm/vmlm/span: two_stream or single_stream ([MASK])")
    mask_replace_prob: float = flag(0.8, help="single_stream: share of masked tokens -> [MASK]")
    random_replace_prob: float = flag(0.1, help="single_stream: share -> a random token")

    def __post_init__(self):
        check_form("masked_form", self.masked_form)
        check_replace_probs(self.mask_replace_prob, self.random_replace_prob, prefix="--")

    def collator_params(self) -> dict:
        return {**self.plan_params(), "form": self.masked_form, "mask_replace_prob": self.mask_replace_prob,
                "random_replace_prob": self.random_replace_prob}

    @property
    def form(self) -> str:
        return self.masked_form


def check_replace_probs(mask_replace_prob: float, random_replace_prob: float, prefix: str = "") -> None:
    for name, value in (("mask_replace_prob", mask_replace_prob), ("random_replace_prob", random_replace_prob)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{prefix}{name} must lie in [0, 1], got {value}")
    if mask_replace_prob + random_replace_prob > 1.0:
        raise ValueError(f"{prefix}mask_replace_prob + {prefix}random_replace_prob must not exceed 1")


@dataclass
class Params(MaskedFormParams):
    SPEC = "mlm:RHO"

    mask_ratio: float = flag(0.15, help="mlm: masking ratio")

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        return cls(mask_ratio=float(arg or 0.15))

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < float(self.mask_ratio) < 1.0:
            raise ValueError(f"--mask_ratio must lie strictly between 0 and 1, got {self.mask_ratio}")

    def plan_params(self) -> dict:
        return {"mask_ratio": float(self.mask_ratio)}


@dataclass
class MaskedCollator(PlanCollator):
    """Masked language modelling with a fixed ratio (BERT/MAE), and the base of the masked family's collators.

    ``form="two_stream"`` (default): inputs are unchanged; masked tokens get the higher group rank
    and the query stream predicts them (``LookAroundForPreTraining``); needs no ``[MASK]`` token.
    ``form="single_stream"``: the classic BERT input for ``LookAroundForMaskedLM``: of the masked
    positions, ``mask_replace_prob`` become ``[MASK]``, ``random_replace_prob`` a random token and
    the rest stay as they are; no ``group_ids``/``target_positions`` are emitted.
    """

    mask_ratio: float = 0.15
    form: str = TWO_STREAM
    mask_replace_prob: float = 0.8
    random_replace_prob: float = 0.1
    objective = "mlm"
    plan_function = staticmethod(plan)

    def __post_init__(self):
        self._check_ratio()
        check_form("form", self.form)
        check_replace_probs(self.mask_replace_prob, self.random_replace_prob)
        if self.form == SINGLE_STREAM and getattr(self.tokenizer, "mask_token_id", None) is None:
            raise ValueError(
                "the single-stream masked form replaces inputs with [MASK], but the tokenizer has no mask token; "
                "add one (tokenizer.add_special_tokens({'mask_token': '[MASK]'}) and resize the embeddings), "
                "train one with `hf-lookaround train-tokenizer`, or use form='two_stream', which needs none"
            )

    def _check_ratio(self):
        check_ratio("mask_ratio", float(self.mask_ratio))

    def uses_maskable(self) -> bool:
        return True

    def plan_params(self):
        return {"mask_ratio": float(self.mask_ratio)}

    def _finish(self, input_ids, attention_mask, plan, generator):
        if self.form == TWO_STREAM:
            return super()._finish(input_ids, attention_mask, plan, generator)
        inputs, labels = bert_form(input_ids.numpy(), plan.is_target.numpy(), self.tokenizer,
                                   self.mask_replace_prob, self.random_replace_prob, generator)
        return {"input_ids": torch.from_numpy(inputs), "attention_mask": attention_mask,
                "labels": torch.from_numpy(labels)}


def bert_form(input_ids: np.ndarray, masked: np.ndarray, tokenizer, mask_replace_prob: float,
              random_replace_prob: float, generator) -> tuple[np.ndarray, np.ndarray]:
    """BERT's single-stream input for the masked positions of a plan: ``(inputs, labels)``, both like
    ``input_ids`` (numpy). Of the masked positions, ``mask_replace_prob`` become ``[MASK]``, ``random_replace_prob``
    a random token, the rest stay; labels hold the original token there, -100 elsewhere."""
    # the draws come from the torch generator (the batch's seed), the (B, T) arithmetic is numpy's (see plans.py)
    u = torch.rand(input_ids.shape, generator=generator).numpy()
    random_ids = torch.randint(len(tokenizer), input_ids.shape, generator=generator).numpy()
    # one uniform draw per position decides [MASK] / random / keep (BERT's 80/10/10 by default), compared in
    # float32 as the draw is
    p_mask, p_mask_or_random = np.float32(mask_replace_prob), np.float32(mask_replace_prob + random_replace_prob)
    to_mask = masked & (u < p_mask)
    to_random = masked & (u >= p_mask) & (u < p_mask_or_random)
    inputs = np.where(to_mask, tokenizer.mask_token_id, input_ids)
    inputs = np.where(to_random, random_ids, inputs)
    return inputs, np.where(masked, input_ids, -100)


OBJECTIVE = Objective(
    name="mlm",
    family=MASKED,
    title="masked, fixed ratio (\"look around\", BERT/MAE)",
    card_text="unmasked tokens have rank 0, masked tokens rank 1; the masked tokens are predicted from the rest.",
    Params=Params,
    plan=plan,
    collator=MaskedCollator,
    presets={"mlm-0.15": ("masked, ratio 0.15", {"mask_ratio": 0.15}),
             "mlm-0.3": ("masked, ratio 0.3", {"mask_ratio": 0.3})},
    image_defaults={"mask_ratio": 0.75},
    target_ratio=lambda params: params.get("mask_ratio", 0.15),
    min_top_ratio=lambda params: params.get("mask_ratio", 0.15),
    single_stream_head=MASKED_HEAD,
    drops_unread_content=True,
    exact_plans=exact_plans,
)
