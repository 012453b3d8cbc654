"""Vision: pretrain the two-stream ViT on any image data set and evaluate it (``hf-lookaround vision``).

- Data: :func:`load_image_splits` reads Fashion-MNIST (the four original IDX files), scikit-learn's
  bundled digits, or any `datasets` image data set (a saved dataset, an ``imagefolder`` directory, a
  data file, or a Hub name when a network is there) into :class:`ImageSource` splits;
  :func:`fit_image_processor` builds the :class:`LookAroundViTImageProcessor` (ViT's processor: size,
  mean/std of the training images, channels) that turns them into ``pixel_values`` and is saved next to
  the checkpoint (``AutoImageProcessor.from_pretrained(checkpoint)``, the ``image-classification`` pipeline).
- :class:`ImagePlanCollator`: stacks images and draws a plan over ``[CLS, conditions, patches]`` with the
  text collators' plan parameters and seeding (masked, variable-masked, GVP); the prefix is the rank-0
  condition. With ``class_conditional`` it also emits ``class_labels`` (a fraction dropped to -1, no class).
- :func:`linear_probe_images`: frozen pooled features + logistic regression
  (:func:`hf_lookaround.evaluation.probing.linear_probe`); ``model=None`` probes raw pixels.
- :func:`reconstruction_l2`: mean squared error of the predicted target patches, per group
  (paper (a) Table 8, paper (b) Table 8). ``teacher_forced``: each group is predicted from the true
  lower groups (one forward). ``generative``: groups are predicted one after the other, each from
  the model's own predictions of the lower groups (one forward per group); the first group, the
  condition G0, is always the true image. For a masked plan (one target group) both are the same.
  Visual-token models (p2d, d2d) are scored on the decoded tokens: the codebook centroid of the
  predicted id against the per-patch normalised true patch (the space the codebook lives in).
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import collators, plans
from .configuration_lookaround_vit import LookAroundViTConfig
from .image_processing_lookaround_vit import LookAroundViTImageProcessor
from .modeling_lookaround_vit import (
    LookAroundViTForImageClassification,
    LookAroundViTForPreTraining,
    LookAroundViTModel,
    encode_patches,
    normalise_patches,
    patchify,
    unpatchify,
)

logger = logging.getLogger(__name__)

__all__ = [
    "IMAGE_OBJECTIVES",
    "BUILTIN_DATASETS",
    "FASHION_MNIST_CLASSES",
    "ImageSource",
    "load_fashion_mnist",
    "load_digits_images",
    "load_image_splits",
    "fit_image_processor",
    "pixel_values_of",
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
PROBE_BACKENDS = ("sklearn", "sklearn_path", "torch")
TARGET_MODES = ("p2p", "p2d", "d2d")
BUILTIN_DATASETS = ("fashion_mnist", "digits")
# DESIGN: variable-length masking of images draws the ratio from U[0.5, 0.75]
DEFAULT_IMAGE_PLAN_PARAMS = {"vmlm": {"mask_ratio_range": (0.5, 0.75)}, "mlm": {"mask_ratio": 0.75},
                             "gvp": {"num_groups": 20, "segmentation": "mixed"}}
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                         "Bag", "Ankle boot")
_FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
          "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
# per built-in data set: (image_size, patch_size) defaults. Digits are 8x8: upsampled to 16x16 by the
# processor, 2x2 patches give 64 patches, enough for K = 20 GVP groups.
BUILTIN_GEOMETRY = {"fashion_mnist": (28, 4), "digits": (16, 2)}
_GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F"}


# --------------------------------------------------------------------------------------------- data
def _fashion_mnist_arrays(folder, split: str) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``(N, 28, 28)`` and labels ``(N,)`` from the original IDX files."""
    if split not in _FILES:
        raise ValueError(f"split must be one of {tuple(_FILES)}, got {split!r}")
    folder = Path(folder)
    paths = [folder / name for name in _FILES[split]]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"Fashion-MNIST files not found: {missing}; pass the folder holding the four "
                                f"original IDX .gz files (train-images-idx3-ubyte.gz, ...) with --data")
    pixels = np.frombuffer(gzip.open(paths[0]).read(), np.uint8, offset=16)  # IDX header: 16 bytes
    labels = np.frombuffer(gzip.open(paths[1]).read(), np.uint8, offset=8)  # IDX header: 8 bytes
    if pixels.size != labels.size * 28 * 28:
        raise ValueError(f"{paths[0]} holds {pixels.size} pixels for {labels.size} labels; the files do not match")
    return pixels.reshape(-1, 28, 28), labels.astype(np.int64)


