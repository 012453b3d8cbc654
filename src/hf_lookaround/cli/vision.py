"""``hf-lookaround vision``: pretrain the two-stream ViT on images and evaluate it; ``hf-lookaround vision sample``:
sample images from a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import typing

import torch

from .. import objectives
from ..data.image_collator import IMAGE_OBJECTIVES
from ..data.images import TARGET_MODES
from ..hub.load import load_checkpoint
from ..decoding.images import sample_images, save_image_grid, to_display_pixels
from ..evaluation.image_probing import PROBE_BACKENDS
from ..models.lookaround.modeling_lookaround_vit import LookAroundViTForPreTraining
from ..training.vision import run

DESCRIPTION = """Pretrain the two-stream ViT on images (masked, variable-masked or GVP plans; target modes p2p, p2d,
d2d; optional class condition tokens), save it with its image processor, then measure reconstruction L2, linear
probes and (with --finetune_steps) fine-tuning. `hf-lookaround vision sample --help`: sample images from a
checkpoint."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lookaround vision", description=DESCRIPTION)
    data = p.add_argument_group("data")
    data.add_argument("--dataset", default="fashion_mnist",
                      help="fashion_mnist (the default; IDX files in --data), digits (scikit-learn, no file), or a "
                           "datasets image set: an image folder (one subfolder per class), a saved dataset folder, "
                           "a data file, a .npz of x_train, y_train (x_test, y_test) arrays, or a Hub name")
    data.add_argument("--data", default=None, help="fashion_mnist: the folder with the four original IDX .gz files")
    data.add_argument("--image_column", default=None, help="datasets: the column of images (default: the first Image "
                                                           "feature)")
    data.add_argument("--label_column", default=None, help="datasets: the column of class labels (default: the first "
                                                           "ClassLabel feature, else 'label')")
    data.add_argument("--image_size", type=int, default=None,
                      help="resize images to this side (default: fashion_mnist 28, digits 16, else the first image's)")
    data.add_argument("--num_train", type=int, default=None,
                      help="pretraining images (the first N of the train split; default: all but the probe images)")
    data.add_argument("--num_probe_train", type=int, default=2000,
                      help="probe (and fine-tuning) images: the train images after the pretraining ones")
    data.add_argument("--num_test", type=int, default=None, help="test images (the first N of the test split; "
                                                                 "default: all)")
    data.add_argument("--test_fraction", type=float, default=0.2,
                      help="held out as the test split when the data set has none (seeded)")
    model = p.add_argument_group("objective and model")
    model.add_argument("--objective", choices=IMAGE_OBJECTIVES, default="gvp")
    model.add_argument("--target_mode", choices=TARGET_MODES, default="p2p",
                       help="p2p: pixels -> pixels; p2d: pixels -> visual tokens; d2d: visual tokens -> visual tokens "
                            "(tokens: a k-means codebook fitted on the training patches)")
    model.add_argument("--codebook_size", type=int, default=512, help="p2d/d2d: visual tokens K")
    model.add_argument("--codebook_images", type=int, default=10000,
                       help="p2d/d2d: fit the codebook on the patches of the first N pretraining images")
    model.add_argument("--class_conditional", action="store_true",
                       help="one condition token carries the image's class (rank 0, seen by every group)")
    model.add_argument("--class_dropout", type=float, default=0.1,
                       help="class-conditional: the fraction of training images shown with no class (-1)")
    _add_plan_flags(model)
    model.add_argument("--patch_size", type=int, default=None, help="default: fashion_mnist 4, digits 2, else 4")
    model.add_argument("--preset", choices=("tiny", "mini", "small", "base"), default=None,
                       help="backbone sizes of a preset (overrides the four size options)")
    model.add_argument("--hidden_size", type=int, default=64)
    model.add_argument("--num_hidden_layers", type=int, default=4)
    model.add_argument("--num_attention_heads", type=int, default=4)
    model.add_argument("--intermediate_size", type=int, default=256)
    model.add_argument("--position_embedding_type", choices=("absolute", "rope"), default="absolute")
    model.add_argument("--norm_pix_loss", action="store_true", help="p2p: regress per-patch normalised pixels")
    train = p.add_argument_group("training and evaluation")
    train.add_argument("--output_dir", required=True)
    train.add_argument("--max_steps", type=int, default=300)
    train.add_argument("--batch_size", type=int, default=64)
    train.add_argument("--learning_rate", type=float, default=1e-3)
    train.add_argument("--weight_decay", type=float, default=0.05)
    train.add_argument("--finetune_steps", type=int, default=0,
                       help="also fine-tune the pretrained model and one trained from scratch on the probe images; "
                            "the fine-tuned classifier is saved in OUTPUT_DIR/classifier (pipeline-ready)")
    train.add_argument("--no_generative", action="store_true", help="skip generative reconstruction (K forwards)")
    train.add_argument("--probe_backend", choices=PROBE_BACKENDS, default="sklearn",
                       help="solver of the linear probe's logistic regression: sklearn, sklearn_path (warm-started "
                            "along the C grid, ~3x fewer iterations) or torch (L-BFGS on the model's device)")
    train.add_argument("--no_baselines", action="store_true",
                       help="measure the pretrained model only: no probes of the untrained model and raw pixels, no "
                            "fine-tuning from scratch (the mean-patch reconstruction baseline costs nothing and stays)")
    train.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    train.add_argument("--attn_implementation", default="sdpa", choices=("eager", "sdpa", "flex_attention"))
    train.add_argument("--dataloader_num_workers", type=int, default=0)
    train.add_argument("--seed", type=int, default=0)
    return p


