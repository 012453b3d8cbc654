"""``vmlm``: variable-length masking (paper (a) Eq. 5): as ``mlm``, with the ratio drawn per sequence from
``U[a, b]`` (text [0.15, 0.3]; images [0.5, 0.75])."""

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..plans import Plan, expected_masked_count
from .base import MASKED, MASKED_HEAD, Objective, flag
from .mlm import MaskedCollator, MaskedFormParams, draw_masked, exact_masked_plans


def check_mask_ratio_range(mask_ratio_range) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in mask_ratio_range)
    except (TypeError, ValueError):
        raise ValueError(f"mask_ratio_range must be two numbers (a, b), got {mask_ratio_range!r}") from None
    if not (0.0 < a <= b < 1.0):
        raise ValueError(f"mask_ratio_range must satisfy 0 < a <= b < 1, got ({a}, {b})")
    return a, b


def plan(lengths, seq_len: int, mask_ratio_range: tuple[float, float] = (0.15, 0.3), num_condition_tokens: int = 0,
         maskable=None, generator=None) -> Plan:
    """Variable-length masking: the ratio is drawn per sequence from ``U[a, b]``."""
    a, b = check_mask_ratio_range(mask_ratio_range)

    def ratios(batch: int) -> torch.Tensor:
        return a + (b - a) * torch.rand(batch, generator=generator).double()

    return draw_masked(lengths, seq_len, ratios, num_condition_tokens, maskable, generator)


def count_distribution(n: int, a: float, b: float) -> dict[int, float]:
    """P(count = m) when the ratio is ``U[a, b]`` and the count is ``expected_masked_count(ratio, n)``.

    The count is piecewise constant in the ratio, with jumps where ``ratio * n`` crosses a half
    integer; integrating over the pieces gives the exact distribution."""
    if a == b:
        return {expected_masked_count(a, n): 1.0}
    cuts = sorted({a, b} | {(k + 0.5) / n for k in range(n + 1) if a < (k + 0.5) / n < b})
    probs: dict[int, float] = defaultdict(float)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        probs[expected_masked_count((lo + hi) / 2, n)] += (hi - lo) / (b - a)
    return dict(probs)


def exact_plans(n: int, num_condition_tokens: int = 0, mask_ratio_range=(0.15, 0.3)) -> list:
    """Every plan with its probability: the count's exact distribution under ``U[a, b]``, then every subset of
    that size uniformly."""
    a, b = check_mask_ratio_range(mask_ratio_range)
    return exact_masked_plans(n, num_condition_tokens, count_distribution(n - num_condition_tokens, a, b))


@dataclass
class Params(MaskedFormParams):
    SPEC = "vmlm:A-B"

    mask_ratio_range: list[float] = flag(default_factory=lambda: [0.15, 0.3], help="vmlm: a b")

    def __post_init__(self):
        super().__post_init__()
        try:
            check_mask_ratio_range(self.mask_ratio_range)
        except ValueError as error:
            raise ValueError(f"--{error}") from None

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        return cls(mask_ratio_range=[float(x) for x in (arg or "0.15-0.3").split("-")])

    def plan_params(self) -> dict:
        return {"mask_ratio_range": list(self.mask_ratio_range)}

    def collator_params(self) -> dict:
        return {**super().collator_params(), "mask_ratio_range": tuple(self.mask_ratio_range)}


@dataclass
class VariableMaskedCollator(MaskedCollator):
    """Variable-length masking, paper (a) Eq. 5: the ratio is drawn per sequence from ``U[a, b]``
    (text: [0.15, 0.3]; images: [0.5, 0.75])."""

    mask_ratio_range: tuple[float, float] = (0.15, 0.3)
    objective = "vmlm"
    plan_function = staticmethod(plan)

    def _check_ratio(self):
        self.mask_ratio_range = check_mask_ratio_range(self.mask_ratio_range)

    def plan_params(self):
        return {"mask_ratio_range": tuple(self.mask_ratio_range)}


OBJECTIVE = Objective(
    name="vmlm",
    family=MASKED,
    title="variable-length masked (VMLM)",
    card_text="as masked, with the ratio drawn per sequence from `U[a, b]` (paper (a) Eq. 5).",
    Params=Params,
    plan=plan,
    collator=VariableMaskedCollator,
    presets={"vmlm-0.15-0.3": ("variable masked, U[0.15, 0.3]", {"mask_ratio_range": [0.15, 0.3]})},
    image_defaults={"mask_ratio_range": (0.5, 0.75)},
    target_ratio=lambda params: max(params.get("mask_ratio_range", (0.15, 0.3))),
    min_top_ratio=lambda params: min(params.get("mask_ratio_range", (0.15, 0.3))),
    single_stream_head=MASKED_HEAD,
    drops_unread_content=True,
    exact_plans=exact_plans,
)