def load_fashion_mnist(folder, split: str = "train", limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 28, 28)`` float32 in [0, 1] and labels ``(N,)`` long from the original IDX files."""
    pixels, labels = _fashion_mnist_arrays(folder, split)
    n = len(labels) if limit is None else min(int(limit), len(labels))
    images = torch.from_numpy(pixels[:n, None].astype(np.float32) / 255.0)
    return images, torch.from_numpy(labels[:n])


@dataclass
class ImageSource:
    """One split of an image data set before processing: ``images`` is a uint8 array ``(N, H, W, C)`` or a
    list of PIL images; ``labels`` (N,) int64 or None; ``label_names`` one name per class id."""

    images: object
    labels: np.ndarray | None
    label_names: tuple[str, ...] | None
    name: str
    split: str
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.images)

    @property
    def num_channels(self) -> int:
        """1 when every image is grey (checked on up to 200 images of a list), else 3."""
        if isinstance(self.images, np.ndarray):
            return 1 if self.images.shape[-1] == 1 else 3
        sample = [self.images[i] for i in range(min(200, len(self.images)))]
        return 1 if all(getattr(im, "mode", "RGB") in _GREY_MODES for im in sample) else 3

    @property
    def image_size(self) -> int:
        """The side of the first image (the longer one, if it is not square)."""
        first = self.images[0]
        return int(max(first.shape[:2]) if isinstance(first, np.ndarray) else max(first.size))

    def select(self, start: int, stop: int) -> "ImageSource":
        labels = None if self.labels is None else self.labels[start:stop]
        images = self.images[start:stop] if isinstance(self.images, np.ndarray) else list(self.images[start:stop])
        return ImageSource(images, labels, self.label_names, self.name, self.split, list(self.notes))


def load_digits_images(test_fraction: float = 0.2, seed: int = 0) -> tuple[ImageSource, ImageSource]:
    """scikit-learn's bundled 1,797 handwritten digits (8x8 grey, values 0..16 scaled to 0..255), split
    once with a seeded permutation: ``test_fraction`` of them are the test split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # (N, 8, 8, 1)
    order = np.random.default_rng(seed).permutation(len(images))
    n_test = int(round(test_fraction * len(images)))
    names = tuple(str(d) for d in range(10))
    note = f"scikit-learn digits, seeded split (seed {seed}): {len(images) - n_test} train / {n_test} test"
    test, train = order[:n_test], order[n_test:]
    return (ImageSource(images[train], digits.target[train].astype(np.int64), names, "digits", "train", [note]),
            ImageSource(images[test], digits.target[test].astype(np.int64), names, "digits", "test", [note]))


def _load_datasets_object(dataset: str):
    """A `datasets` Dataset/DatasetDict from a saved dataset folder, an image folder, a data file, or a name."""
    import datasets

    path = Path(dataset)
    if path.is_dir():
        if (path / "state.json").exists() and not json.loads((path / "state.json").read_text()).get("_data_files"):
            # a saved dataset of no rows has no data file (and datasets 5.2 cannot load it)
            raise ValueError(f"the saved dataset {path} is empty: there are no images to train on")
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            return datasets.load_from_disk(str(path))
        return datasets.load_dataset("imagefolder", data_dir=str(path))
    if path.is_file():
        builders = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
        builder = builders.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"cannot read {path}: give a folder (an image folder or a saved dataset) or a data "
                             f"file ending in one of {sorted(builders)}")
        return datasets.load_dataset(builder, data_files=str(path))
    if dataset.startswith((".", "/", "~")) or "\\" in dataset:
        raise FileNotFoundError(f"--dataset {dataset!r} looks like a path but does not exist")
    try:
        return datasets.load_dataset(dataset)
    except Exception as err:  # the Hub is unreachable, a typo, ...: say what we tried
        raise ValueError(f"could not load --dataset {dataset!r} as a `datasets` name ({type(err).__name__}: {err}); "
                         f"give {', '.join(BUILTIN_DATASETS)}, an image folder, a saved dataset folder or a data "
                         f"file, or a Hub name with a network") from err


def _pick_column(ds, wanted: str | None, feature_type, fallbacks, what: str, option: str) -> str | None:
    columns = list(ds.column_names)
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"{what} column {wanted!r} ({option}) is not in the data set; its columns are {columns}")
        return wanted
    typed = [c for c in columns if isinstance(ds.features[c], feature_type)]
    if typed:
        return typed[0]
    return next((c for c in fallbacks if c in columns), None)


