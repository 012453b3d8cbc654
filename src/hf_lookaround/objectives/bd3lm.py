"""``bd3lm``: block diffusion (BD3-LM, Arriola et al. 2025): blocks of ``b`` tokens are autoregressive, and each
block is denoised MDLM-style given the clean earlier blocks.

The tokens after the condition prefix are cut into blocks of ``b = --diffusion_block`` (block ``k`` holds positions
``c + k b .. c + (k + 1) b - 1``). Each block draws its own time ``t`` and masks its tokens with the schedule's
probability ``m(t)``, as ``mdlm`` does for a whole sequence. In ranks (above a BOS prefix, which keeps rank 0):
block ``k``'s unmasked tokens take rank ``2k``, its masked tokens ``2k + 1`` (each shifted up by one after a
prefix). So a masked token's query sees every earlier block and the unmasked tokens of its own, never a later
block; and the content stream stays the clean text (a token's content sees its own block and the earlier ones).
The loss is ``mdlm``'s: each masked token weighted by ``m'(t) / m(t)`` of its block, normalised to the negative
ELBO per token, which for ``b`` = the sequence length is MDLM's and for ``b = 1`` the AR NLL.

BD3-LM's clipped schedule (``--noise_clip beta omega``) draws training times from ``U[max(eps, beta), omega]``
instead of ``(eps, 1]``, a lower-variance estimator that is no longer the ELBO; the ELBO protocol always draws
from ``(eps, 1]``.

Two forms draw the same plan, weights and loss:

- ``two_stream``: the content stream is the clean text, the query stream predicts the masked tokens.
- ``single_stream`` (``--masked_form single_stream``): the paper's vectorised layout ``x_t ⊕ x_0``, one row per
  token of each: the noised sequence (masked tokens become ``[MASK]``) then the clean one, both copies of token
  ``i`` at position ``i``. A noised block sees itself (bidirectionally) and the clean blocks before it, the clean
  half sees itself block-causally (``masking_lookaround.block_diffusion_plan``; ``default_attention =
  "block_diffusion"``), so a masked token reads exactly what its two-stream query row reads, the ``[MASK]`` inputs
  of its own block aside. The loss is at the masked ``x_t`` rows, with the plan's weights. The mask depends on the
  length alone (every row starts with BOS, no padding): built once per shape, a static BlockMask under
  FlexAttention. ``LookAroundForMaskedLM`` trains it (``one_stream_layout=True``).
"""

from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PlanCollator
from ..plans import Plan
from .base import MASKED, MASKED_HEAD, SINGLE_STREAM, TWO_STREAM, Objective, check_form, flag
from .mdlm import (
    DEFAULT_EPS, NOISE_SCHEDULES, DiffusionParams, check_diffusion, check_mask_token, diffusion_draw, diffusion_plan,
    draw_times, mask_form,
)


def check_block(diffusion_block, noise_clip, prefix: str = "") -> tuple[int, tuple[float, float]]:
    """``(b, (beta, omega))``, or a ValueError that names the parameter (``prefix`` "--": the command line's)."""
    if isinstance(diffusion_block, bool) or not isinstance(diffusion_block, (int, np.integer)) or diffusion_block < 1:
        raise ValueError(f"{prefix}diffusion_block (the block size b) must be an integer >= 1, got {diffusion_block!r}")
    try:
        lo, hi = (float(x) for x in noise_clip)
    except (TypeError, ValueError):
        raise ValueError(f"{prefix}noise_clip must be two numbers beta omega, got {noise_clip!r}") from None
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"{prefix}noise_clip must satisfy 0 <= beta < omega <= 1, got ({lo}, {hi})")
    return int(diffusion_block), (lo, hi)


def block_index(seq_len: int, num_condition_tokens: int, diffusion_block: int) -> np.ndarray:
    """(T,) the block of each position (the prefix counts as block 0; it is never masked)."""
    return np.maximum(np.arange(seq_len) - num_condition_tokens, 0) // diffusion_block


