"""The image collator: stacks images and draws a plan over ``[CLS, conditions, patches]`` with the text
collators' plan parameters and seeding (masked, variable-masked, GVP); the prefix is the rank-0 condition.
With ``class_conditional`` it also emits ``class_labels`` (a fraction dropped to -1, no class).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .. import objectives, plans
from . import collators

logger = logging.getLogger(__name__)



# the objectives with image defaults in the objectives table (DESIGN: masking of images draws from U[0.5, 0.75])
IMAGE_OBJECTIVES = objectives.names(images=True)
DEFAULT_IMAGE_PLAN_PARAMS = {name: dict(objectives.OBJECTIVES[name].image_defaults) for name in IMAGE_OBJECTIVES}


def image_plan(objective: str, batch_size: int, num_patches: int, generator=None, num_prefix_tokens: int = 1,
               **params) -> plans.Plan:
    """A plan over ``[CLS, conditions, patches]`` (``num_patches + num_prefix_tokens`` positions): the prefix
    (CLS and any condition tokens) is the rank-0 condition."""
    if objective not in IMAGE_OBJECTIVES:
        raise ValueError(f"image objectives are {IMAGE_OBJECTIVES}, got {objective!r}")
    seq_len = num_patches + num_prefix_tokens
    return objectives.make_plan(objective, [seq_len] * batch_size, seq_len, generator=generator,
                           num_condition_tokens=num_prefix_tokens, **params)


@dataclass
class ImagePlanCollator:
    """Stacks ``pixel_values`` and draws the plan of ``plan_collator`` (a `VariableMaskedCollator`,
    `MaskedCollator` or `GVPCollator`: its objective, parameters, per-batch seeding and ``set_epoch``)
    over ``[CLS, conditions, patches]``. Emits ``pixel_values``, ``group_ids`` (B, T) and
    ``target_positions`` (B, M); with ``class_conditional``, ``class_labels`` (B,) from the examples'
    ``labels``, each replaced by -1 (no class) with probability ``class_dropout``."""

    plan_collator: collators.PlanCollator
    num_patches: int
    num_prefix_tokens: int = 1
    class_conditional: bool = False
    class_dropout: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.class_dropout < 1.0:
            raise ValueError(f"class_dropout must lie in [0, 1), got {self.class_dropout}")

    def set_epoch(self, epoch: int) -> None:
        self.plan_collator.set_epoch(epoch)

    def __call__(self, features) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        pixels = torch.stack([torch.as_tensor(f["pixel_values"], dtype=torch.float32) for f in features])
        lengths = torch.full((len(features),), self.num_patches + self.num_prefix_tokens)
        generator = self.plan_collator._batch_generator(pixels, lengths)
        plan = image_plan(self.plan_collator.objective, len(features), self.num_patches, generator=generator,
                          num_prefix_tokens=self.num_prefix_tokens, **self.plan_collator.plan_params())
        batch = {"pixel_values": pixels, "group_ids": plan.group_ids,
                 "target_positions": plan.target_positions(self.plan_collator.pad_targets_to)}
        if self.class_conditional:
            if any("labels" not in f for f in features):
                raise ValueError("a class-conditional collator needs the class of every image: examples need 'labels'")
            labels = torch.as_tensor([int(f["labels"]) for f in features], dtype=torch.long)
            dropped = torch.rand(len(features), generator=generator) < self.class_dropout
            batch["class_labels"] = torch.where(dropped, -1, labels)
        return batch


def make_image_collator(objective: str, num_patches: int, seed: int = 0, num_prefix_tokens: int = 1,
                        class_conditional: bool = False, class_dropout: float = 0.0, **params) -> ImagePlanCollator:
    """The image collator of ``objective`` (``gvp``, ``vmlm``, ``mlm``); unset parameters take the image
    defaults (vmlm ratio in U[0.5, 0.75], mlm 0.75, GVP K=20 mixed)."""
    if objective not in IMAGE_OBJECTIVES:
        raise ValueError(f"image objectives are {IMAGE_OBJECTIVES}, got {objective!r}")
    params = {**DEFAULT_IMAGE_PLAN_PARAMS[objective], **params}
    return ImagePlanCollator(objectives.make_collator(objective, seed=seed, **params), num_patches,
                             num_prefix_tokens, class_conditional, class_dropout)