def _source_from_dataset(ds, name: str, split: str, image_column: str | None, label_column: str | None,
                         label_names: tuple[str, ...] | None) -> ImageSource:
    import datasets

    column = _pick_column(ds, image_column, datasets.Image, ("image", "img", "picture"), "image", "--image_column")
    if column is None:
        raise ValueError(f"no image column in {name!r} ({split}): its columns are {list(ds.column_names)} with "
                         f"features {dict(ds.features)}; name the column of images with --image_column")
    labels_col = _pick_column(ds, label_column, datasets.ClassLabel, ("label", "labels", "class"), "label",
                              "--label_column")
    images = ds[column]
    if images and not hasattr(images[0], "convert"):
        raise ValueError(f"column {column!r} of {name!r} does not hold images (first value: {type(images[0]).__name__});"
                         f" pass the column of images with --image_column")
    labels = None
    if labels_col is not None:
        values = ds[labels_col]
        feature = ds.features[labels_col]
        if isinstance(feature, datasets.ClassLabel):
            label_names = tuple(feature.names)
            labels = np.asarray(values, dtype=np.int64)
        elif values and isinstance(values[0], str):
            label_names = label_names or tuple(sorted(set(values)))
            index = {n: i for i, n in enumerate(label_names)}
            unknown = sorted(set(values) - set(index))
            if unknown:
                raise ValueError(f"labels {unknown[:5]} of the {split} split are not in the train split's labels")
            labels = np.asarray([index[v] for v in values], dtype=np.int64)
        else:
            labels = np.asarray(values, dtype=np.int64)
            if labels.size and labels.min() < 0:
                raise ValueError(f"label column {labels_col!r} holds negative class ids ({int(labels.min())})")
            if label_names is None and labels.size:
                label_names = tuple(str(i) for i in range(int(labels.max()) + 1))
    return ImageSource(images, labels, label_names, name, split, [f"image column {column!r}, label column {labels_col!r}"])


def load_image_splits(dataset: str = "fashion_mnist", data: str | None = None, image_column: str | None = None,
                      label_column: str | None = None, test_fraction: float = 0.2,
                      seed: int = 0) -> tuple[ImageSource, ImageSource]:
    """(train, test) of ``dataset``: ``fashion_mnist`` (the IDX files in the folder ``data``), ``digits``
    (scikit-learn), or any `datasets` image data set (a saved dataset folder, an image folder with one
    subfolder per class, a data file, or a Hub name). The test split is ``test``, else ``validation``,
    else a seeded ``test_fraction`` of the train split."""
    if dataset == "fashion_mnist":
        if data is None:
            raise ValueError("--dataset fashion_mnist reads the four original IDX .gz files: pass their folder with "
                             "--data (or choose --dataset digits, or a datasets image set)")
        out = []
        for split in ("train", "test"):
            pixels, labels = _fashion_mnist_arrays(data, split)
            out.append(ImageSource(pixels[..., None], labels, FASHION_MNIST_CLASSES, "fashion_mnist", split))
        return out[0], out[1]
    if dataset == "digits":
        return load_digits_images(test_fraction, seed)
    import datasets

    loaded = _load_datasets_object(dataset)
    if isinstance(loaded, datasets.DatasetDict):
        if not loaded:
            raise ValueError(f"{dataset!r} holds no splits")
        train_name = "train" if "train" in loaded else next(iter(loaded))
        test_name = next((s for s in ("test", "validation", "valid", "val") if s in loaded and s != train_name), None)
        train_ds, test_ds = loaded[train_name], (loaded[test_name] if test_name else None)
    else:
        train_name, test_name, train_ds, test_ds = "train", None, loaded, None
    if len(train_ds) == 0:
        raise ValueError(f"the {train_name!r} split of {dataset!r} is empty: there are no images to train on")
    note = None
    if test_ds is None:
        if len(train_ds) < 2:
            raise ValueError(f"{dataset!r} has {len(train_ds)} image(s) and no test split: too few to hold some out")
        parts = train_ds.train_test_split(test_size=test_fraction, seed=seed)
        train_ds, test_ds, test_name = parts["train"], parts["test"], f"{train_name} (held out)"
        note = f"no test split: a seeded {test_fraction:.0%} of {train_name!r} (seed {seed}) is the test split"
    train = _source_from_dataset(train_ds, dataset, train_name, image_column, label_column, None)
    test = _source_from_dataset(test_ds, dataset, test_name, image_column, label_column, train.label_names)
    if len(test) == 0:
        raise ValueError(f"the {test_name!r} split of {dataset!r} is empty")
    if note:
        train.notes.append(note)
    return train, test


def pixel_values_of(source: ImageSource, processor: LookAroundViTImageProcessor, batch_size: int = 2048,
                    **processor_kwargs) -> torch.Tensor:
    """``(N, C, H, W)`` float32 ``pixel_values`` of every image of ``source`` through ``processor``."""
    if len(source) == 0:
        raise ValueError(f"the {source.split} split of {source.name!r} has no images")
    arrays = isinstance(source.images, np.ndarray)
    kwargs = {"input_data_format": "channels_last"} if arrays else {}
    out = []
    for start in range(0, len(source), batch_size):
        chunk = source.images[start : start + batch_size]
        chunk = list(chunk) if arrays else [source.images[i] for i in range(start, min(start + batch_size, len(source)))]
        out.append(processor(images=chunk, return_tensors="np", **kwargs, **processor_kwargs)["pixel_values"])
    return torch.from_numpy(np.concatenate(out).astype(np.float32))