def plan(lengths, seq_len: int, diffusion_block: int = 4, noise_schedule: str = "linear", eps: float = DEFAULT_EPS,
         low_discrepancy: bool = True, noise_clip=(0.0, 1.0), num_condition_tokens: int = 0, generator=None) -> Plan:
    """Block diffusion: a time per block, its tokens masked with probability ``m(t)``; block ``k``'s unmasked
    tokens rank ``2k``, masked ``2k + 1`` (above a prefix: one more), weighted as in ``mdlm`` (module doc)."""
    return _plan(lengths, seq_len, diffusion_block, noise_schedule, eps, low_discrepancy, noise_clip,
                 num_condition_tokens, generator)


def elbo_plan(lengths, seq_len: int, diffusion_block: int = 4, noise_schedule: str = "linear",
              eps: float = DEFAULT_EPS, low_discrepancy: bool = True, noise_clip=(0.0, 1.0),
              num_condition_tokens: int = 0, generator=None) -> Plan:
    """One Monte-Carlo sample of each row's negative ELBO per token (``mdlm.elbo_plan``); the times come from
    ``(eps, 1]`` whatever the training clip was."""
    return _plan(lengths, seq_len, diffusion_block, noise_schedule, eps, low_discrepancy, (0.0, 1.0),
                 num_condition_tokens, generator, per_row=True)


def _plan(lengths, seq_len, diffusion_block, noise_schedule, eps, low_discrepancy, noise_clip, num_condition_tokens,
          generator, per_row=False) -> Plan:
    check_diffusion(noise_schedule, eps, low_discrepancy)
    b, clip = check_block(diffusion_block, noise_clip)
    block = block_index(seq_len, num_condition_tokens, b)
    num_blocks = int(block[-1]) + 1 if seq_len else 1

    def times_of(rng, batch):  # a time per block, stratified over all the blocks of the batch
        times = draw_times(rng, batch * num_blocks, eps, low_discrepancy, clip).reshape(batch, num_blocks)
        return times[:, block], NOISE_SCHEDULES[noise_schedule]

    inside, candidates, chosen, weights = diffusion_draw(lengths, seq_len, times_of, num_condition_tokens, generator)
    base = 1 if num_condition_tokens else 0
    group_ids = np.where(inside, base + 2 * block + chosen, 0)
    ranks = Plan(torch.from_numpy(group_ids.astype(np.int64)), torch.from_numpy(chosen))
    return diffusion_plan(ranks, candidates, chosen, weights, per_row)


@dataclass
class Params(DiffusionParams):
    SPEC = "bd3lm:B"

    diffusion_block: int = flag(4, help="bd3lm: the block size b (blocks are autoregressive, each denoised MDLM-style)")
    noise_clip: list[float] = flag(default_factory=lambda: [0.0, 1.0],
                                   help="bd3lm: BD3-LM's clipped schedule, training times t ~ U[beta, omega] "
                                        "(0 1: none)")

    def __post_init__(self):
        super().__post_init__()
        check_block(self.diffusion_block, self.noise_clip, prefix="--")

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        return cls(diffusion_block=int(arg or 4))

    def plan_params(self) -> dict:
        return {**super().plan_params(), "diffusion_block": int(self.diffusion_block),
                "noise_clip": [float(x) for x in self.noise_clip]}

    def collator_params(self) -> dict:
        return {**self.plan_params(), "form": self.masked_form}

    def config_fields(self) -> dict:
        if self.masked_form != SINGLE_STREAM:
            return super().config_fields()
        # the x_t ⊕ x_0 layout's mask: blocks of b after BOS (masking_lookaround.block_diffusion_plan)
        return {**super().config_fields(), "default_attention": "block_diffusion",
                "attention_group_size": int(self.diffusion_block)}


