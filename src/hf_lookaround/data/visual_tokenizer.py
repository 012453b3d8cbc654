"""The visual tokenizer of the p2d and d2d target modes: k-means over normalised image patches.

A visual token is the id of the nearest centroid of a codebook of ``K`` centroids, fitted by k-means
(scikit-learn's ``MiniBatchKMeans`` on the distinct patches, weighted by their counts) on patches normalised one by one (each patch minus its mean, over its
standard deviation: :func:`~hf_lookaround.models.lookaround.modeling_lookaround_vit.normalise_patches`, the p2p
``norm_pix_loss`` target). The id says the *shape* of a patch, not its brightness or contrast, so
turning ids back into pixels needs a second table, the pixel decoder: the mean raw patch of each
centroid's members (:func:`fit_pixel_decoder`; the least-squares pixels of an id). Both tables go into
the model with ``model.set_visual_codebook(codebook, pixel_decoder)`` and are saved with its weights::

    codebook = fit_codebook(train_images, patch_size=4, codebook_size=512, seed=0)
    model.set_visual_codebook(codebook, fit_pixel_decoder(train_images, codebook, patch_size=4))

Encoding and decoding are defined in ``modeling_lookaround_vit`` (so that remote code needs no
scikit-learn); :func:`encode` and :func:`decode` are the same functions.
"""

from __future__ import annotations

import logging

import torch

from ..models.lookaround.modeling_lookaround_vit import decode_ids, encode_patches, normalise_patches, patchify

logger = logging.getLogger(__name__)

__all__ = ["fit_codebook", "fit_pixel_decoder", "encode", "decode", "encode_images", "image_patches"]


def image_patches(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(N, C, H, W) float -> (N, L, C*p*p) raw patches in raster order, with the shape checks of the tokenizer."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a tensor of shape (N, channels, height, width), got {got}")
    if not images.is_floating_point():
        raise ValueError(f"images must be floats (e.g. pixels in [0, 1]), got {images.dtype}")
    if not isinstance(patch_size, int) or patch_size < 1:
        raise ValueError(f"patch_size must be a positive integer, got {patch_size!r}")
    h, w = images.shape[-2:]
    if h % patch_size or w % patch_size:
        raise ValueError(f"image size {h}x{w} is not divisible by patch_size {patch_size}: pick a patch size that "
                         f"divides both sides (e.g. 28x28 images take 4, 7 or 14)")
    return patchify(images.float(), patch_size)


def encode(patches_normalised: torch.Tensor, codebook: torch.Tensor) -> torch.LongTensor:
    """(..., C*p*p) normalised patches -> (...) ids of the nearest centroid."""
    return encode_patches(patches_normalised, codebook)


def decode(ids: torch.LongTensor, codebook: torch.Tensor) -> torch.Tensor:
    """(...) ids -> (..., C*p*p): the row of ``codebook`` (centroids, or a pixel decoder) of each id."""
    return decode_ids(ids, codebook)


def encode_images(images: torch.Tensor, codebook: torch.Tensor, patch_size: int) -> torch.LongTensor:
    """(N, C, H, W) -> (N, L) visual tokens of every patch (raster order): d2d inputs made ahead of time."""
    return encode(normalise_patches(image_patches(images, patch_size)), codebook)


def fit_codebook(images: torch.Tensor, patch_size: int, codebook_size: int, seed: int = 0,
                 max_patches: int = 200_000) -> torch.Tensor:
    """k-means centroids ``(codebook_size, C*p*p)`` (float32) of the normalised patches of ``images``.

    At most ``max_patches`` patches are used: if the images hold more, a uniform sample drawn with ``seed``
    (logged). The same images and seed give the same codebook. Raises if the patches hold fewer than
    ``codebook_size`` distinct values (k-means could not place every centroid on data).
    """
    from sklearn.cluster import MiniBatchKMeans

    if not isinstance(codebook_size, int) or codebook_size < 2:
        raise ValueError(f"codebook_size must be an integer >= 2, got {codebook_size!r}")
    if not isinstance(max_patches, int) or max_patches < codebook_size:
        raise ValueError(f"max_patches ({max_patches!r}) must be an integer >= codebook_size ({codebook_size})")
    patches = normalise_patches(image_patches(images, patch_size)).flatten(0, 1)  # (N*L, P)
    if len(patches) > max_patches:
        keep = torch.randperm(len(patches), generator=torch.Generator().manual_seed(seed))[:max_patches]
        logger.info("fit_codebook: k-means on a sample of %d of the %d patches (max_patches)", max_patches,
                    len(patches))
        patches = patches[keep.sort().values]
    # k-means on the distinct patches weighted by their counts: the same objective, and k-means++ never
    # seeds two centroids on copies of one patch (images repeat flat patches very often)
    distinct, counts = torch.unique(patches, dim=0, return_counts=True)
    if codebook_size > len(distinct):
        raise ValueError(f"codebook_size={codebook_size} is larger than the {len(distinct)} distinct normalised "
                         f"patches available ({len(patches)} patches of size {patch_size}): use more images, a "
                         f"smaller codebook_size or a larger max_patches")
    # no reassignment of small clusters: it draws new centres by weight, and so puts several on the most
    # frequent patch; every centre starts on a distinct patch (k-means++) and stays distinct
    kmeans = MiniBatchKMeans(n_clusters=codebook_size, random_state=seed, n_init=3, batch_size=4096,
                             max_iter=100, reassignment_ratio=0.0)
    kmeans.fit(distinct.numpy(), sample_weight=counts.float().numpy())
    codebook = torch.from_numpy(kmeans.cluster_centers_).float()
    if torch.unique(codebook, dim=0).shape[0] < codebook_size:
        raise ValueError(f"k-means placed only {torch.unique(codebook, dim=0).shape[0]} distinct centroids of "
                         f"{codebook_size}: the patches are too few or too alike for this codebook_size")
    return codebook


def fit_pixel_decoder(images: torch.Tensor, codebook: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``(K, C*p*p)``: the pixels each visual token decodes to, the mean raw patch of the patches of ``images``
    that encode to it. An id that no patch encodes to decodes to its centroid put back at the images' mean
    patch brightness and contrast."""
    raw = image_patches(images, patch_size).flatten(0, 1)  # (N*L, P)
    if raw.shape[-1] != codebook.shape[-1]:
        raise ValueError(f"patches of size {patch_size} have {raw.shape[-1]} values, the codebook's centroids "
                         f"{codebook.shape[-1]}: fit the decoder with the codebook's patch size")
    ids = encode(normalise_patches(raw), codebook)
    k = codebook.shape[0]
    sums = torch.zeros(k, raw.shape[-1], dtype=torch.float64).index_add_(0, ids, raw.double())
    counts = torch.bincount(ids, minlength=k).double()[:, None]
    mean, std = raw.mean(-1).mean(), raw.std(-1, unbiased=False).mean()
    unused = mean + std * codebook.double()
    return torch.where(counts > 0, sums / counts.clamp(min=1), unused).float()