def fit_image_processor(train: ImageSource, image_size: int, num_channels: int | None = None
                        ) -> tuple[LookAroundViTImageProcessor, torch.Tensor]:
    """The processor of a data set (resize to ``image_size``, rescale to [0, 1], normalise with the mean and
    standard deviation per channel of the training images) and the training ``pixel_values`` it gives."""
    num_channels = num_channels or train.num_channels
    size = {"height": int(image_size), "width": int(image_size)}
    unit = pixel_values_of(train, LookAroundViTImageProcessor(num_channels=num_channels, size=size, do_normalize=False))
    mean = unit.mean(dim=(0, 2, 3))
    std = unit.std(dim=(0, 2, 3), unbiased=False)
    if not torch.all(std > 0):
        raise ValueError(f"the training images of {train.name!r} are constant in some channel (std {std.tolist()}); "
                         f"there is nothing to learn from them")
    processor = LookAroundViTImageProcessor(num_channels=num_channels, size=size, image_mean=mean.tolist(),
                                            image_std=std.tolist())
    # the processor's normalisation, done once here on the tensor instead of a second pass over the images
    pixels = (unit - mean[:, None, None]) / std[:, None, None]
    return processor, pixels


class ImageDataset(torch.utils.data.Dataset):
    """``{"pixel_values": (C, H, W)}`` (and ``"labels"`` when given) per example, for ``Trainer``;
    ``class_labels`` (an int, e.g. -1 for "no class") adds that condition to every example."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | None = None, class_labels: int | None = None):
        if labels is not None and len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels, self.class_labels = images, labels, class_labels

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i):
        item = {"pixel_values": self.images[i]}
        if self.labels is not None:
            item["labels"] = self.labels[i]
        if self.class_labels is not None:
            item["class_labels"] = torch.tensor(self.class_labels)
        return item


# --------------------------------------------------------------------------------------------- plans
def image_plan(objective: str, batch_size: int, num_patches: int, generator=None, num_prefix_tokens: int = 1,
               **params) -> plans.Plan:
    """A plan over ``[CLS, conditions, patches]`` (``num_patches + num_prefix_tokens`` positions): the prefix
    (CLS and any condition tokens) is the rank-0 condition."""
    if objective not in IMAGE_OBJECTIVES:
        raise ValueError(f"image objectives are {IMAGE_OBJECTIVES}, got {objective!r}")
    seq_len = num_patches + num_prefix_tokens
    return plans.make_plan(objective, [seq_len] * batch_size, seq_len, generator=generator,
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
    return ImagePlanCollator(collators.make_collator(objective, seed=seed, **params), num_patches,
                             num_prefix_tokens, class_conditional, class_dropout)


# --------------------------------------------------------------------------------------------- evaluation
def _vit(model) -> LookAroundViTModel:
    return model if isinstance(model, LookAroundViTModel) else model.vit


def _no_class(config, batch: int, device) -> dict:
    """``class_labels`` of -1 (no class) for a model whose condition tokens carry a class, else nothing: a
    probe or a classifier must never be told the class it is asked for."""
    if getattr(config, "num_condition_tokens", 0) and getattr(config, "num_condition_classes", 0):
        return {"class_labels": torch.full((batch,), -1, dtype=torch.long, device=device)}
    return {}


@torch.inference_mode()
def extract_image_features(model, images: torch.Tensor, batch_size: int = 256) -> np.ndarray:
    """Frozen pooled features ``(N, hidden)`` (``config.classifier_pooling``), single-stream bidirectional
    (condition tokens, if any, carry no class)."""
    vit = _vit(model).eval()
    device = next(vit.parameters()).device
    feats = []
    for i in range(0, len(images), batch_size):
        x = images[i : i + batch_size].to(device)
        feats.append(vit(x, **_no_class(vit.config, len(x), device)).pooler_output.float().cpu())
    return torch.cat(feats).numpy()


def torch_logistic_probe(train_feats, train_y, val_feats, val_y, test_feats=None, test_y=None, Cs=None,
                         device=None, max_iter: int = 100) -> dict:
    """The probe of :func:`hf_lookaround.evaluation.probing.linear_probe` (standardised features, multinomial
    logistic regression with sklearn's penalty ``0.5 |W|^2 + C * sum of losses``, bias unpenalised, ``C``
    picked on validation accuracy, ties to the stronger penalty) solved with full-batch L-BFGS in torch, on
    ``device`` (a GPU takes seconds where scikit-learn takes a minute per probe of 10,000 images).

    ``max_iter`` caps L-BFGS iterations per ``C`` (scikit-learn's default, 100; each fit starts from the last):
    several probes sharing one GPU time-slice every small kernel, and 1,000 iterations per ``C`` took 200 s
    per probe with 11 processes on one H100 for a 0.001 change in accuracy."""
    from .evaluation.probing import DEFAULT_CS

    Cs = list(DEFAULT_CS if Cs is None else Cs)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

    def tensor(a, dtype=torch.float32):
        return torch.as_tensor(np.asarray(a), dtype=dtype, device=device)

    x, y = tensor(train_feats), tensor(train_y, torch.long)
    if len(torch.unique(y)) < 2:
        raise ValueError("the train split has a single class; a probe needs at least two")
    mean, std = x.mean(0), x.std(0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))  # StandardScaler leaves constant features unscaled

    def standardise(f):
        return (tensor(f) - mean) / std

    x, xv, yv = standardise(train_feats), standardise(val_feats), tensor(val_y, torch.long)
    num_classes = int(max(y.max(), yv.max())) + 1
    weight = torch.zeros(x.shape[1], num_classes, device=device, requires_grad=True)
    bias = torch.zeros(num_classes, device=device, requires_grad=True)
    fitted, val_scores = {}, {}
    for c in sorted(Cs):  # weaker and weaker penalty, each fit starting from the last one
        optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=max_iter, history_size=20,
                                      tolerance_grad=1e-5, tolerance_change=1e-10, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            # sklearn's objective divided by C * n: the mean loss plus |W|^2 / (2 C n)
            loss = torch.nn.functional.cross_entropy(x @ weight + bias, y) + weight.square().sum() / (2 * c * len(x))
            loss.backward()
            return loss

        optimizer.step(closure)
        fitted[c] = (weight.detach().clone(), bias.detach().clone())
        val_scores[c] = float(((xv @ fitted[c][0] + fitted[c][1]).argmax(-1) == yv).float().mean())
    best = max(Cs, key=lambda v: (val_scores[v], -Cs.index(v)))
    result = {"task_type": "classification", "C": float(best), "num_train": int(len(y)), "metric": "accuracy",
              "validation_accuracy": val_scores[best], "solver": f"torch L-BFGS on {device.type}"}
    if test_feats is not None and test_y is not None:
        w, b = fitted[best]
        acc = float(((standardise(test_feats) @ w + b).argmax(-1) == tensor(test_y, torch.long)).float().mean())
        result.update(test_accuracy=acc, test_accuracy_se=float(np.sqrt(acc * (1 - acc) / len(test_y))))
    return result


def warm_path_probe(train_feats, train_y, val_feats, val_y, test_feats=None, test_y=None, Cs=None) -> dict:
    """The probe of :func:`hf_lookaround.evaluation.probing.linear_probe` (standardised features, scikit-learn's
    multinomial ``LogisticRegression``, ``C`` picked on validation accuracy, ties to the stronger penalty), on the
    CPU, with each ``C`` of the grid (ascending) started from the solution of the previous one (``warm_start``):
    the same objective and optimum, in about a third of the iterations. Needs no GPU: many runs sharing one GPU
    slow a GPU solver's many tiny steps down far more than the CPU."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from .evaluation.probing import DEFAULT_CS

    Cs = sorted(DEFAULT_CS if Cs is None else Cs)
    train_y, val_y = np.asarray(train_y), np.asarray(val_y)
    if len(np.unique(train_y)) < 2:
        raise ValueError("the train split has a single class; a probe needs at least two")
    scaler = StandardScaler().fit(train_feats)
    x, xv = scaler.transform(train_feats), scaler.transform(val_feats)
    xt = scaler.transform(test_feats) if test_feats is not None else None
    model = LogisticRegression(C=Cs[0], max_iter=2000, warm_start=True, random_state=0)
    val_scores, test_scores = {}, {}
    for c in Cs:
        model.set_params(C=c).fit(x, train_y)
        val_scores[c] = float((model.predict(xv) == val_y).mean())
        if xt is not None and test_y is not None:
            test_scores[c] = float((model.predict(xt) == np.asarray(test_y)).mean())
    best = max(Cs, key=lambda v: (val_scores[v], -Cs.index(v)))
    result = {"task_type": "classification", "C": float(best), "num_train": int(len(train_y)), "metric": "accuracy",
              "validation_accuracy": val_scores[best], "solver": "scikit-learn lbfgs, warm start along C"}
    if test_scores:
        acc = test_scores[best]
        result.update(test_accuracy=acc, test_accuracy_se=float(np.sqrt(acc * (1 - acc) / len(test_y))))
    return result


def linear_probe_images(model, images, labels, test_images=None, test_labels=None, validation_fraction: float = 0.2,
                        seed: int = 0, batch_size: int = 256, backend: str = "sklearn") -> dict:
    """Logistic regression on frozen features (``model=None``: raw pixels); ``C`` picked on a held-out
    ``validation_fraction`` of ``images``; test accuracy on ``test_images`` if given. ``backend``:
    ``sklearn`` (:func:`hf_lookaround.evaluation.probing.linear_probe`), ``sklearn_path``
    (:func:`warm_path_probe`: the same, warm-started along the ``C`` grid) or ``torch``
    (:func:`torch_logistic_probe`, the same objective on the model's device)."""
    from .evaluation.probing import linear_probe

    if backend not in PROBE_BACKENDS:
        raise ValueError(f"backend must be one of {PROBE_BACKENDS}, got {backend!r}")
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
    if backend == "sklearn_path":
        return warm_path_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()], labels[val.numpy()],
                               test_feats, None if test_labels is None else np.asarray(test_labels))
    if backend == "torch":
        device = next(model.parameters()).device if model is not None else None
        return torch_logistic_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()],
                                    labels[val.numpy()], test_feats,
                                    None if test_labels is None else np.asarray(test_labels), device=device)
    return linear_probe(feats[train.numpy()], labels[train.numpy()], feats[val.numpy()], labels[val.numpy()],
                        test_feats, None if test_labels is None else np.asarray(test_labels), seed=seed)