def one_stream_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, plan: Plan, mask_token_id: int) -> dict:
    """The one-stream batch of a plan: ``x_t ⊕ x_0`` (B, 2T), the labels at the masked ``x_t`` rows and their weights
    (the clean half predicts nothing), and the doubled ``attention_mask`` only where a row is padded (without padding
    the mask is the same for every batch)."""
    noised = mask_form(input_ids, plan.is_target, mask_token_id)  # [MASK] at the masked tokens
    nothing = torch.full_like(input_ids, -100)
    batch = {"input_ids": torch.cat([noised, input_ids], 1),
             "labels": torch.cat([torch.where(plan.is_target, input_ids, -100), nothing], 1),
             "loss_weights": torch.cat([plan.loss_weights, torch.zeros_like(plan.loss_weights)], 1)}
    if not bool(attention_mask.all()):
        batch["attention_mask"] = torch.cat([attention_mask, attention_mask], 1)
    return batch


@dataclass
class BlockDiffusionCollator(PlanCollator):
    """BD3-LM's batches: ``form="two_stream"`` (inputs unchanged, the plan's ranks, for ``LookAroundForPreTraining``)
    or ``"single_stream"`` (:func:`one_stream_layout`, for ``LookAroundForMaskedLM`` with
    ``default_attention="block_diffusion"``; every row must start with BOS); both carry ``loss_weights``."""

    diffusion_block: int = 4
    noise_schedule: str = "linear"
    eps: float = DEFAULT_EPS
    low_discrepancy: bool = True
    noise_clip: tuple[float, float] = (0.0, 1.0)
    form: str = TWO_STREAM
    objective = "bd3lm"
    plan_function = staticmethod(plan)

    def __post_init__(self):
        check_diffusion(self.noise_schedule, self.eps, self.low_discrepancy)
        self.diffusion_block, self.noise_clip = check_block(self.diffusion_block, self.noise_clip)
        check_form("form", self.form)
        check_mask_token(self.tokenizer, self.form, self.objective)

    def plan_params(self):
        return {"diffusion_block": self.diffusion_block, "noise_schedule": self.noise_schedule, "eps": float(self.eps),
                "low_discrepancy": self.low_discrepancy, "noise_clip": tuple(self.noise_clip)}

    def _finish(self, input_ids, attention_mask, plan, generator):
        if self.form == TWO_STREAM:
            return super()._finish(input_ids, attention_mask, plan, generator)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        real = attention_mask.sum(1) > 0
        if bos is None or bool((input_ids[real, 0] != bos).any()):
            raise ValueError("bd3lm's single-stream form cuts blocks after a BOS at the start of every row (its mask "
                             "is built once per length): pack blocks with BOS (hf-lookaround pretrain does) or use "
                             "form='two_stream'")
        return one_stream_layout(input_ids, attention_mask, plan, int(self.tokenizer.mask_token_id))


OBJECTIVE = Objective(
    name="bd3lm",
    family=MASKED,
    title="block diffusion (BD3-LM)",
    card_text="the sequence is cut into blocks of `b`; each block draws a time `t` and masks its tokens with the "
              "noise schedule's probability; block `k`'s unmasked tokens have rank `2k`, its masked tokens `2k + 1`, "
              "so a block is denoised given the clean earlier blocks, and each masked token's loss is weighted by "
              "`m'(t) / m(t)` (`1 / t`): the negative ELBO per token (BD3-LM).",
    Params=Params,
    plan=plan,
    collator=BlockDiffusionCollator,
    presets={"bd3lm-4": ("block diffusion (BD3-LM), b = 4", {"diffusion_block": 4}),
             "bd3lm-16": ("block diffusion (BD3-LM), b = 16", {"diffusion_block": 16}),
             "bd3lm-4-1s": ("block diffusion (BD3-LM), b = 4, one stream (x_t ⊕ x_0)",
                            {"diffusion_block": 4, "masked_form": SINGLE_STREAM})},
    single_stream_head=MASKED_HEAD,
    elbo_plan=elbo_plan,
)
