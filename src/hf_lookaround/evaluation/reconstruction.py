"""Reconstruction L2 of masked images (paper (a) Table 8, paper (b) Table 8): :func:`reconstruction_l2` is the mean
squared error of the predicted target patches, per group. ``teacher_forced``: each group is predicted from
the true lower groups (one forward). ``generative``: groups are predicted one after the other, each from the
model's own predictions of the lower groups (one forward per group); the first group, the condition G0, is
always the true image. For a masked plan (one target group) both are the same. Visual-token models (p2d, d2d)
are scored on the decoded tokens: the codebook centroid of the predicted id against the per-patch normalised
true patch (the space the codebook lives in).
"""

from __future__ import annotations

import argparse
import logging

import torch

from .. import plans
from ..data.image_collator import DEFAULT_IMAGE_PLAN_PARAMS, image_plan
from ..models.lookaround.modeling_lookaround_vit import (
    LookAroundViTForPreTraining,
    encode_patches,
    normalise_patches,
    patchify,
    unpatchify,
)
from .image_probing import no_class_labels

logger = logging.getLogger(__name__)



def uses_codebook(config) -> bool:
    return bool(getattr(config, "uses_codebook", False))


def reconstruction_space(config) -> str:
    """The space :func:`reconstruction_l2` measures errors in, for a model of ``config``."""
    if uses_codebook(config) or config.norm_pix_loss:
        return "per-patch normalised patches"
    return "pixel_values (the processor's normalised pixels)"


def _true_patches(model, x):
    """(b, N, P) true patches in the space of the error: the regression target of a pixel model, the
    per-patch normalised patch of a visual-token model (what its codebook centroids approximate)."""
    if uses_codebook(model.config):
        return normalise_patches(patchify(x.float(), model.config.patch_size))
    return model.target_patches(x)


@torch.inference_mode()
def reconstruction_l2(model: LookAroundViTForPreTraining, images: torch.Tensor, plan: plans.Plan | None = None,
                      objective: str = "gvp", plan_params: dict | None = None, mode: str = "teacher_forced",
                      seed: int = 0, batch_size: int = 256, class_labels: torch.Tensor | None = None) -> dict:
    """Mean squared error per value of the predicted target patches, overall and per target group.

    ``plan``: one plan for all ``images`` (``(N, config.sequence_length)``, the prefix rank 0); default:
    drawn with ``objective``/``plan_params`` from ``seed`` (the same plan every call). Groups are numbered by
    rank relative to the visible patches: G0 (the condition) is 0, targets are groups 1..K. Errors are in
    the space the model regresses: ``pixel_values``, or per-patch normalised patches with ``norm_pix_loss``.
    A visual-token model (p2d, d2d) is scored on the centroid of its most likely id against the per-patch
    normalised true patch; ``codebook_l2`` is the same error of the nearest centroid (the best any id can
    do), ``token_accuracy`` the fraction of predicted ids equal to the true patch's id, and
    ``expected_centroid_l2`` the error of the softmax-weighted mean of the centroids (the decode with the least
    expected squared error under the model's distribution; an argmax decode pays for every wrong guess).
    ``class_labels`` (N,): the condition of a class-conditional model (default: -1, no class).
    """
    if mode not in ("teacher_forced", "generative"):
        raise ValueError(f"mode must be 'teacher_forced' or 'generative', got {mode!r}")
    config = model.config
    codebook = uses_codebook(config) and not getattr(model, "predicts_patches", False)
    if mode == "generative" and (config.norm_pix_loss or uses_codebook(config)):
        raise ValueError("generative reconstruction writes predictions back as pixels; this model predicts "
                         "normalised patches or visual tokens: use mode='teacher_forced'")
    prefix = getattr(config, "num_prefix_tokens", 1)
    n = len(images)
    plan = _reconstruction_plan(plan, n, config.num_patches, prefix, objective, plan_params, seed)
    model.eval()
    device = next(model.parameters(), images).device
    sq_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    floor_sum, expected_sum, hits = 0.0, 0.0, 0
    for start in range(0, n, batch_size):
        x, ranks, slots, extra = _batch_inputs(images, plan, class_labels, config, start, batch_size, device)
        truth = _target_truth(model, x, slots, prefix)
        if codebook:
            pred, floor, expected, hit = _decode_visual_tokens(model, x, ranks, slots, extra, truth, prefix)
            floor_sum, expected_sum, hits = floor_sum + floor, expected_sum + expected, hits + hit
        else:
            pred = _predict_targets(model, x, ranks, slots, mode, prefix, extra)  # (b, M, P)
        _add_group_errors(sq_sum, count, pred, truth, ranks, slots, prefix)
    groups = sorted(count)
    total = max(1, sum(count.values()))
    out = {
        "mode": mode,
        "space": reconstruction_space(config),
        "l2": sum(sq_sum.values()) / total,
        "l2_per_group": {str(g): sq_sum[g] / count[g] for g in groups},
        "patches_per_group": {str(g): count[g] for g in groups},
        "num_images": n,
    }
    if codebook:
        out.update(decoded="visual_codebook[argmax id]", codebook_l2=floor_sum / total, token_accuracy=hits / total,
                   expected_centroid_l2=expected_sum / total)
    return out