def _uses_codebook(config) -> bool:
    return bool(getattr(config, "uses_codebook", False))


def reconstruction_space(config) -> str:
    """The space :func:`reconstruction_l2` measures errors in, for a model of ``config``."""
    if _uses_codebook(config) or config.norm_pix_loss:
        return "per-patch normalised patches"
    return "pixel_values (the processor's normalised pixels)"


def _true_patches(model, x):
    """(b, N, P) true patches in the space of the error: the regression target of a pixel model, the
    per-patch normalised patch of a visual-token model (what its codebook centroids approximate)."""
    if _uses_codebook(model.config):
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
    codebook = _uses_codebook(config) and not getattr(model, "predicts_patches", False)
    if mode == "generative" and (config.norm_pix_loss or _uses_codebook(config)):
        raise ValueError("generative reconstruction writes predictions back as pixels; this model predicts "
                         "normalised patches or visual tokens: use mode='teacher_forced'")
    prefix = getattr(config, "num_prefix_tokens", 1)
    n, num_patches = len(images), config.num_patches
    if plan is None:
        params = {**DEFAULT_IMAGE_PLAN_PARAMS.get(objective, {}), **(plan_params or {})}
        plan = image_plan(objective, n, num_patches, generator=torch.Generator().manual_seed(seed),
                          num_prefix_tokens=prefix, **params)
    if tuple(plan.group_ids.shape) != (n, num_patches + prefix):
        raise ValueError(f"plan must cover {n} images x {num_patches + prefix} positions, got "
                         f"{tuple(plan.group_ids.shape)}")
    model.eval()
    device = next(model.parameters(), images).device
    sq_sum: dict[int, float] = {}
    count: dict[int, int] = {}
    floor_sum, expected_sum, hits = 0.0, 0.0, 0
    for start in range(0, n, batch_size):
        x = images[start : start + batch_size].to(device)
        ranks = plan.group_ids[start : start + batch_size].to(device)
        slots = plans.target_positions_from_mask(plan.is_target[start : start + batch_size]).to(device)
        extra = _no_class(config, len(x), device)
        if class_labels is not None and extra:
            extra = {"class_labels": class_labels[start : start + batch_size].to(device)}
        index = (slots - prefix).clamp(min=0)
        truth_all = _true_patches(model, x)
        truth = truth_all.gather(1, index[..., None].expand(-1, -1, truth_all.shape[-1]))
        if codebook:
            logits = model(pixel_values=x, group_ids=ranks, target_positions=slots, **extra).logits
            centroids = model.vit.visual_codebook.float()
            pred = centroids[logits.argmax(-1)]
            nearest = encode_patches(truth, centroids)  # the true patch's visual token
            floor = ((centroids[nearest] - truth) ** 2).mean(-1)
            # the prediction that minimises the expected squared error under the model's distribution
            expected = ((logits.float().softmax(-1) @ centroids - truth) ** 2).mean(-1)
            valid = slots >= prefix
            floor_sum += float(floor[valid].sum())
            expected_sum += float(expected[valid].sum())
            hits += int((logits.argmax(-1) == nearest)[valid].sum())
        else:
            pred = _predict_targets(model, x, ranks, slots, mode, prefix, extra)  # (b, M, P)
        err = ((pred.float() - truth) ** 2).mean(-1)  # (b, M) per patch
        group = ranks.gather(1, slots.clamp(min=0)) - ranks[:, prefix:].amin(-1, keepdim=True)
        valid = slots >= prefix
        for g in group[valid].unique().tolist():
            sel = valid & (group == g)
            sq_sum[g] = sq_sum.get(g, 0.0) + float(err[sel].sum())
            count[g] = count.get(g, 0) + int(sel.sum())
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


