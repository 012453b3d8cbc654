"""``span``: span corruption, the R- and X-denoisers of UL2 (Tay et al., 2022), after T5's ``random_spans_noise_mask``.

Of a row's ``n`` maskable positions (special tokens never are; a BOS prefix is the rank-0 condition), T5's rule
corrupts ``num_noise = round(n * rate)`` (clipped to ``[1, n - 1]``) in ``num_spans = round(num_noise / mean)``
spans (clipped to ``[1, min(num_noise, n - num_noise)]``): the noise and the non-noise positions are each split
into ``num_spans`` non-empty runs uniformly at random, and the runs alternate, starting with non-noise. So the
row is a uniformly random sequence of ``num_spans`` non-noise and ``num_spans`` noise runs: as in T5 (without
its optional ``random_roll``), the first maskable position is never corrupted and the last always is. A row of
one maskable position has it corrupted (as in ``mlm``, every row with one predicts something).

As in ``mlm``, the corrupted positions get the masked rank and are the targets, all spans one group: each span is
predicted from the uncorrupted rest (the two-stream form needs no sentinel tokens; the single-stream form is
BERT's per-token ``[MASK]`` over every span). Runs are contiguous among the maskable positions: a special token
inside a block (an EOS between packed documents) is never corrupted, and a run may cover the positions on both
of its sides.
"""

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..plans import Plan, check_lengths, numpy_rng, random_subsets
from .base import MASKED, MASKED_HEAD, Objective, flag
from .mlm import MaskedCollator, MaskedFormParams, candidates_of, masked_ranks


def check_span(mean_span_length: float, corruption_rate: float,
               names: tuple[str, str] = ("mean_span_length", "corruption_rate")) -> tuple[float, float]:
    """``(mean, rate)`` as floats, or a ValueError that names the parameter (``names``: the flags, for the CLI)."""
    try:
        mean, rate = float(mean_span_length), float(corruption_rate)
    except (TypeError, ValueError):
        raise ValueError(f"{names[0]} and {names[1]} must be numbers, got {mean_span_length!r} and "
                         f"{corruption_rate!r}") from None
    if not 0.0 < rate < 1.0:
        raise ValueError(f"{names[1]} must lie strictly between 0 and 1, got {corruption_rate}")
    if not (math.isfinite(mean) and mean >= 1.0):
        raise ValueError(f"{names[0]} must be a finite number >= 1 (a span holds at least one token), "
                         f"got {mean_span_length}")
    return mean, rate


