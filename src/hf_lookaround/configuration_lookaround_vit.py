"""Configuration of the LookAround vision model: the text backbone run over image patches."""

from .configuration_lookaround import LookAroundConfig

IMAGE_POOLINGS = ("cls", "mean")


class LookAroundViTConfig(LookAroundConfig):
    r"""
    Configuration of a [`LookAroundViTModel`]: a two-stream ViT on the LookAround backbone.

    Every backbone field of [`LookAroundConfig`] keeps its meaning (sizes, norms, activation, attention,
    dropout); the fields below are added. An image becomes the sequence ``[CLS, patch_0, ..., patch_{N-1}]``
    with the patches in raster order: ``N = (image_size // patch_size) ** 2`` and position ``p + 1`` holds
    patch ``p``. Both position embeddings index that 1-D raster order (`absolute`: one learned vector per
    position, as ViT; `rope`: rotary over the 1-D index). A plan gives the CLS token rank 0
    (``num_condition_tokens=1`` in `hf_lookaround.plans`); it is never a target.

    Args:
        image_size (`int`): height and width of the (square) input images.
        patch_size (`int`): height and width of a patch; must divide `image_size`.
        num_channels (`int`): channels of the input images.
        norm_pix_loss (`bool`): regress each target patch normalised by its own mean and variance (MAE's
            `norm_pix_loss`) instead of raw pixels.
        classifier_pooling (`"cls"` or `"mean"`): image features are the CLS token or the mean of the patch
            tokens (the default: during pretraining the rank-0 CLS token only sees itself, so it is trained
            for images only by fine-tuning).
        max_position_embeddings (`int`, optional): defaults to ``N + 1``; must be at least that.

    The text-only fields (`vocab_size`, special token ids) are unused: `vocab_size` is 1 and the special
    ids are None, so the backbone's token embedding is a single unused vector.
    """

    model_type = "lookaround_vit"

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    norm_pix_loss: bool = False
    vocab_size: int = 1
    max_position_embeddings: int | None = None
    position_embedding_type: str = "absolute"
    norm_type: str = "layernorm"
    hidden_act: str = "gelu"
    default_attention: str = "bidirectional"
    classifier_pooling: str = "mean"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    mask_token_id: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = False

    def __post_init__(self, **kwargs):
        self._check_image_fields()
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.num_patches + 1
        super().__post_init__(**kwargs)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        """Pixels per patch: the width of the reconstruction head."""
        return self.num_channels * self.patch_size**2

    def _check_image_fields(self) -> None:
        self.check_positive_ints("image_size", "patch_size", "num_channels")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"patch_size ({self.patch_size}) must divide image_size ({self.image_size}); "
                f"e.g. 28x28 images take patch_size 4, 7 or 14"
            )

    def validate_lookaround(self) -> None:
        super().validate_lookaround()
        if self.classifier_pooling not in IMAGE_POOLINGS:
            raise ValueError(f"classifier_pooling of an image model must be one of {IMAGE_POOLINGS}, "
                             f"got {self.classifier_pooling!r}")
        if self.max_position_embeddings < self.num_patches + 1:
            raise ValueError(
                f"max_position_embeddings ({self.max_position_embeddings}) must be at least num_patches + 1 "
                f"= {self.num_patches + 1} (the patches and the CLS token); leave it unset to get exactly that"
            )
        if self.default_attention != "bidirectional":
            raise ValueError("an image model reads every patch at once: default_attention must be 'bidirectional'")


__all__ = ["LookAroundViTConfig", "IMAGE_POOLINGS"]
