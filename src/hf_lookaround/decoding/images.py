"""Generate images with a GVP-pretrained ViT, group by group (``hf-lookaround vision sample``).

The plan at inference is the GVP plan of training (paper (b)), with the split chosen by the caller:

- the prefix (CLS and the condition tokens, e.g. a class) has rank 0 and every group sees it;
- the given (visible) patches form the condition group G0, rank 1 (empty for unconditional samples);
- the patches to generate are put in a random order (drawn from ``generator``) and cut into
  ``num_groups`` groups of equal size (as GVP's ``fixed`` segmentation); group ``k`` has rank ``1 + k``.

Step ``k`` runs the model once with that plan: the query stream at the patches of group ``k`` reads the
content of every lower rank, i.e. the prefix, the visible patches and the groups already generated; the
prediction is written into the canvas and becomes content for the next steps. A given patch is never
changed: the output holds its pixels exactly.

What a step writes, per target mode:

- ``p2p``: the regressed pixels (the mean of the model's prediction; ``temperature`` is not used, so a
  sample varies only with the random order). A ``norm_pix_loss`` model predicts normalised patches,
  which carry no brightness or contrast, and is refused.
- ``p2d`` / ``d2d``: a visual-token id drawn from ``softmax(logits / temperature)`` (``temperature=0``:
  the most likely id). Ids become pixels through the model's pixel decoder: the mean raw patch of the
  training patches that encode to the id (:func:`hf_lookaround.visual_tokenizer.fit_pixel_decoder`). A
  visual token says the shape of a normalised patch only, so its decoded pixels are the average brightness
  and contrast of that shape in the training images. p2d reads the decoded pixels of earlier groups;
  d2d reads their ids.

With nothing visible, the first group is predicted from the prefix alone; GVP training always shows at
least one patch in G0, so that first step lies outside the trained plans (the class, if any, is there).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .. import objectives, plans
from ..models.lookaround.modeling_lookaround_vit import LookAroundViTForPreTraining, patchify, unpatchify

__all__ = ["sample_images", "inference_ranks", "vit_plan", "save_image_grid", "to_display_pixels"]


def vit_plan(config, objective: str, batch_size: int, generator=None, **params) -> plans.Plan:
    """A training plan over ``[CLS, conditions, patches]`` of a ViT config: ``config.sequence_length``
    positions, the first ``config.num_prefix_tokens`` of rank 0 (never targets)."""
    seq_len = config.sequence_length
    return objectives.make_plan(objective, [seq_len] * batch_size, seq_len, generator=generator,
                           num_condition_tokens=config.num_prefix_tokens, **params)


def inference_ranks(visible: torch.Tensor, num_groups: int, generator=None) -> torch.Tensor:
    """(B, N) bool visible patches -> (B, N) ranks: visible 1 (G0), the others in a random order split into
    ``num_groups`` groups of sizes differing by at most one, ranks ``2 .. num_groups + 1``. ``generator``: one
    ``torch.Generator`` for all rows, a list of one per row, or None (torch's global generator)."""
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive integer, got {num_groups!r}")
    hidden_counts = (~visible).sum(-1)
    if int(hidden_counts.min()) < num_groups:
        raise ValueError(
            f"num_groups={num_groups} is larger than the number of patches to generate "
            f"({int(hidden_counts.min())} in some image, of {visible.shape[1]} patches): use at most that many groups"
        )
    ranks = torch.ones(visible.shape, dtype=torch.long)
    per_row = isinstance(generator, (list, tuple))
    if per_row and len(generator) != visible.shape[0]:
        raise ValueError(f"{len(generator)} generators for {visible.shape[0]} rows")
    for b in range(visible.shape[0]):
        hidden = (~visible[b]).nonzero().flatten().cpu()
        order = hidden[torch.randperm(len(hidden), generator=generator[b] if per_row else generator)]
        for k, group in enumerate(order.tensor_split(num_groups)):
            ranks[b, group] = 2 + k
    return ranks


def _as_generator(generator) -> torch.Generator | None:
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int):
        return torch.Generator().manual_seed(generator)
    raise ValueError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")


def _default_num_groups(config, min_to_generate: int) -> int:
    trained = (config.plan_params or {}).get("num_groups")  # recorded by GVP plans only
    return min(int(trained or 20), min_to_generate)


def _check_visible(model, num_images, visible_pixels, visible_mask):
    config = model.config
    n_patches = config.num_patches
    if (visible_pixels is None) != (visible_mask is None):
        raise ValueError("pass visible_pixels and visible_mask together: the images and which of their patches "
                         "are given")
    if visible_pixels is None:
        if num_images is None:
            num_images = 16
        if not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"num_images must be a positive integer, got {num_images!r}")
        return num_images, None, torch.zeros(num_images, n_patches, dtype=torch.bool)
    visible_pixels = torch.as_tensor(visible_pixels)
    c, s, p = config.num_channels, config.image_size, config.patch_size
    if visible_pixels.dim() != 4 or tuple(visible_pixels.shape[1:]) != (c, s, s):
        raise ValueError(f"visible_pixels must have shape (num_images, {c}, {s}, {s}) (the model's channels and "
                         f"image size), got {tuple(visible_pixels.shape)}")
    if num_images is not None and num_images != len(visible_pixels):
        raise ValueError(f"num_images={num_images} but visible_pixels holds {len(visible_pixels)} images")
    mask = torch.as_tensor(visible_mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"visible_mask must be boolean (True: the patch is given), got {mask.dtype}")
    if mask.dim() == 1:
        mask = mask.expand(len(visible_pixels), -1)
    if tuple(mask.shape) != (len(visible_pixels), n_patches):
        raise ValueError(f"visible_mask must have shape ({n_patches},) or ({len(visible_pixels)}, {n_patches}): one "
                         f"flag per {p}x{p} patch in raster order; got {tuple(mask.shape)}")
    return len(visible_pixels), visible_pixels.float(), mask.cpu()