def _reconstruction_plan(plan, n: int, num_patches: int, prefix: int, objective, plan_params, seed: int):
    """The plan of the ``n`` images: the one given (checked to cover them), else drawn from ``seed``."""
    if plan is None:
        params = {**DEFAULT_IMAGE_PLAN_PARAMS.get(objective, {}), **(plan_params or {})}
        plan = image_plan(objective, n, num_patches, generator=torch.Generator().manual_seed(seed),
                          num_prefix_tokens=prefix, **params)
    if tuple(plan.group_ids.shape) != (n, num_patches + prefix):
        raise ValueError(f"plan must cover {n} images x {num_patches + prefix} positions, got "
                         f"{tuple(plan.group_ids.shape)}")
    return plan


def _batch_inputs(images, plan, class_labels, config, start: int, batch_size: int, device):
    """One batch on ``device``: images, group ranks, target slots (-1 pads) and the condition inputs."""
    x = images[start : start + batch_size].to(device)
    ranks = plan.group_ids[start : start + batch_size].to(device)
    slots = plans.target_positions_from_mask(plan.is_target[start : start + batch_size]).to(device)
    extra = no_class_labels(config, len(x), device)
    if class_labels is not None and extra:
        extra = {"class_labels": class_labels[start : start + batch_size].to(device)}
    return x, ranks, slots, extra


def _target_truth(model, x, slots, prefix: int) -> torch.Tensor:
    """(b, M, P) the true patches at the target slots, in the space of the error."""
    index = (slots - prefix).clamp(min=0)
    truth_all = _true_patches(model, x)
    return truth_all.gather(1, index[..., None].expand(-1, -1, truth_all.shape[-1]))


def _decode_visual_tokens(model, x, ranks, slots, extra, truth, prefix: int):
    """A visual-token model's prediction (the centroid of its most likely id) and, summed over the batch's targets,
    the nearest centroid's error, the expected-centroid error and the ids it got right."""
    logits = model(pixel_values=x, group_ids=ranks, target_positions=slots, **extra).logits
    centroids = model.vit.visual_codebook.float()
    pred = centroids[logits.argmax(-1)]
    nearest = encode_patches(truth, centroids)  # the true patch's visual token
    floor = ((centroids[nearest] - truth) ** 2).mean(-1)
    # the prediction that minimises the expected squared error under the model's distribution
    expected = ((logits.float().softmax(-1) @ centroids - truth) ** 2).mean(-1)
    valid = slots >= prefix
    return (pred, float(floor[valid].sum()), float(expected[valid].sum()),
            int((logits.argmax(-1) == nearest)[valid].sum()))


def _add_group_errors(sq_sum: dict, count: dict, pred, truth, ranks, slots, prefix: int) -> None:
    """Add the batch's squared errors and target counts to those of each group (its rank above the lowest patch's)."""
    err = ((pred.float() - truth) ** 2).mean(-1)  # (b, M) per patch
    group = ranks.gather(1, slots.clamp(min=0)) - ranks[:, prefix:].amin(-1, keepdim=True)
    valid = slots >= prefix
    for g in group[valid].unique().tolist():
        sel = valid & (group == g)
        sq_sum[g] = sq_sum.get(g, 0.0) + float(err[sel].sum())
        count[g] = count.get(g, 0) + int(sel.sum())


def _predict_targets(model, x, ranks, slots, mode, prefix=1, extra=None):
    extra = extra or {}
    if mode == "teacher_forced":
        return model(pixel_values=x, group_ids=ranks, target_positions=slots, **extra).logits.float()
    # generative: blank every target patch, then fill the groups in rank order with the model's own
    # predictions; the prediction of group r reads only patches of rank < r, which are filled by then
    p, c = model.config.patch_size, model.config.num_channels
    patch_rank = ranks[:, prefix:]
    # padded slots (-1) mark position 0, the CLS token: the prefix positions are dropped
    is_target_patch = torch.zeros_like(ranks, dtype=torch.bool).scatter(1, slots.clamp(min=0), True)[:, prefix:]
    canvas = patchify(x.float(), p) * ~is_target_patch[..., None]
    pred = None
    for r in patch_rank[is_target_patch].unique().sort().values.tolist():
        out = model(pixel_values=unpatchify(canvas, p, c), group_ids=ranks, target_positions=slots,
                    **extra).logits.float()
        # the slots' predictions laid out per position (padded slots land on CLS, position 0, and are dropped)
        per_patch = out.new_zeros(len(x), ranks.shape[1], out.shape[-1]).scatter(
            1, slots.clamp(min=0)[..., None].expand_as(out), out)[:, prefix:]
        canvas = torch.where(((patch_rank == r) & is_target_patch)[..., None], per_patch, canvas)
        slot_rank = torch.where(slots >= prefix, ranks.gather(1, slots.clamp(min=0)), -1)
        pred = out if pred is None else torch.where((slot_rank == r)[..., None], out, pred)
    return pred


class MeanPatchPredictor(torch.nn.Module):
    """Predicts every target patch as the mean of the training images' patches at that position, in the
    space of the error (a reconstruction baseline)."""

    predicts_patches = True

    def __init__(self, model, train_images, batch_size: int = 1024):
        super().__init__()
        self.config = model.config
        self.target_patches = lambda x: _true_patches(model, x)
        with torch.inference_mode():
            total = sum(_true_patches(model, train_images[i : i + batch_size]).sum(0)
                        for i in range(0, len(train_images), batch_size))
        self.register_buffer("mean_patches", (total / len(train_images))[None])

    def forward(self, pixel_values, group_ids, target_positions, **kwargs):
        prefix = getattr(self.config, "num_prefix_tokens", 1)
        idx = (target_positions - prefix).clamp(min=0)
        patches = self.mean_patches.expand(len(pixel_values), -1, -1)
        return argparse.Namespace(logits=patches.gather(1, idx[..., None].expand(-1, -1, patches.shape[-1])))
