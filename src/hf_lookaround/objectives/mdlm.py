"""``mdlm``: masked diffusion (MDLM, Sahoo et al. 2024; LLaDA), whose loss is the negative ELBO.

Each sequence draws a time ``t ~ U(eps, 1]`` (optionally low-discrepancy: the batch's times stratified over the
interval, MDLM's antithetic sampler), and each token after the condition prefix is masked independently with
probability ``m(t)``, the noise schedule's masking probability (``m(t) = t`` for the linear one). In ranks this is
``mlm``'s plan (unmasked rank 0, masked rank 1, a BOS prefix alone below them), with another draw and a weight:
each masked token's cross-entropy is weighted by ``m'(t) / m(t)`` (``1 / t`` for the linear schedule). Then
``E_t E_mask [sum over masked tokens of weight * cross-entropy]`` is the negative ELBO of the sequence (MDLM Eq. 10,
truncated at ``eps`` as MDLM's sampler is), a bound on its NLL, so its perplexity sits in the table of AR ones.

Every token after the condition prefix is maskable, special tokens (an EOS between packed documents) included: the
bound covers the whole block, as the AR perplexity counts every token after BOS.

The loss is the negative ELBO per token: the plan's ``loss_weights`` are the schedule's weight times ``M / N`` (the
batch's targets over its maskable tokens), so the model's mean over the targets (``weighted_loss``) is
``sum(weight * cross-entropy) / N``, MDLM's normalisation. In a mixture the ratio is over this objective's rows.

Two forms: ``two_stream`` (the content stream is the clean text, the query stream predicts the masked tokens) and
``single_stream`` (every masked token becomes ``[MASK]``, the absorbing state: no random or kept tokens, for
``LookAroundForMaskedLM``). ``bd3lm`` (block diffusion) builds on this module.
"""

from dataclasses import dataclass

import numpy as np
import torch

from ..data.collators import PlanCollator
from ..plans import Plan, check_lengths, numpy_rng
from .base import MASKED, MASKED_HEAD, SINGLE_STREAM, TWO_STREAM, Objective, ObjectiveParams, check_form, flag
from .mlm import candidates_of, masked_ranks

# MDLM's log-linear schedule: alpha_t = 1 - (1 - delta) t with delta = 1e-3 (its LogLinearNoise), so that no token
# is masked with probability 1
LOG_LINEAR_DELTA = 1e-3
# name -> (masking probability m(t), the ELBO's weight m'(t) / m(t)); numpy in, numpy out
NOISE_SCHEDULES = {
    "linear": (lambda t: t, lambda t: 1.0 / t),
    "log_linear": (lambda t: (1.0 - LOG_LINEAR_DELTA) * t, lambda t: 1.0 / t),
    "cosine": (lambda t: 1.0 - np.cos(0.5 * np.pi * t),
               lambda t: 0.5 * np.pi * np.sin(0.5 * np.pi * t) / (1.0 - np.cos(0.5 * np.pi * t))),
}
DEFAULT_EPS = 1e-3  # MDLM's sampling_eps


def check_diffusion(noise_schedule: str, eps: float, low_discrepancy: bool, prefix: str = "") -> None:
    """A ValueError that names the parameter (``prefix`` "--": as the command line spells it)."""
    if noise_schedule not in NOISE_SCHEDULES:
        raise ValueError(f"{prefix}noise_schedule must be one of {tuple(NOISE_SCHEDULES)}, got {noise_schedule!r}")
    name = f"{prefix}diffusion_eps" if prefix else "eps"
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0.0 < float(eps) < 1.0:
        raise ValueError(f"{name} (the least time t) must lie strictly between 0 and 1, got {eps!r}")
    if not isinstance(low_discrepancy, bool):
        raise ValueError(f"{prefix}low_discrepancy must be true or false, got {low_discrepancy!r}")


def draw_times(rng: np.random.Generator, count: int, eps: float, low_discrepancy: bool,
               clip: tuple[float, float] = (0.0, 1.0)) -> np.ndarray:
    """``count`` times ``t ~ U(max(eps, lo), hi]`` (``clip = (lo, hi)``: BD3-LM's clipped schedule). Low-discrepancy:
    one time in each of ``count`` equal strata (MDLM's antithetic sampler), the strata in a random order."""
    u = rng.random(count)
    if low_discrepancy and count > 1:
        u = (u + rng.permutation(count)) / count
    lo, hi = max(float(eps), float(clip[0])), float(clip[1])
    return hi - (hi - lo) * u


