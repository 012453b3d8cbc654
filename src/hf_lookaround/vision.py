"""Vision: pretrain the two-stream ViT on Fashion-MNIST and evaluate it (``hf-lookaround vision``).

- :func:`load_fashion_mnist`: the four original IDX files from a local folder.
- :class:`ImagePlanCollator`: stacks images and draws a plan over ``[CLS, patches]`` with the text
  collators' plan parameters and seeding (masked, variable-masked, GVP); CLS is the rank-0 condition.
- :func:`linear_probe_images`: frozen pooled features + logistic regression
  (:func:`hf_lookaround.evaluation.probing.linear_probe`); ``model=None`` probes raw pixels.
- :func:`reconstruction_l2`: mean squared pixel error of the predicted target patches, per group
  (paper (a) Table 8, paper (b) Table 8). ``teacher_forced``: each group is predicted from the true
  lower groups (one forward). ``generative``: groups are predicted one after the other, each from
  the model's own predictions of the lower groups (one forward per group); the first group, the
  condition G0, is always the true image. For a masked plan (one target group) both are the same.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import collators, plans
from .configuration_lookaround_vit import LookAroundViTConfig
from .modeling_lookaround_vit import (
    LookAroundViTForImageClassification,
    LookAroundViTForPreTraining,
    LookAroundViTModel,
    patchify,
    unpatchify,
)

logger = logging.getLogger(__name__)

__all__ = [
    "IMAGE_OBJECTIVES",
    "FASHION_MNIST_CLASSES",
    "load_fashion_mnist",
    "ImageDataset",
    "ImagePlanCollator",
    "make_image_collator",
    "image_plan",
    "extract_image_features",
    "linear_probe_images",
    "reconstruction_l2",
    "main",
]

IMAGE_OBJECTIVES = ("gvp", "vmlm", "mlm")
# DESIGN: variable-length masking of images draws the ratio from U[0.5, 0.75]
DEFAULT_IMAGE_PLAN_PARAMS = {"vmlm": {"mask_ratio_range": (0.5, 0.75)}, "mlm": {"mask_ratio": 0.75},
                             "gvp": {"num_groups": 20, "segmentation": "mixed"}}
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}


# --------------------------------------------------------------------------------------------- data
def load_fashion_mnist(folder, split: str = "train", limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 28, 28)`` float32 in [0, 1] and labels ``(N,)`` long from the original IDX files."""
    if split not in _FILES:
        raise ValueError(f"split must be one of {tuple(_FILES)}, got {split!r}")
    folder = Path(folder)
    paths = [folder / name for name in _FILES[split]]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST files not found: {missing}; pass the folder holding the four "
                                f"original IDX .gz files (train-images-idx3-ubyte.gz, ...)")
    pixels = np.frombuffer(gzip.open(paths[0]).read(), np.uint8, offset=16)  # IDX header: 16 bytes
    labels = np.frombuffer(gzip.open(paths[1]).read(), np.uint8, offset=8)  # IDX header: 8 bytes
    if pixels.size != labels.size * 28 * 28:
        raise ValueError(f"{paths[0]} holds {pixels.size} pixels for {labels.size} labels; the files do not match")
    n = labels.size if limit is None else min(int(limit), labels.size)
    images = torch.from_numpy(pixels[: n * 784].reshape(n, 1, 28, 28).astype(np.float32) / 255.0)
    return images, torch.from_numpy(labels[:n].astype(np.int64))


