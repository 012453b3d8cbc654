"""Image data sets for the two-stream ViT: loaders (Fashion-MNIST IDX files, scikit-learn's digits, any `datasets`
image set) into :class:`ImageSource` splits, the fitted image processor that turns them into ``pixel_values``,
and a torch ``Dataset`` of the result.

:func:`load_image_splits` reads the splits; :func:`fit_image_processor` builds the
:class:`LookAroundViTImageProcessor` (size, mean/std of the training images, channels) that is saved next to
the checkpoint (``AutoImageProcessor.from_pretrained(checkpoint)``, the ``image-classification`` pipeline).
"""

from __future__ import annotations

import gzip
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..models.lookaround.image_processing_lookaround_vit import LookAroundViTImageProcessor

logger = logging.getLogger(__name__)



TARGET_MODES = ("p2p", "p2d", "d2d")
BUILTIN_DATASETS = ("fashion_mnist", "digits")
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

    def shuffled(self, seed: int) -> "ImageSource":
        """The same images in a seeded random order: a first-N slice of a class-sorted folder then holds every
        class (an imagefolder is read class by class)."""
        from .subsets import sample_indices

        return self.subset(sample_indices(len(self), len(self), seed))

    def subset(self, indices) -> "ImageSource":
        """The images at ``indices``, in that order (data.subsets.seeded_sample cuts a split with it)."""
        labels = None if self.labels is None else self.labels[indices]
        images = self.images[indices] if isinstance(self.images, np.ndarray) else [self.images[i] for i in indices]
        return ImageSource(images, labels, self.label_names, self.name, self.split, list(self.notes))

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


NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")  # Keras' mnist.npz layout


def _npz_images(array: np.ndarray, name: str, key: str) -> np.ndarray:
    """uint8 ``(N, H, W, C)`` from ``(N, H, W)`` or ``(N, H, W, C)`` integers 0..255 or floats 0..1."""
    if array.ndim == 3:
        array = array[..., None]
    if array.ndim != 4 or array.shape[-1] not in (1, 3):
        raise ValueError(f"{name}: {key} has shape {array.shape}; expected (N, H, W) or (N, H, W, C) with C 1 or 3")
    if np.issubdtype(array.dtype, np.floating):
        if array.min() < 0 or array.max() > 1:
            raise ValueError(f"{name}: {key} holds floats outside [0, 1]; give uint8 pixels 0..255 or floats 0..1")
        array = np.round(array * 255)
    elif array.min() < 0 or array.max() > 255:
        raise ValueError(f"{name}: {key} holds values outside 0..255; give uint8 pixels")
    return array.astype(np.uint8)


def load_npz_images(path, test_fraction: float = 0.2, seed: int = 0) -> tuple[ImageSource, ImageSource]:
    """(train, test) of a ``.npz`` file of arrays in Keras' ``mnist.npz`` layout: ``x_train`` (N, H, W) or
    (N, H, W, C) pixels (uint8 0..255, or floats 0..1) and ``y_train`` (N,) integer class ids; ``x_test`` and
    ``y_test`` likewise, else a seeded ``test_fraction`` of the train arrays is the test split."""
    name = Path(path).name
    with np.load(path, allow_pickle=False) as arrays:
        found = {k: arrays[k] for k in arrays.files}
    if "x_train" not in found or "y_train" not in found:
        raise ValueError(f"{name} holds the arrays {sorted(found)}; expected x_train and y_train (and x_test, y_test "
                         "for a test split), as Keras' mnist.npz")
    splits = {}
    for split in ("train", "test"):
        if f"x_{split}" not in found:
            continue
        images, labels = _npz_images(found[f"x_{split}"], name, f"x_{split}"), found.get(f"y_{split}")
        if labels is None or labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{name}: y_{split} must be {len(images)} integer class ids, one per image of x_{split}")
        splits[split] = (images, labels.astype(np.int64))
    notes = []
    if "test" not in splits:
        images, labels = splits["train"]
        order = np.random.default_rng(seed).permutation(len(images))
        n_test = int(round(test_fraction * len(images)))
        splits = {"train": (images[order[n_test:]], labels[order[n_test:]]),
                  "test": (images[order[:n_test]], labels[order[:n_test]])}
        notes.append(f"no x_test in {name}: a seeded {test_fraction:.0%} of x_train (seed {seed}) is the test split")
    classes = int(max(splits["train"][1].max(), splits["test"][1].max())) + 1
    label_names = tuple(str(i) for i in range(classes))
    return tuple(ImageSource(images, labels, label_names, name, split, list(notes))
                 for split, (images, labels) in splits.items())


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
    if dataset.lower().endswith(".npz") and Path(dataset).is_file():
        return load_npz_images(dataset, test_fraction, seed)
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