def diffusion_draw(lengths, seq_len: int, times_of, num_condition_tokens: int, generator):
    """The masked-diffusion plan of a batch, before its weights are normalised: ``(inside, candidates, chosen,
    weights)``, (B, T) numpy. ``times_of(rng, batch, candidates)`` gives each position's time (B, T) and the
    schedule ``(m, w)``; a candidate is masked with probability ``m(t)``, and a masked one weighs ``w(t)``."""
    lengths = check_lengths(lengths, seq_len, num_condition_tokens)
    inside, candidates = candidates_of(lengths, seq_len, num_condition_tokens)
    rng = numpy_rng(generator)
    t, (mask_probability, weight) = times_of(rng, lengths.numel())
    chosen = candidates & (rng.random(candidates.shape) < mask_probability(t))
    weights = np.where(chosen, weight(t), 0.0)
    return inside, candidates, chosen, weights


def diffusion_plan(plan: Plan, candidates, chosen, weights, per_row: bool = False) -> Plan:
    """``plan`` (the ranks) with its loss weights: normalised so that the mean over the targets is the negative
    ELBO per maskable token of the batch (training, module doc); ``per_row``: each row's sum of ``weight *
    cross-entropy`` is its own negative ELBO per token (the ELBO protocol)."""
    counted = candidates.sum(1)
    if per_row:
        scale = np.where(counted > 0, 1.0 / np.maximum(counted, 1), 0.0)[:, None]
    else:
        scale = chosen.sum() / counted.sum() if counted.sum() else 0.0
    plan.loss_weights = torch.from_numpy((weights * scale).astype(np.float32))
    return plan


def mdlm_times(noise_schedule: str, eps: float, low_discrepancy: bool):
    """``times_of`` for :func:`diffusion_draw`: one time per sequence."""
    def times_of(rng, batch):
        return draw_times(rng, batch, eps, low_discrepancy)[:, None], NOISE_SCHEDULES[noise_schedule]
    return times_of


def plan(lengths, seq_len: int, noise_schedule: str = "linear", eps: float = DEFAULT_EPS,
         low_discrepancy: bool = True, num_condition_tokens: int = 0, generator=None) -> Plan:
    """MDLM: a time per sequence, each token after the prefix masked with probability ``m(t)`` (rank 1 above the
    visible tokens, the targets), weighted by ``m'(t) / m(t)`` (module doc)."""
    return _plan(lengths, seq_len, noise_schedule, eps, low_discrepancy, num_condition_tokens, generator)


def elbo_plan(lengths, seq_len: int, noise_schedule: str = "linear", eps: float = DEFAULT_EPS,
              low_discrepancy: bool = True, num_condition_tokens: int = 0, generator=None) -> Plan:
    """One Monte-Carlo sample of each row's negative ELBO per token: ``sum(loss_weights * cross-entropy)`` over the
    row's targets (the weights are per row, not per batch)."""
    return _plan(lengths, seq_len, noise_schedule, eps, low_discrepancy, num_condition_tokens, generator, per_row=True)


def _plan(lengths, seq_len, noise_schedule, eps, low_discrepancy, num_condition_tokens, generator, per_row=False):
    check_diffusion(noise_schedule, eps, low_discrepancy)
    inside, candidates, chosen, weights = diffusion_draw(
        lengths, seq_len, mdlm_times(noise_schedule, eps, low_discrepancy), num_condition_tokens, generator)
    ranks = masked_ranks(inside, candidates, chosen, num_condition_tokens)
    return diffusion_plan(ranks, candidates, chosen, weights, per_row)