def _condition_kwargs(model, num_images, class_labels, condition_embeds) -> dict:
    config = model.config
    if class_labels is not None:
        class_labels = torch.as_tensor(class_labels, dtype=torch.long)
        if class_labels.dim() == 0:
            class_labels = class_labels.expand(num_images)
        if tuple(class_labels.shape) != (num_images,):
            raise ValueError(f"class_labels must be one class id or {num_images} of them, got shape "
                             f"{tuple(class_labels.shape)}")
        return {"class_labels": class_labels}
    if condition_embeds is not None:
        return {"condition_embeds": torch.as_tensor(condition_embeds)}
    if config.num_condition_tokens:
        raise ValueError(f"this model has {config.num_condition_tokens} condition token(s): pass class_labels "
                         f"(-1 for no class) or condition_embeds")
    return {}


def _write(canvas: torch.Tensor, slots: torch.Tensor, prefix: int, values: torch.Tensor) -> torch.Tensor:
    """canvas (B, N, ...) with ``values`` (B, M, ...) written at the patches of ``slots`` (B, M) (-1 slots skipped)."""
    n = canvas.shape[1]
    index = torch.where(slots >= 0, slots - prefix, n)  # padding slots land in a spare column, dropped below
    spare = torch.cat([canvas, canvas[:, :1]], dim=1)
    if canvas.dim() == 3:
        index = index[..., None].expand(-1, -1, canvas.shape[-1])
    return spare.scatter(1, index, values.to(spare.dtype))[:, :n]


