"""Plans: every pretraining objective as a group rank per token.

A plan gives each position ``i`` of a sequence (in the original token order) an integer group
rank ``g[i]`` and says which positions carry a loss. The two-stream model turns ranks into
attention (see ``masks.may_attend``):

- the content stream at ``i`` sees ``j`` iff ``g[j] <= g[i]``;
- the query stream at ``i`` sees content ``j`` iff ``g[j] < g[i]``.

Each objective is defined once, here. Collators, evaluators and the theory module all call
these functions, so an objective means the same thing everywhere.

Every function takes the valid ``lengths`` of a batch (padding is on the right), the padded
length ``seq_len`` and a ``torch.Generator``, and returns a :class:`Plan`. A prefix of
``num_condition_tokens`` (BOS/CLS or other conditioning) always has rank 0, is never a target,
and the objective's own ranks start at 1 after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Plan",
    "PLAN_NAMES",
    "autoregressive_plan",
    "semi_autoregressive_plan",
    "masked_plan",
    "variable_masked_plan",
    "gvp_plan",
    "gvp_boundaries",
    "make_plan",
]

PLAN_NAMES = ("ar", "dar", "mlm", "vmlm", "gvp")
SEGMENTATIONS = ("fixed", "random", "mixed")


@dataclass
class Plan:
    """Group ranks ``(B, T)`` (long) and loss positions ``(B, T)`` (bool) for a batch."""

    group_ids: torch.Tensor
    is_target: torch.Tensor

    def target_positions(self, pad_to: int | None = None) -> torch.Tensor:
        """Indices of the targets of each row, ``(B, M)``, padded with -1 (``M`` = max count or ``pad_to``)."""
        return target_positions_from_mask(self.is_target, pad_to)


def target_positions_from_mask(is_target: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
    """(B, T) bool -> (B, M) target indices in order, padded with -1; ``M`` = the largest count or ``pad_to``."""
    from .modeling_lookaround import positions_of  # the model derives target slots from labels the same way

    positions = positions_of(is_target)
    if pad_to is not None:
        if pad_to < positions.shape[1]:
            raise ValueError(f"pad_to={pad_to} is smaller than the largest target count {positions.shape[1]} in the batch")
        positions = torch.nn.functional.pad(positions, (0, pad_to - positions.shape[1]), value=-1)
    return positions


def _check_lengths(lengths, seq_len: int, num_condition_tokens: int) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
    if lengths.numel() == 0:
        raise ValueError("a plan needs at least one sequence; got an empty batch")
    if (lengths < 0).any() or (lengths > seq_len).any():
        raise ValueError(f"sequence lengths must lie in [0, {seq_len}], got {lengths.tolist()}")
    if num_condition_tokens < 0:
        raise ValueError(f"num_condition_tokens must be >= 0, got {num_condition_tokens}")
    return lengths


def _empty(lengths: torch.Tensor, seq_len: int) -> Plan:
    batch = lengths.numel()
    return Plan(torch.zeros(batch, seq_len, dtype=torch.long), torch.zeros(batch, seq_len, dtype=torch.bool))


def autoregressive_plan(lengths, seq_len: int, num_condition_tokens: int = 0, generator=None) -> Plan:
    """GPT: ``g[i] = i``; every position with rank >= 1 is a target (so ``i >= 1`` with no prefix)."""
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    plan = _empty(lengths, seq_len)
    c = num_condition_tokens
    for b, n in enumerate(lengths.tolist()):
        if n <= c:
            continue
        ranks = torch.arange(n - c) + (1 if c else 0)
        plan.group_ids[b, c:n] = ranks
        plan.is_target[b, c:n] = ranks >= 1
    return plan


def _draw_group_size(t, generator) -> int:
    sizes = [t] if isinstance(t, int) else list(t)
    if not sizes or any(int(s) < 1 for s in sizes):
        raise ValueError(f"group size t must be a positive int or a non-empty list of them, got {t!r}")
    if len(sizes) == 1:
        return int(sizes[0])
    return int(sizes[int(torch.randint(len(sizes), (1,), generator=generator))])


def semi_autoregressive_plan(lengths, seq_len: int, t=2, num_condition_tokens: int = 0, generator=None) -> Plan:
    """Diversity-enhanced AR (paper (a) Eq. 3 and 6).

    The first group has size ``s1 ~ U{1..t}`` and rank 0; then consecutive groups of ``t`` tokens:
    ``g[i] = 1 + (i - s1) // t``. Targets have rank >= 1. ``t`` may be a list: a group size is
    drawn uniformly from it for each sequence (a mixture of t values). ``t = 1`` is AR.
    """
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    plan = _empty(lengths, seq_len)
    c = num_condition_tokens
    for b, n in enumerate(lengths.tolist()):
        size = _draw_group_size(t, generator)
        if n <= c:
            continue
        s1 = int(torch.randint(1, size + 1, (1,), generator=generator))
        i = torch.arange(n - c)
        ranks = torch.where(i < s1, 0, 1 + torch.div(i - s1, size, rounding_mode="floor"))
        ranks = ranks + (1 if c else 0)
        plan.group_ids[b, c:n] = ranks
        plan.is_target[b, c:n] = ranks >= 1
    return plan


def _check_ratio(name: str, value: float) -> None:
    if not (0.0 < value < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value}")


def masked_plan(
    lengths, seq_len: int, mask_ratio: float = 0.15, num_condition_tokens: int = 0, maskable=None, generator=None
) -> Plan:
    """BERT/MAE with a fixed ratio: ``round(ratio * n)`` (at least 1) positions drawn without
    replacement get rank 1 and are the targets; the rest have rank 0."""
    _check_ratio("mask_ratio", mask_ratio)
    return _masked(lengths, seq_len, lambda: mask_ratio, num_condition_tokens, maskable, generator)


def variable_masked_plan(
    lengths,
    seq_len: int,
    mask_ratio_range: tuple[float, float] = (0.15, 0.3),
    num_condition_tokens: int = 0,
    maskable=None,
    generator=None,
) -> Plan:
    """Variable-length masking (paper (a) Eq. 5): the ratio is drawn per sequence from ``U[a, b]``."""
    a, b = check_mask_ratio_range(mask_ratio_range)

    def draw() -> float:
        return a + (b - a) * float(torch.rand((), generator=generator))

    return _masked(lengths, seq_len, draw, num_condition_tokens, maskable, generator)


def check_mask_ratio_range(mask_ratio_range) -> tuple[float, float]:
    try:
        a, b = (float(x) for x in mask_ratio_range)
    except (TypeError, ValueError):
        raise ValueError(f"mask_ratio_range must be two numbers (a, b), got {mask_ratio_range!r}") from None
    if not (0.0 < a <= b < 1.0):
        raise ValueError(f"mask_ratio_range must satisfy 0 < a <= b < 1, got ({a}, {b})")
    return a, b


def _masked(lengths, seq_len, draw_ratio, num_condition_tokens, maskable, generator) -> Plan:
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    plan = _empty(lengths, seq_len)
    c = num_condition_tokens
    if maskable is not None:
        maskable = torch.as_tensor(maskable, dtype=torch.bool)
        if maskable.shape != plan.group_ids.shape:
            raise ValueError(f"maskable must have shape {tuple(plan.group_ids.shape)}, got {tuple(maskable.shape)}")
    for b, n in enumerate(lengths.tolist()):
        ratio = draw_ratio()
        candidates = torch.arange(c, n)
        if maskable is not None:
            candidates = candidates[maskable[b, c:n]]
        if candidates.numel() == 0:
            continue
        count = min(candidates.numel(), max(1, round(ratio * candidates.numel())))
        chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:count]]
        base = 1 if c else 0
        plan.group_ids[b, c:n] = base
        plan.group_ids[b, chosen] = base + 1
        plan.is_target[b, chosen] = True
    return plan


def gvp_boundaries(n: int, num_groups: int = 20, segmentation: str = "mixed", generator=None) -> list[int]:
    """Group boundaries ``n0 < n1 < ... < nK = n`` of GVP (paper (b) §3.2, App. B).

    - fixed:  ``n_i = (i + 1) n / (K + 1)``;
    - random: ``n0..n(K-1)`` distinct, uniform in ``[1, n-1]``;
    - mixed:  ``n(K-1) = round(p n)``, ``p ~ N(0.5, 0.1)``; ``n0..n(K-2)`` distinct, uniform in
      ``[1, n(K-1) - 1]``. ``n(K-1)`` is clipped to ``[K, n-1]`` so the draw is always possible.
    """
    k = num_groups
    if segmentation not in SEGMENTATIONS:
        raise ValueError(f"segmentation must be one of {SEGMENTATIONS}, got {segmentation!r}")
    if k < 1:
        raise ValueError(f"num_groups (K) must be >= 1, got {k}")
    if n < k + 1:
        raise ValueError(f"GVP with K={k} needs sequences of at least K+1={k + 1} positions, got {n}")
    if segmentation == "fixed":
        return [round((i + 1) * n / (k + 1)) for i in range(k)] + [n]
    if segmentation == "random":
        inner = (torch.randperm(n - 1, generator=generator)[:k] + 1).sort().values.tolist()
        return inner + [n]
    p = 0.5 + 0.1 * float(torch.randn((), generator=generator))
    last = min(max(round(p * n), k), n - 1)
    inner = (torch.randperm(last - 1, generator=generator)[: k - 1] + 1).sort().values.tolist()
    return inner + [last, n]


def gvp_plan(
    lengths,
    seq_len: int,
    num_groups: int = 20,
    segmentation: str = "mixed",
    num_condition_tokens: int = 0,
    generator=None,
) -> Plan:
    """Generative visual pretraining (paper (b)): a random order ``z`` over positions, split into
    groups ``G0..GK``; ``g[z_t]`` is the index of the group holding ``t``. ``G0`` is the condition
    (not a target). Works on any sequence: tokens or image patches."""
    lengths = _check_lengths(lengths, seq_len, num_condition_tokens)
    plan = _empty(lengths, seq_len)
    c = num_condition_tokens
    for b, n in enumerate(lengths.tolist()):
        if n <= c:
            continue
        m = n - c
        bounds = gvp_boundaries(m, num_groups, segmentation, generator)
        order = torch.randperm(m, generator=generator)
        group_of_step = torch.bucketize(torch.arange(m), torch.tensor(bounds), right=True)
        ranks = torch.empty(m, dtype=torch.long)
        ranks[order] = group_of_step
        plan.group_ids[b, c:n] = ranks + (1 if c else 0)
        plan.is_target[b, c:n] = ranks >= 1
    return plan


def make_plan(objective: str, lengths, seq_len: int, generator=None, **params) -> Plan:
    """Draw the plan of ``objective`` (one of :data:`PLAN_NAMES`) with its parameters."""
    if objective == "ar":
        return autoregressive_plan(lengths, seq_len, generator=generator, **params)
    if objective == "dar":
        return semi_autoregressive_plan(lengths, seq_len, generator=generator, **params)
    if objective == "mlm":
        return masked_plan(lengths, seq_len, generator=generator, **params)
    if objective == "vmlm":
        return variable_masked_plan(lengths, seq_len, generator=generator, **params)
    if objective == "gvp":
        return gvp_plan(lengths, seq_len, generator=generator, **params)
    raise ValueError(f"unknown objective {objective!r}; choose one of {PLAN_NAMES}")


def expected_masked_count(ratio: float, n: int) -> int:
    """The number of targets that :func:`masked_plan` draws for ``n`` maskable positions."""
    return min(n, max(1, round(ratio * n))) if n else 0

