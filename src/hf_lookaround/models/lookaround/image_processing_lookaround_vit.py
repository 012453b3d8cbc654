"""The image processor of the LookAround ViT: ViT's processor that also gives every image the model's channels.

`LookAroundViTImageProcessor` is transformers' ViT image processor (PIL backend: resize to ``size``,
rescale to [0, 1], normalise with ``image_mean`` / ``image_std``, output ``pixel_values`` channels first)
with one addition, ``num_channels``: every input is converted to the channels the model was trained on.
The ``image-classification`` pipeline opens every image as RGB, so a model trained on grey images
(Fashion-MNIST, digits) needs its processor to turn them back into one channel (PIL's ``"L"``
conversion, ITU-R 601-2 luma); a colour model given a grey image gets the grey channel three times.

This module imports nothing but transformers and numpy: ``save_pretrained`` copies it next to the
checkpoint, so ``AutoImageProcessor.from_pretrained(checkpoint, trust_remote_code=True)`` works where
this package is not installed (where it is, the Auto class knows the processor without remote code).
"""

from __future__ import annotations

import numpy as np
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

# ITU-R 601-2 luma, the weights of PIL's convert("L")
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


class LookAroundViTImageProcessor(ViTImageProcessorPil):
    r"""
    ViT's image processor (PIL backend) for a LookAround ViT of ``num_channels`` channels.

    Args:
        num_channels (`int`, defaults to 3): 1 (grey) or 3 (RGB); every image is converted to it before
            resizing (PIL images with ``Image.convert``, arrays with the same luma weights).
        **kwargs: the ViT processor's options (``size``, ``image_mean``, ``image_std``, ``do_resize``,
            ``resample``, ``do_rescale``, ``rescale_factor``, ``do_normalize``).
    """

    model_input_names = ["pixel_values"]
    num_channels = 3

    def __init__(self, num_channels: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if num_channels is not None:
            self.num_channels = int(num_channels)
        if self.num_channels not in (1, 3):
            raise ValueError(f"num_channels must be 1 (grey) or 3 (RGB), got {self.num_channels}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name, None)
            if self.do_normalize and value is not None and len(np.atleast_1d(value)) not in (1, self.num_channels):
                raise ValueError(f"{name} has {len(np.atleast_1d(value))} values for {self.num_channels} channels")

    def process_image(self, image, *args, **kwargs) -> np.ndarray:
        """One image to a channels-first array with ``num_channels`` channels (then ViT's steps follow)."""
        if hasattr(image, "convert") and hasattr(image, "mode"):  # a PIL image, in any mode (P, RGBA, I;16, ...)
            image = image.convert("L" if self.num_channels == 1 else "RGB")
        image = super().process_image(image, *args, **kwargs)
        channels = image.shape[0]
        if channels == self.num_channels:
            return image
        if self.num_channels == 1 and channels in (3, 4):  # RGB(A) array -> luma, in the input's dtype
            grey = np.tensordot(_LUMA, image[:3].astype(np.float32), axes=1)[None]
            return grey.round().astype(image.dtype) if np.issubdtype(image.dtype, np.integer) else grey.astype(image.dtype)
        if self.num_channels == 3 and channels == 1:
            return np.repeat(image, 3, axis=0)
        raise ValueError(f"cannot turn an image of {channels} channels into {self.num_channels}")


__all__ = ["LookAroundViTImageProcessor"]