def _sample_ids(logits: torch.Tensor, temperature: float, generators) -> torch.Tensor:
    """(B, M, K) -> (B, M) ids; row b draws from its own generator (so a sample does not depend on the batch)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    ids = torch.stack([torch.multinomial(row, 1, generator=g).flatten() for row, g in zip(probs, generators)])
    return ids.to(logits.device)


@torch.inference_mode()
def sample_images(model, num_images: int | None = None, class_labels=None, visible_pixels=None, visible_mask=None,
                  num_groups: int | None = None, generator=None, temperature: float = 1.0,
                  condition_embeds=None, batch_size: int = 64) -> torch.Tensor:
    """Images ``(num_images, C, H, W)`` (float, on the model's device) generated group by group.

    model: a :class:`LookAroundViTForPreTraining` (any target mode; GVP-pretrained for sensible output).
    num_images: how many to draw (default 16; with ``visible_pixels``, its length).
    class_labels: an int or ``(num_images,)`` ids for the condition tokens (-1: no class); required, or
        ``condition_embeds`` ``(num_images, num_condition_tokens, hidden)``, when the model has condition tokens.
    visible_pixels ``(num_images, C, H, W)`` and visible_mask ``(num_patches,)`` or ``(num_images, num_patches)``
        bool: given patches (raster order), kept exactly; the others are generated.
    num_groups: K, the number of generation steps (default: the K the model was pretrained with, at most the
        number of patches to generate); more groups than patches to generate is an error.
    generator: a ``torch.Generator`` or an int seed (None: torch's global generator). It draws one seed per
        image, and each image draws its random order and its tokens from its own seed: the same seed gives the
        same images, whatever ``batch_size``.
    temperature: p2d/d2d sampling temperature (0: most likely token); not used by p2p.
    """
    if not isinstance(model, LookAroundViTForPreTraining):
        raise ValueError(f"sample_images needs a LookAroundViTForPreTraining (its prediction head), got "
                         f"{type(model).__name__}")
    config = model.config
    mode = config.target_mode
    if mode == "p2p" and config.norm_pix_loss:
        raise ValueError("this p2p model predicts per-patch normalised pixels (norm_pix_loss), which carry no "
                         "brightness or contrast: it cannot generate images")
    if not (isinstance(temperature, (int, float)) and temperature >= 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    generator = _as_generator(generator)
    num_images, given, visible = _check_visible(model, num_images, visible_pixels, visible_mask)
    condition = _condition_kwargs(model, num_images, class_labels, condition_embeds)
    to_generate = int((~visible).sum(-1).min())
    if num_groups is None:
        num_groups = _default_num_groups(config, max(1, to_generate))
    seeds = torch.randint(0, 2**62, (num_images,), generator=generator).tolist()
    generators = [torch.Generator().manual_seed(seed) for seed in seeds]
    ranks = inference_ranks(visible, num_groups, generators)  # checks num_groups against the patches
    if config.uses_codebook:
        model.vit._require_codebook()
        model.vit.decode_visual_tokens(torch.zeros(1, 1, dtype=torch.long, device=model.vit.visual_codebook.device))
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out = []
        for start in range(0, num_images, batch_size):
            rows = slice(start, start + batch_size)
            cond = {k: v[rows].to(device) for k, v in condition.items()}
            given_rows = given[rows].to(device) if given is not None else None
            out.append(_generate_batch(model, ranks[rows].to(device), visible[rows].to(device), given_rows, cond,
                                       num_groups, temperature, generators[rows]))
        return torch.cat(out)
    finally:
        model.train(was_training)


def _generate_batch(model, patch_rank, visible, given, condition, num_groups, temperature, generators):
    config = model.config
    p, c, s, prefix = config.patch_size, config.num_channels, config.image_size, config.num_prefix_tokens
    batch, n = patch_rank.shape
    device = patch_rank.device
    group_ids = torch.cat([torch.zeros(batch, prefix, dtype=torch.long, device=device), patch_rank], dim=1)
    no_prefix = torch.zeros(batch, prefix, dtype=torch.bool, device=device)
    given_patches = (patchify(given, p) if given is not None
                     else torch.zeros(batch, n, config.patch_dim, device=device))
    # the canvas: pixels (p2p, p2d) or visual tokens (d2d); patches not generated yet are never read (higher rank)
    if config.target_mode == "d2d":
        canvas = model.vit.visual_token_ids(given) if given is not None else torch.zeros(
            batch, n, dtype=torch.long, device=device)
        canvas = torch.where(visible, canvas, 0)
    else:
        canvas = given_patches * visible[..., None]
    for k in range(1, num_groups + 1):
        is_target = torch.cat([no_prefix, patch_rank == 1 + k], dim=1)
        slots = plans.target_positions_from_mask(is_target).to(device)
        inputs = ({"input_ids": canvas} if config.target_mode == "d2d"
                  else {"pixel_values": unpatchify(canvas, p, c)})
        logits = model(group_ids=group_ids, target_positions=slots, **inputs, **condition).logits
        if config.target_mode == "p2p":
            values = logits.float()
        else:
            ids = _sample_ids(logits, temperature, generators)
            values = ids if config.target_mode == "d2d" else model.vit.decode_visual_tokens(ids)
        canvas = _write(canvas, slots, prefix, values)
    generated = model.vit.decode_visual_tokens(canvas) if config.target_mode == "d2d" else canvas
    # a given patch is never changed: its pixels come from the input, not from a round trip through the model
    patches = torch.where(visible[..., None], given_patches, generated.float())
    return unpatchify(patches, p, c).reshape(batch, c, s, s)


# --------------------------------------------------------------------------------------------- command
def save_image_grid(images: torch.Tensor, path, ncol: int | None = None, pad: int = 2) -> Path:
    """Write ``images`` (N, C, H, W), pixels in [0, 1] (clipped), as one PNG grid (grey for C=1, RGB for C=3)."""
    from PIL import Image

    images = torch.as_tensor(images).detach().float().cpu()
    if images.dim() != 4 or images.shape[1] not in (1, 3) or len(images) == 0:
        raise ValueError(f"images must have shape (N >= 1, 1 or 3, H, W), got {tuple(images.shape)}")
    n, ch, h, w = images.shape
    ncol = ncol or math.ceil(math.sqrt(n))
    nrow = math.ceil(n / ncol)
    grid = torch.ones(ch, nrow * (h + pad) + pad, ncol * (w + pad) + pad)
    for i, img in enumerate(images.clamp(0, 1)):
        r, q = divmod(i, ncol)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = img
    array = (grid * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array[..., 0] if ch == 1 else array).save(path)  # uint8: grey (H, W) or RGB (H, W, 3)
    return path


def to_display_pixels(images: torch.Tensor, model_path) -> torch.Tensor:
    """The model's pixel units back to [0, 1]: a checkpoint saved with an image processor that normalises
    (``preprocessor_config.json``, ``do_normalize``) was trained on ``(x - image_mean) / image_std``; without one,
    the pixels are taken as they are."""
    if not (Path(model_path) / "preprocessor_config.json").is_file():
        return images
    from ..models.lookaround.image_processing_lookaround_vit import LookAroundViTImageProcessor

    processor = LookAroundViTImageProcessor.from_pretrained(model_path)
    if not getattr(processor, "do_normalize", False):
        return images
    channels = images.shape[1]
    mean = torch.as_tensor(processor.image_mean, dtype=images.dtype, device=images.device).flatten()
    std = torch.as_tensor(processor.image_std, dtype=images.dtype, device=images.device).flatten()
    if mean.numel() not in (1, channels) or std.numel() not in (1, channels):
        raise ValueError(f"the image processor of {model_path} normalises {mean.numel()} channels; the model makes "
                         f"{channels}")
    shape = (1, -1, 1, 1)
    return images * std.expand(channels).reshape(shape) + mean.expand(channels).reshape(shape)