class ImageDataset(torch.utils.data.Dataset):
    """``{"pixel_values": (C, H, W)}`` (and ``"labels"`` when given) per example, for ``Trainer``."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None = None):
        if labels is not None and len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        item = {"pixel_values": self.images[i]}
        if self.labels is not None:
            item["labels"] = self.labels[i]
        return item


# --------------------------------------------------------------------------------------------- plans
def image_plan(objective: str, batch_size: int, num_patches: int, generator=None, **params) -> plans.Plan:
    """A plan over ``[CLS, patches]`` (``num_patches + 1`` positions): CLS is a rank-0 condition token."""
    if objective not in IMAGE_OBJECTIVES:
        raise ValueError(f"image objectives are {IMAGE_OBJECTIVES}, got {objective!r}")
    seq_len = num_patches + 1
    return plans.make_plan(objective, [seq_len] * batch_size, seq_len, generator=generator,
                           num_condition_tokens=1, **params)


@dataclass
class ImagePlanCollator:
    """Stacks ``pixel_values`` and draws the plan of ``plan_collator`` (a `VariableMaskedCollator`,
    `MaskedCollator` or `GVPCollator`: its objective, parameters, per-batch seeding and ``set_epoch``)
    over ``[CLS, patches]``. Emits ``pixel_values``, ``group_ids`` (B, N+1) and ``target_positions`` (B, M)."""

    plan_collator: collators.PlanCollator
    num_patches: int

    def set_epoch(self, epoch: int) -> None:
        self.plan_collator.set_epoch(epoch)

    def __call__(self, features) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("cannot collate an empty batch")
        pixels = torch.stack([torch.as_tensor(f["pixel_values"], dtype=torch.float32) for f in features])
        lengths = torch.full((len(features),), self.num_patches + 1)
        generator = self.plan_collator._batch_generator(pixels, lengths)
        plan = image_plan(self.plan_collator.objective, len(features), self.num_patches, generator=generator,
                          **self.plan_collator.plan_params())
        return {"pixel_values": pixels, "group_ids": plan.group_ids,
                "target_positions": plan.target_positions(self.plan_collator.pad_targets_to)}


def make_image_collator(objective: str, num_patches: int, seed: int = 0, **params) -> ImagePlanCollator:
    """The image collator of ``objective`` (``gvp``, ``vmlm``, ``mlm``); unset parameters take the image
    defaults (vmlm ratio in U[0.5, 0.75], mlm 0.75, GVP K=20 mixed)."""
    if objective not in IMAGE_OBJECTIVES:
        raise ValueError(f"image objectives are {IMAGE_OBJECTIVES}, got {objective!r}")
    params = {**DEFAULT_IMAGE_PLAN_PARAMS[objective], **params}
    return ImagePlanCollator(collators.make_collator(objective, seed=seed, **params), num_patches)


# --------------------------------------------------------------------------------------------- evaluation
def _vit(model) -> LookAroundViTModel:
    return model if isinstance(model, LookAroundViTModel) else model.vit


@torch.inference_mode()
def extract_image_features(model, images: torch.Tensor, batch_size: int = 256) -> np.ndarray:
    """Frozen pooled features ``(N, hidden)`` (``config.classifier_pooling``), single-stream bidirectional."""
    vit = _vit(model).eval()
    device = next(vit.parameters()).device
    feats = [vit(images[i : i + batch_size].to(device)).pooler_output.float().cpu()
             for i in range(0, len(images), batch_size)]
    return torch.cat(feats).numpy()


def linear_probe_images(model, images, labels, test_images=None, test_labels=None, validation_fraction: float = 0.2,
                        seed: int = 0, batch_size: int = 256) -> dict:
    """Logistic regression on frozen features (``model=None``: raw pixels); ``C`` picked on a held-out
    ``validation_fraction`` of ``images``; test accuracy on ``test_images`` if given."""
    from .evaluation.probing import linear_probe

    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction}")

    def featurise(x):
        return x.flatten(1).numpy() if model is None else extract_image_features(model, x, batch_size)

    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, int(round(validation_fraction * len(images))))
    val, train = order[:n_val], order[n_val:]
    feats = featurise(images)
    test_feats = featurise(test_images) if test_images is not None else None
    labels = np.asarray(labels)
    return linear_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()], labels[val.numpy()],
                        test_feats, None if test_labels is None else np.asarray(test_labels), seed=seed)


@torch.inference_mode()
def reconstruction_l2(model: LookAroundViTForPreTraining, images: torch.Tensor, plan: plans.Plan | None = None,
                      objective: str = "gvp", plan_params: dict | None = None, mode: str = "teacher_forced",
                      seed: int = 0, batch_size: int = 256) -> dict:
    """Mean squared error per pixel of the predicted target patches, overall and per target group.

    ``plan``: one plan for all ``images`` (``(N, num_patches + 1)``, CLS rank 0); default: drawn with
    ``objective``/``plan_params`` from ``seed`` (the same plan every call). Groups are numbered by rank
    relative to the visible patches: G0 (the condition) is 0, targets are groups 1..K. Errors are in the
    space the model regresses: pixels in [0, 1], or per-patch normalised pixels with ``norm_pix_loss``.
    """
    if mode not in ("teacher_forced", "generative"):
        raise ValueError(f"mode must be 'teacher_forced' or 'generative', got {mode!r}")
    config = model.config
    if mode == "generative" and config.norm_pix_loss:
        raise ValueError("generative reconstruction writes predictions back as pixels; a norm_pix_loss model "
                         "predicts normalised patches: use mode='teacher_forced'")
    n, num_patches = len(images), config.num_patches
    if plan is None:
        params = {**DEFAULT_IMAGE_PLAN_PARAMS.get(objective, {}), **(plan_params or {})}
        plan = image_plan(objective, n, num_patches, generator=torch.Generator().manual_seed(seed), **params)
    if tuple(plan.group_ids.shape) != (n, num_patches + 1):
        raise ValueError(f"plan must cover {n} images x {num_patches + 1} positions, got {tuple(plan.group_ids.shape)}")
    model.eval()
    device = next(model.parameters(), images).device
    sq_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    for start in range(0, n, batch_size):
        x = images[start : start + batch_size].to(device)
        ranks = plan.group_ids[start : start + batch_size].to(device)
        slots = plans.target_positions_from_mask(plan.is_target[start : start + batch_size]).to(device)
        pred = _predict_targets(model, x, ranks, slots, mode)  # (b, M, P)
        truth = model.target_patches(x).gather(1, (slots - 1).clamp(min=0)[..., None].expand_as(pred))
        err = ((pred.float() - truth) ** 2).mean(-1)  # (b, M) per patch
        group = ranks.gather(1, slots.clamp(min=0)) - ranks[:, 1:].amin(-1, keepdim=True)
        for g in group[slots >= 1].unique().tolist():
            sel = (slots >= 1) & (group == g)
            sq_sum[g] = sq_sum.get(g, 0.0) + float(err[sel].sum())
            count[g] = count.get(g, 0) + int(sel.sum())
    groups = sorted(count)
    return {
        "mode": mode,
        "space": "normalised patches" if config.norm_pix_loss else "pixels in [0, 1]",
        "l2": sum(sq_sum.values()) / max(1, sum(count.values())),
        "l2_per_group": {str(g): sq_sum[g] / count[g] for g in groups},
        "patches_per_group": {str(g): count[g] for g in groups},
        "num_images": n,
    }


def _predict_targets(model, x, ranks, slots, mode):
    if mode == "teacher_forced":
        return model(pixel_values=x, group_ids=ranks, target_positions=slots).logits.float()
    # generative: blank every target patch, then fill the groups in rank order with the model's own
    # predictions; the prediction of group r reads only patches of rank < r, which are filled by then
    p, c = model.config.patch_size, model.config.num_channels
    patch_rank = ranks[:, 1:]
    # padded slots (-1) mark position 0, the CLS token, which is dropped
    is_target_patch = torch.zeros_like(ranks, dtype=torch.bool).scatter(1, slots.clamp(min=0), True)[:, 1:]
    canvas = patchify(x.float(), p) * ~is_target_patch[..., None]
    pred = None
    for r in patch_rank[is_target_patch].unique().sort().values.tolist():
        out = model(pixel_values=unpatchify(canvas, p, c), group_ids=ranks, target_positions=slots).logits.float()
        # the slots' predictions laid out per position (padded slots land on CLS, position 0, and are dropped)
        per_patch = out.new_zeros(len(x), patch_rank.shape[1] + 1, out.shape[-1]).scatter(
            1, slots.clamp(min=0)[..., None].expand_as(out), out)[:, 1:]
        canvas = torch.where(((patch_rank == r) & is_target_patch)[..., None], per_patch, canvas)
        slot_rank = torch.where(slots >= 1, ranks.gather(1, slots.clamp(min=0)), -1)
        pred = out if pred is None else torch.where((slot_rank == r)[..., None], out, pred)
    return pred


# --------------------------------------------------------------------------------------------- command
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lookaround vision", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="folder with the four Fashion-MNIST IDX .gz files")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--objective", choices=IMAGE_OBJECTIVES, default="gvp")
    p.add_argument("--num_groups", type=int, default=20, help="GVP: K")
    p.add_argument("--segmentation", choices=plans.SEGMENTATIONS, default="mixed", help="GVP segmentation")
    p.add_argument("--mask_ratio_range", type=float, nargs=2, default=(0.5, 0.75), help="vmlm: U[a, b]")
    p.add_argument("--mask_ratio", type=float, default=0.75, help="mlm: fixed ratio")
    p.add_argument("--patch_size", type=int, default=4)
    p.add_argument("--hidden_size", type=int, default=64)
    p.add_argument("--num_hidden_layers", type=int, default=4)
    p.add_argument("--num_attention_heads", type=int, default=4)
    p.add_argument("--intermediate_size", type=int, default=256)
    p.add_argument("--position_embedding_type", choices=("absolute", "rope"), default="absolute")
    p.add_argument("--norm_pix_loss", action="store_true")
    p.add_argument("--num_train", type=int, default=5000, help="pretraining images (first N of the train split)")
    p.add_argument("--max_steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--num_probe_train", type=int, default=2000, help="probe fit+validation images (train split)")
    p.add_argument("--num_test", type=int, default=2000, help="test images (first N of the test split)")
    p.add_argument("--finetune_steps", type=int, default=0,
                   help="also fine-tune the pretrained model and one trained from scratch on the probe images")
    p.add_argument("--attn_implementation", default="sdpa", choices=("eager", "sdpa", "flex_attention"))
    p.add_argument("--dataloader_num_workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p


def _plan_params(args) -> dict:
    if args.objective == "gvp":
        return {"num_groups": args.num_groups, "segmentation": args.segmentation}
    if args.objective == "vmlm":
        return {"mask_ratio_range": tuple(args.mask_ratio_range)}
    return {"mask_ratio": args.mask_ratio}


def _training_args(output_dir, args, steps):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20), logging_steps=max(1, steps // 10), save_strategy="no",
        report_to="none", seed=args.seed, dataloader_num_workers=args.dataloader_num_workers,
        remove_unused_columns=False, disable_tqdm=True,
    )


def _finetune(model, args, images, labels, test_images, test_labels, output_dir) -> float:
    from transformers import Trainer

    model.set_attn_implementation(args.attn_implementation)
    Trainer(model=model, args=_training_args(output_dir, args, args.finetune_steps),
            train_dataset=ImageDataset(images, labels)).train()
    model.eval()
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = torch.cat([model(pixel_values=test_images[i : i + 256].to(device)).logits.cpu()
                            for i in range(0, len(test_images), 256)])
    return float((logits.argmax(-1) == test_labels).float().mean())


def main(argv: list[str] | None = None) -> int:
    """`hf-lookaround vision`: pretrain a tiny ViT on Fashion-MNIST; reconstruct, probe and (optionally) fine-tune."""
    from transformers import Trainer, set_seed

    from .pretraining import CollatorEpochCallback

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    set_seed(args.seed)

    train_images, train_labels = load_fashion_mnist(args.data, "train")
    test_images, test_labels = load_fashion_mnist(args.data, "test", limit=args.num_test)
    pre_images = train_images[: args.num_train]
    # the probe (and fine-tuning) uses train images the pretraining did not see
    probe_images = train_images[args.num_train : args.num_train + args.num_probe_train]
    probe_labels = train_labels[args.num_train : args.num_train + args.num_probe_train]

    params = _plan_params(args)
    config = LookAroundViTConfig(
        image_size=28, patch_size=args.patch_size, num_channels=1, hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size, position_embedding_type=args.position_embedding_type,
        norm_pix_loss=args.norm_pix_loss, objective=args.objective, plan_params=params,
        num_labels=10, id2label=dict(enumerate(FASHION_MNIST_CLASSES)),
    )
    collator = make_image_collator(args.objective, config.num_patches, seed=args.seed, **params)
    model = LookAroundViTForPreTraining(config)
    model.set_attn_implementation(args.attn_implementation)
    scratch = LookAroundViTForPreTraining(config)  # the same initialisation scheme, never trained
    trainer = Trainer(model=model, args=_training_args(out / "trainer", args, args.max_steps),
                      train_dataset=ImageDataset(pre_images), data_collator=collator,
                      callbacks=[CollatorEpochCallback(collator)])
    train_result = trainer.train()
    model.save_pretrained(out)

    results = {
        "objective": args.objective,
        "plan_params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
        "num_parameters": model.num_parameters(), "num_pretrain_images": len(pre_images),
        "max_steps": args.max_steps, "train_loss": train_result.training_loss,
        "seconds": {"pretraining": train_result.metrics.get("train_runtime")},
    }
    path = out / "vision_results.json"

    def stage(name, compute):
        # results are written after every stage, so a run stopped part-way keeps what it measured
        start = time.perf_counter()
        results[name] = compute()
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(results, indent=2))
        logger.info("%s: %s", name, json.dumps(results[name])[:400])

    # reconstruction: the same plans (seeded) in both modes; predicting the mean training image is the baseline
    def reconstruct():
        modes = ("teacher_forced",) if args.norm_pix_loss else ("teacher_forced", "generative")
        recon = {mode: reconstruction_l2(model, test_images, objective=args.objective, plan_params=params, mode=mode,
                                         seed=args.seed) for mode in modes}
        if not args.norm_pix_loss:
            mean_model = _MeanImagePredictor(model, pre_images.mean(0, keepdim=True))
            recon["mean_image_baseline"] = reconstruction_l2(mean_model, test_images, objective=args.objective,
                                                             plan_params=params, seed=args.seed)
        return recon

    stage("reconstruction_l2", reconstruct)
    # probes: pretrained features, the same architecture untrained, raw pixels
    stage("linear_probe", lambda: {
        name: linear_probe_images(m, probe_images, probe_labels, test_images, test_labels,
                                  seed=args.seed)["test_accuracy"]
        for name, m in (("pretrained", model), ("random_init", scratch), ("raw_pixels", None))
    })
    if args.finetune_steps:
        stage("finetune_test_accuracy", lambda: {
            "pretrained": _finetune(LookAroundViTForImageClassification.from_pretrained(out), args, probe_images,
                                    probe_labels, test_images, test_labels, out / "ft"),
            "from_scratch": _finetune(LookAroundViTForImageClassification(LookAroundViTConfig.from_pretrained(out)),
                                      args, probe_images, probe_labels, test_images, test_labels, out / "ft_scratch"),
        })
    print(json.dumps(results, indent=2))
    return 0


class _MeanImagePredictor(torch.nn.Module):
    """Predicts every target patch as the same patch of the mean training image (a reconstruction baseline)."""

    def __init__(self, model, mean_image):
        super().__init__()
        self.config, self.target_patches = model.config, model.target_patches
        self.register_buffer("mean_patches", model.target_patches(mean_image))

    def forward(self, pixel_values, group_ids, target_positions):
        idx = (target_positions - 1).clamp(min=0)
        patches = self.mean_patches.expand(len(pixel_values), -1, -1)
        return argparse.Namespace(logits=patches.gather(1, idx[..., None].expand(-1, -1, patches.shape[-1])))


if __name__ == "__main__":
    import sys

    sys.exit(main())