class _MeanPatchPredictor(torch.nn.Module):
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


# --------------------------------------------------------------------------------------------- command
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
                           "a data file, or a Hub name")
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
    model.add_argument("--num_groups", type=int, default=20, help="GVP: K")
    model.add_argument("--segmentation", choices=plans.SEGMENTATIONS, default="mixed", help="GVP segmentation")
    model.add_argument("--mask_ratio_range", type=float, nargs=2, default=(0.5, 0.75), help="vmlm: U[a, b]")
    model.add_argument("--mask_ratio", type=float, default=0.75, help="mlm: fixed ratio")
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
        remove_unused_columns=False, disable_tqdm=True, bf16=args.bf16,
    )


def _finetune(model, args, images, labels, test_images, test_labels, output_dir) -> float:
    from transformers import Trainer

    model.set_attn_implementation(args.attn_implementation)
    no_class = -1 if _no_class(model.config, 1, "cpu") else None
    Trainer(model=model, args=_training_args(output_dir, args, args.finetune_steps),
            train_dataset=ImageDataset(images, labels, class_labels=no_class)).train()
    model.eval()
    with torch.inference_mode():
        device = next(model.parameters()).device
        logits = torch.cat([model(pixel_values=test_images[i : i + 256].to(device),
                                  **_no_class(model.config, len(test_images[i : i + 256]), device)).logits.float().cpu()
                            for i in range(0, len(test_images), 256)])
    return float((logits.argmax(-1) == test_labels).float().mean())