def mask_form(input_ids: torch.Tensor, is_target: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The absorbing state: every masked token becomes ``[MASK]`` (no random or kept tokens, unlike BERT's)."""
    return torch.where(is_target, int(mask_token_id), input_ids)


def check_mask_token(tokenizer, form: str, objective: str) -> None:
    if form == SINGLE_STREAM and getattr(tokenizer, "mask_token_id", None) is None:
        raise ValueError(f"{objective}'s single-stream form replaces the masked tokens with [MASK], but the tokenizer "
                         "has no mask token; add one (tokenizer.add_special_tokens({'mask_token': '[MASK]'}) and "
                         "resize the embeddings), train one with `hf-lookaround train-tokenizer`, or use "
                         "form='two_stream', which needs none")


@dataclass
class DiffusionParams(ObjectiveParams):
    """The flags of the diffusion objectives (mdlm, bd3lm)."""

    masked_form: str = flag(TWO_STREAM, help="mlm/vmlm/span/mdlm/bd3lm: two_stream or single_stream ([MASK]; bd3lm: "
                                             "BD3-LM's x_t ⊕ x_0 layout)")
    noise_schedule: str = flag("linear", help=f"mdlm/bd3lm: the noise schedule, one of {tuple(NOISE_SCHEDULES)} "
                                              "(linear: mask with probability t, weight 1/t)")
    diffusion_eps: float = flag(DEFAULT_EPS, help="mdlm/bd3lm: the least time t (t ~ U(eps, 1]; MDLM: 1e-3)")
    low_discrepancy: bool = flag(True, help="mdlm/bd3lm: stratify the batch's times over (eps, 1] (MDLM's "
                                            "antithetic sampler); false: independent times")

    def __post_init__(self):
        check_form("masked_form", self.masked_form)
        check_diffusion(self.noise_schedule, self.diffusion_eps, self.low_discrepancy, prefix="--")

    def plan_params(self) -> dict:
        return {"noise_schedule": self.noise_schedule, "eps": float(self.diffusion_eps),
                "low_discrepancy": self.low_discrepancy}

    def collator_params(self) -> dict:
        return {**self.plan_params(), "form": self.masked_form}

    def config_fields(self) -> dict:
        # what diffusion decoding reads: the block the plan denoises (0: one block of every new token)
        return {**super().config_fields(), "diffusion_block_size": int(self.plan_params().get("diffusion_block", 0))}

    @property
    def form(self) -> str:
        return self.masked_form


@dataclass
class Params(DiffusionParams):
    SPEC = "mdlm:SCHEDULE"

    @classmethod
    def from_spec(cls, arg: str) -> "Params":
        return cls(noise_schedule=arg or "linear")


@dataclass
class MaskedDiffusionCollator(PlanCollator):
    """MDLM's batches: ``form="two_stream"`` (inputs unchanged, the masked tokens at the higher rank, for
    ``LookAroundForPreTraining``) or ``"single_stream"`` (every masked token ``[MASK]``, for
    ``LookAroundForMaskedLM``); both carry ``loss_weights``, the weight of each label (module doc)."""

    noise_schedule: str = "linear"
    eps: float = DEFAULT_EPS
    low_discrepancy: bool = True
    form: str = TWO_STREAM
    objective = "mdlm"
    plan_function = staticmethod(plan)

    def __post_init__(self):
        check_diffusion(self.noise_schedule, self.eps, self.low_discrepancy)
        check_form("form", self.form)
        check_mask_token(self.tokenizer, self.form, self.objective)

    def plan_params(self):
        return {"noise_schedule": self.noise_schedule, "eps": float(self.eps), "low_discrepancy": self.low_discrepancy}

    def _finish(self, input_ids, attention_mask, plan, generator):
        if self.form == TWO_STREAM:
            return super()._finish(input_ids, attention_mask, plan, generator)
        return {"input_ids": mask_form(input_ids, plan.is_target, self.tokenizer.mask_token_id), "attention_mask": attention_mask,
                "labels": torch.where(plan.is_target, input_ids, -100), "loss_weights": plan.loss_weights}


OBJECTIVE = Objective(
    name="mdlm",
    family=MASKED,
    title="masked diffusion (MDLM)",
    card_text="a time `t ~ U(eps, 1]` per sequence; each token is masked with the noise schedule's probability (`t` "
              "for the linear one), unmasked tokens have rank 0, masked tokens rank 1, and each masked token's loss "
              "is weighted by the schedule's `m'(t) / m(t)` (`1 / t`), so the loss is the negative ELBO per token "
              "(MDLM).",
    Params=Params,
    plan=plan,
    collator=MaskedDiffusionCollator,
    presets={"mdlm": ("masked diffusion (MDLM), linear schedule", {"noise_schedule": "linear"})},
    single_stream_head=MASKED_HEAD,
    elbo_plan=elbo_plan,
)