def span_counts(n, mean_span_length: float, corruption_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """T5's counts for rows of ``n >= 2`` maskable positions: ``(num_noise, num_spans)``, each rounded half to even
    (as ``tf.round``) and clipped: ``num_noise`` to ``[1, n - 1]``, ``num_spans`` to
    ``[1, min(num_noise, n - num_noise)]`` (every run non-empty)."""
    n = np.asarray(n, dtype=np.int64)
    noise = np.clip(np.round(n * float(corruption_rate)).astype(np.int64), 1, n - 1)
    spans = np.round(noise / float(mean_span_length)).astype(np.int64)
    return noise, np.clip(spans, 1, np.minimum(noise, n - noise))


def segment_lengths(rng: np.random.Generator, items: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """T5's ``_random_segmentation`` for a batch: each row's ``items`` split into ``segments`` non-empty runs,
    uniformly over the compositions (``1 <= segments <= items``): the lengths, rows concatenated
    (``segments.sum()`` entries). A run starts at a row's first item, and after each of ``segments - 1`` cuts
    drawn uniformly among the ``items - 1`` gaps."""
    starts = np.ones(int(items.sum()), dtype=np.int64)
    later = np.ones(starts.size, dtype=bool)
    later[np.cumsum(items) - items] = False  # every item but each row's first
    starts[later] = random_subsets(rng, segments - 1, items - 1)
    return np.bincount(np.cumsum(starts) - 1, minlength=int(segments.sum()))


def plan(lengths, seq_len: int, mean_span_length: float = 3.0, corruption_rate: float = 0.15,
         num_condition_tokens: int = 0, maskable=None, generator=None) -> Plan:
    """Span corruption (T5, UL2's R/X-denoisers) for a batch, without a loop over rows: the corrupted runs of
    each row (module doc) get the masked rank and are the targets."""
    mean, rate = check_span(mean_span_length, corruption_rate)
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    inside, candidates = candidates_of(lengths, seq_len, num_condition_tokens, maskable)
    available = candidates.sum(1)
    chosen = np.zeros(candidates.shape, dtype=bool)
    single = available == 1
    chosen[single] = candidates[single]
    rows = np.flatnonzero(available >= 2)
    if rows.size:
        n = available[rows]
        noise, spans = span_counts(n, mean, rate)
        rng = numpy_rng(generator)
        # per span k of a row: non-noise run k, then noise run k (T5's interleaving, non-noise first)
        runs = np.stack([segment_lengths(rng, n - noise, spans), segment_lengths(rng, noise, spans)], 1).reshape(-1)
        corrupted = np.repeat(np.tile([False, True], runs.size // 2), runs)  # every spanned row's candidates
        spanned = np.zeros((rows.size, seq_len), dtype=bool)
        spanned[candidates[rows]] = corrupted
        chosen[rows] = spanned
    return masked_ranks(inside, candidates, chosen, num_condition_tokens)


def exact_plans(n: int, num_condition_tokens: int = 0, mean_span_length: float = 3.0,
                corruption_rate: float = 0.15) -> list:
    """Every plan of a sequence of ``n`` tokens (every position after the prefix maskable) with its probability,
    for the theory module: each pair of compositions (non-noise runs, noise runs) is equally likely."""
    mean, rate = check_span(mean_span_length, corruption_rate)
    c, base = num_condition_tokens, 1 if num_condition_tokens else 0
    m = n - c
    if m == 1:
        compositions = [((0,), (1,))]
    else:
        noise, spans = (int(x) for x in span_counts(m, mean, rate))
        compositions = list(itertools.product(_compositions(m - noise, spans), _compositions(noise, spans)))
    plans = []
    for clean, corrupt in compositions:
        runs = [length for pair in zip(clean, corrupt) for length in pair]
        ranks = np.full(n, base, dtype=np.int64)
        ranks[:c] = 0
        ranks[c:] += np.repeat(np.tile([0, 1], len(clean)), runs)
        plans.append((1.0 / len(compositions), ranks, ranks == base + 1))
    return plans


def _compositions(items: int, parts: int) -> list[tuple[int, ...]]:
    """Every split of ``items`` into ``parts`` non-empty runs, as run lengths."""
    return [tuple(np.diff((0, *cuts, items)).tolist()) for cuts in itertools.combinations(range(1, items), parts - 1)]


@dataclass
class Params(MaskedFormParams):
    SPEC = "span:MEAN,RATE"

    span_mean_length: float = flag(3.0, help="span: mean length of a corrupted span (UL2: 3 for the R-denoiser, "
                                             "32 for the X-denoiser)")
    span_corruption_rate: float = flag(0.15, help="span: share of the tokens corrupted (UL2: 0.15 R, 0.5 X)")

    def __post_init__(self):
        super().__post_init__()
        check_span(self.span_mean_length, self.span_corruption_rate,
                   ("--span_mean_length", "--span_corruption_rate"))

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        mean, rate = (float(x) for x in (arg or "3,0.15").split(","))
        return cls(span_mean_length=mean, span_corruption_rate=rate)

    def plan_params(self) -> dict:
        return {"mean_span_length": float(self.span_mean_length), "corruption_rate": float(self.span_corruption_rate)}


@dataclass
class SpanCorruptionCollator(MaskedCollator):
    """Span corruption (T5; UL2's R- and X-denoisers) in the masked family's forms: ``form="two_stream"`` (the
    corrupted spans get the masked rank and the query stream predicts them) or ``"single_stream"`` (BERT's
    ``[MASK]`` / random / keep over every token of every span, for ``LookAroundForMaskedLM``)."""

    mask_ratio: float = field(default=0.15, init=False, repr=False)  # mlm's parameter: not one of span's
    mean_span_length: float = 3.0
    corruption_rate: float = 0.15
    objective = "span"
    plan_function = staticmethod(plan)

    def _check_ratio(self):
        self.mean_span_length, self.corruption_rate = check_span(self.mean_span_length, self.corruption_rate)

    def plan_params(self):
        return {"mean_span_length": self.mean_span_length, "corruption_rate": self.corruption_rate}


OBJECTIVE = Objective(
    name="span",
    family=MASKED,
    title="span corruption (T5, UL2's R/X-denoisers)",
    card_text="`round(rate * n)` tokens are corrupted in `round(corrupted / mean)` contiguous spans (T5's "
              "`random_spans_noise_mask`); uncorrupted tokens have rank 0, corrupted ones rank 1, all spans predicted "
              "from the rest.",
    Params=Params,
    plan=plan,
    collator=SpanCorruptionCollator,
    presets={"span-r": ("span corruption, R-denoiser: mean span 3, rate 0.15",
                        {"span_mean_length": 3.0, "span_corruption_rate": 0.15}),
             "span-x": ("span corruption, X-denoiser: mean span 32, rate 0.5",
                        {"span_mean_length": 32.0, "span_corruption_rate": 0.5})},
    # round(rate * n) <= ceil(rate * n) <= ceil(rate * seq_len), and max_targets keeps at least 1
    target_ratio=lambda params: params.get("corruption_rate", 0.15),
    min_top_ratio=lambda params: params.get("corruption_rate", 0.15),
    single_stream_head=MASKED_HEAD,
    drops_unread_content=True,
    exact_plans=exact_plans,
)