def _add_plan_flags(group) -> None:
    """The image objectives' plan flags, built from each module's ``Params`` (type, help) with its
    ``image_defaults`` as defaults, as ``hf-lookaround pretrain`` builds its flags from ``Params``; a flag that
    several image objectives share must have one image default."""
    seen: dict[str, object] = {}
    for name in IMAGE_OBJECTIVES:
        o = objectives.get(name)
        hints = typing.get_type_hints(o.Params)
        fields = {f.name: f for f in dataclasses.fields(o.Params)}
        for flag, default in o.image_defaults.items():
            if flag in seen:
                if seen[flag] != default:
                    raise TypeError(f"image objectives share --{flag} with different image defaults")
                continue
            seen[flag] = default
            kind = hints[flag]
            kwargs = {"type": kind}
            if typing.get_origin(kind) in (list, tuple):  # a range: as many values as the default has
                kwargs = {"type": typing.get_args(kind)[0], "nargs": len(default)}
            group.add_argument(f"--{flag}", default=default, **kwargs,
                               help=f"{fields[flag].metadata.get('help', '')} (images: {default})")


def _check_one_process() -> None:
    """The vision pipeline (pretrain, save, probe, fine-tune, write the results) runs in one process: under a
    distributed launch every rank would run all of it and write the same files (a ValueError: one line)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1:
        raise ValueError(f"hf-lookaround vision runs in one process (its probes and fine-tuning are not distributed), "
                         f"got WORLD_SIZE={world_size}: launch it with hf-lookaround or python, not accelerate launch "
                         "or torchrun")


def _check_plan_flags(args: argparse.Namespace) -> None:
    """The objective's ``Params`` checks its flags now, before any data is read (a ValueError: one line)."""
    o = objectives.get(args.objective)
    o.Params(**{f: getattr(args, f) for f in o.flags if f in o.image_defaults})


def main(argv: list[str] | None = None) -> int:
    """`hf-lookaround vision`: pretrain a ViT on images; reconstruct, probe and (optionally) fine-tune.
    `hf-lookaround vision sample ...`: sample images from a checkpoint."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sample"]:
        return sample_main(argv[1:])
    args = _parser().parse_args(argv)
    _check_one_process()
    _check_plan_flags(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args), indent=2))
    return 0


def _sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-lookaround vision sample",
                                description="Generate images group by group with a GVP-pretrained ViT and write a "
                                            "PNG grid.")
    p.add_argument("--model", required=True, help="folder of a LookAroundViTForPreTraining checkpoint")
    p.add_argument("--num_images", type=int, default=16)
    p.add_argument("--class_label", type=int, default=None,
                   help="class of every image (class-conditional models; default: image i gets class i mod the "
                        "number of classes)")
    p.add_argument("--num_groups", type=int, default=None,
                   help="generation steps K (default: the pretraining K, at most the number of patches)")
    p.add_argument("--temperature", type=float, default=1.0, help="p2d/d2d sampling temperature (0: argmax)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grid.png", help="the PNG grid to write")
    return p


def sample_main(argv=None) -> int:
    """``hf-lookaround vision sample``: load a checkpoint, generate ``--num_images`` and write a PNG grid (pixels
    un-normalised with the checkpoint's image processor, if it has one)."""
    args = _sample_parser().parse_args(argv)
    model = load_checkpoint(LookAroundViTForPreTraining, args.model, "hf-lookaround vision sample", kinds=("vision",)).eval()
    class_labels = args.class_label
    if class_labels is None and model.config.num_condition_classes:
        class_labels = torch.arange(args.num_images) % model.config.num_condition_classes
    images = sample_images(model, num_images=args.num_images, class_labels=class_labels,
                           num_groups=args.num_groups, generator=torch.Generator().manual_seed(args.seed),
                           temperature=args.temperature)
    path = save_image_grid(to_display_pixels(images, args.model), args.out)
    print(f"wrote {len(images)} images ({model.config.target_mode}, seed {args.seed}) to {path}")
    return 0