def _geometry(args, train: ImageSource) -> tuple[int, int]:
    default_size, default_patch = BUILTIN_GEOMETRY.get(args.dataset, (train.image_size, 4))
    image_size = args.image_size or default_size
    patch_size = args.patch_size or default_patch
    if image_size < 1 or patch_size < 1:
        raise ValueError(f"--image_size and --patch_size must be positive, got {image_size} and {patch_size}")
    if image_size % patch_size:
        divisors = [d for d in range(1, image_size + 1) if image_size % d == 0]
        raise ValueError(f"--patch_size {patch_size} does not divide the image size {image_size}: choose a patch size "
                         f"in {divisors}, or resize the images with --image_size")
    return image_size, patch_size


def _fit_codebook(model, images, args) -> dict:
    from . import visual_tokenizer

    subset = images[: args.codebook_images]  # on the CPU: k-means runs in scikit-learn
    start = time.perf_counter()
    patch_size = model.config.patch_size
    codebook = visual_tokenizer.fit_codebook(subset, patch_size, args.codebook_size, seed=args.seed)
    pixel_decoder = None
    if hasattr(visual_tokenizer, "fit_pixel_decoder"):  # the pixels each id decodes to, for sampling
        pixel_decoder = visual_tokenizer.fit_pixel_decoder(subset, codebook, patch_size)
    model.set_visual_codebook(torch.as_tensor(codebook).cpu(),
                              None if pixel_decoder is None else torch.as_tensor(pixel_decoder).cpu())
    return {"codebook_size": args.codebook_size, "fit_images": len(subset),
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    """`hf-lookaround vision`: pretrain a ViT on images; reconstruct, probe and (optionally) fine-tune.
    `hf-lookaround vision sample ...`: sample images from a checkpoint."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sample"]:
        from .vision_generation import sample_main

        return sample_main(argv[1:])
    from transformers import Trainer, set_seed

    from .pretraining import CollatorEpochCallback

    args = _parser().parse_args(argv)
    started = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.output_dir)
    set_seed(args.seed)

    train_source, test_source = load_image_splits(args.dataset, args.data, args.image_column, args.label_column,
                                                  args.test_fraction, args.seed)
    if train_source.labels is None or test_source.labels is None:
        raise ValueError(f"{args.dataset!r} has no label column: name it with --label_column (the probes, "
                         f"fine-tuning and class condition tokens need one class per image)")
    image_size, patch_size = _geometry(args, train_source)
    n_probe = args.num_probe_train
    n_pre = len(train_source) - n_probe if args.num_train is None else args.num_train
    if n_probe < 2 or n_pre < 1 or n_pre + n_probe > len(train_source):
        raise ValueError(f"the train split of {args.dataset!r} has {len(train_source)} images: --num_train ({n_pre}) "
                         f"+ --num_probe_train ({n_probe}) must fit in it, with at least 1 and 2 images")
    if args.num_test is not None and not 1 <= args.num_test <= len(test_source):
        raise ValueError(f"--num_test must lie in [1, {len(test_source)}] (the test split's size), got {args.num_test}")
    train_source = train_source.select(0, n_pre + n_probe)
    test_source = test_source.select(0, args.num_test or len(test_source))
    processor, train_pixels = fit_image_processor(train_source, image_size)
    test_images = pixel_values_of(test_source, processor)
    train_labels = torch.from_numpy(train_source.labels)
    test_labels = torch.from_numpy(test_source.labels)
    label_names = train_source.label_names or tuple(str(i) for i in range(int(train_labels.max()) + 1))
    num_labels = len(label_names)
    if int(max(train_labels.max(), test_labels.max())) >= num_labels:
        raise ValueError(f"class ids reach {int(max(train_labels.max(), test_labels.max()))} but the data set names "
                         f"{num_labels} classes")
    pre_images, pre_labels = train_pixels[:n_pre], train_labels[:n_pre]
    # the probe (and fine-tuning) uses train images the pretraining did not see
    probe_images, probe_labels = train_pixels[n_pre:], train_labels[n_pre:]
    if len(set(probe_labels.tolist())) < 2:
        raise ValueError(f"the {n_probe} probe images hold a single class; raise --num_probe_train")

    params = _plan_params(args)
    sizes = {k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size")}
    if args.preset:
        from .configuration_lookaround import PRESETS

        sizes = dict(PRESETS[args.preset])
    config = LookAroundViTConfig(
        image_size=image_size, patch_size=patch_size, num_channels=processor.num_channels, **sizes,
        position_embedding_type=args.position_embedding_type, norm_pix_loss=args.norm_pix_loss,
        objective=args.objective, plan_params=params, target_mode=args.target_mode,
        codebook_size=args.codebook_size,
        num_condition_tokens=1 if args.class_conditional else 0,
        num_condition_classes=num_labels if args.class_conditional else 0,
        num_labels=num_labels, id2label=dict(enumerate(label_names)),
    )
    out.mkdir(parents=True, exist_ok=True)
    collator = make_image_collator(args.objective, config.num_patches, seed=args.seed,
                                   num_prefix_tokens=config.num_prefix_tokens,
                                   class_conditional=args.class_conditional, class_dropout=args.class_dropout,
                                   **params)
    model = LookAroundViTForPreTraining(config)
    model.set_attn_implementation(args.attn_implementation)
    results = {
        "dataset": {"name": args.dataset, "image_size": image_size, "patch_size": patch_size,
                    "num_channels": processor.num_channels, "image_mean": list(processor.image_mean),
                    "image_std": list(processor.image_std), "num_classes": num_labels,
                    "notes": train_source.notes},
        "objective": args.objective, "target_mode": args.target_mode, "class_conditional": args.class_conditional,
        "plan_params": {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()},
        "num_parameters": model.num_parameters(), "num_pretrain_images": len(pre_images),
        "num_probe_images": len(probe_images), "num_test_images": len(test_images),
        "max_steps": args.max_steps, "seconds": {"data": round(time.perf_counter() - started, 1)},
    }
    if _uses_codebook(config):
        results["codebook"] = _fit_codebook(model, pre_images, args)
        results["seconds"]["codebook"] = results["codebook"]["seconds"]
    scratch = LookAroundViTForPreTraining(config)  # the same initialisation scheme, never trained
    trainer = Trainer(model=model, args=_training_args(out / "trainer", args, args.max_steps),
                      train_dataset=ImageDataset(pre_images, pre_labels if args.class_conditional else None),
                      data_collator=collator, callbacks=[CollatorEpochCallback(collator)])
    train_result = trainer.train()
    model.save_pretrained(out)
    processor.save_pretrained(out)  # AutoImageProcessor.from_pretrained(out) gives the same pixel_values
    results["train_loss"] = train_result.training_loss
    results["seconds"]["pretraining"] = train_result.metrics.get("train_runtime")
    path = out / "vision_results.json"

    def stage(name, compute):
        # results are written after every stage, so a run stopped part-way keeps what it measured
        start = time.perf_counter()
        results[name] = compute()
        results["seconds"][name] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(results, indent=2))
        logger.info("%s: %s", name, json.dumps(results[name])[:400])

    # reconstruction: the same plans (seeded) in both modes; predicting the mean training patch is the baseline
    def reconstruct():
        pixel_model = not (args.norm_pix_loss or _uses_codebook(config))
        modes = ("teacher_forced", "generative") if pixel_model and not args.no_generative else ("teacher_forced",)
        recon = {mode: reconstruction_l2(model, test_images, objective=args.objective, plan_params=params, mode=mode,
                                         seed=args.seed) for mode in modes}
        recon["mean_image_baseline"] = reconstruction_l2(_MeanPatchPredictor(model, pre_images), test_images,
                                                         objective=args.objective, plan_params=params, seed=args.seed)
        return recon

    stage("reconstruction_l2", reconstruct)
    # probes: pretrained features, the same architecture untrained, raw pixels
    probed = (("pretrained", model),) if args.no_baselines else (
        ("pretrained", model), ("random_init", scratch.to(model.device)), ("raw_pixels", None))
    stage("linear_probe", lambda: {
        name: linear_probe_images(m, probe_images, probe_labels, test_images, test_labels, seed=args.seed,
                                  backend=args.probe_backend)["test_accuracy"]
        for name, m in probed
    })
    if args.finetune_steps:
        def finetune():
            classifier = LookAroundViTForImageClassification.from_pretrained(out)
            accuracy = _finetune(classifier, args, probe_images, probe_labels, test_images, test_labels, out / "ft")
            # a pipeline-ready classifier: weights, config (id2label) and the image processor side by side
            classifier.save_pretrained(out / "classifier")
            processor.save_pretrained(out / "classifier")
            if args.no_baselines:
                return {"pretrained": accuracy}
            scratch_classifier = LookAroundViTForImageClassification(LookAroundViTConfig.from_pretrained(out))
            return {"pretrained": accuracy,
                    "from_scratch": _finetune(scratch_classifier, args, probe_images, probe_labels, test_images,
                                              test_labels, out / "ft_scratch")}

        stage("finetune_test_accuracy", finetune)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
