"""Configuration of the LookAround vision model: the text backbone run over image patches."""

from .configuration_lookaround import LookAroundConfig

IMAGE_POOLINGS = ("cls", "mean")
# what the model reads and predicts: pixels to pixels (regression), pixels to discrete visual tokens,
# visual tokens to visual tokens (paper (b)'s p2p, p2d, d2d); tokens are ids of a k-means codebook
TARGET_MODES = ("p2p", "p2d", "d2d")


class LookAroundViTConfig(LookAroundConfig):
    r"""
    Configuration of a [`LookAroundViTModel`]: a two-stream ViT on the LookAround backbone.

    Every backbone field of [`LookAroundConfig`] keeps its meaning (sizes, norms, activation, attention,
    dropout); the fields below are added. An image becomes the sequence
    ``[CLS, cond_1, ..., cond_C, patch_0, ..., patch_{N-1}]`` with ``C = num_condition_tokens`` (0 by default)
    and the patches in raster order: ``N = (image_size // patch_size) ** 2`` and position
    ``p + num_prefix_tokens`` (``= p + 1 + C``) holds patch ``p``. Both position embeddings index that 1-D
    order (`absolute`: one learned vector per position, as ViT; `rope`: rotary over the 1-D index). A plan
    gives the whole prefix (CLS and the condition tokens) rank 0 (``num_condition_tokens=num_prefix_tokens``
    in `hf_lookaround.plans`): every group sees it and it is never a target.

    Args:
        image_size (`int`): height and width of the (square) input images.
        patch_size (`int`): height and width of a patch; must divide `image_size`.
        num_channels (`int`): channels of the input images.
        norm_pix_loss (`bool`): regress each target patch normalised by its own mean and variance (MAE's
            `norm_pix_loss`) instead of raw pixels.
        classifier_pooling (`"cls"` or `"mean"`): image features are the CLS token or the mean of the patch
            tokens (the default: during pretraining the rank-0 CLS token only sees itself, so it is trained
            for images only by fine-tuning).
        max_position_embeddings (`int`, optional): defaults to ``N + num_prefix_tokens``; must be at least that.
        target_mode (`"p2p"`, `"p2d"` or `"d2d"`): `p2p` reads pixels and regresses the pixels of each target
            patch (MSE); `p2d` reads pixels and predicts the visual-token id of each target patch
            (cross-entropy over `codebook_size` ids); `d2d` reads visual-token ids (an embedding table) and
            predicts ids. A visual token is the nearest centroid of a k-means codebook over per-patch
            normalised patches (`hf_lookaround.data.visual_tokenizer`), stored in the checkpoint.
        codebook_size (`int`): the number of visual tokens K (p2d, d2d; at least 2).
        num_condition_tokens (`int`): extra tokens after CLS at rank 0, seen by every group: a class embedding
            (`class_labels`) or embeddings given at call time (`condition_embeds`).
        num_condition_classes (`int`): the size of the class-embedding table; 0 = none (then the condition
            tokens need `condition_embeds` at call time).

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
    target_mode: str = "p2p"
    codebook_size: int = 512
    num_condition_tokens: int = 0
    num_condition_classes: int = 0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    mask_token_id: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = False

    def __post_init__(self, **kwargs):
        self._check_image_fields()
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.sequence_length
        super().__post_init__(**kwargs)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_prefix_tokens(self) -> int:
        """CLS and the condition tokens: the rank-0 prefix before the patches (patch p is at p + this)."""
        return 1 + self.num_condition_tokens

    @property
    def sequence_length(self) -> int:
        """``[CLS, conditions, patches]``: the length a plan over one image covers."""
        return self.num_prefix_tokens + self.num_patches

    @property
    def uses_codebook(self) -> bool:
        """p2d and d2d read or predict visual-token ids: the model holds a codebook."""
        return self.target_mode in ("p2d", "d2d")

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
        for name in ("num_condition_tokens", "num_condition_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")

    def validate_lookaround(self) -> None:
        super().validate_lookaround()
        if self.classifier_pooling not in IMAGE_POOLINGS:
            raise ValueError(f"classifier_pooling of an image model must be one of {IMAGE_POOLINGS}, "
                             f"got {self.classifier_pooling!r}")
        if self.max_position_embeddings < self.sequence_length:
            raise ValueError(
                f"max_position_embeddings ({self.max_position_embeddings}) must be at least num_patches + 1 + "
                f"num_condition_tokens = {self.sequence_length} (the patches, the CLS token and the condition "
                f"tokens); leave it unset to get exactly that"
            )
        if self.target_mode not in TARGET_MODES:
            raise ValueError(f"target_mode must be one of {TARGET_MODES} (pixels->pixels, pixels->visual tokens, "
                             f"visual tokens->visual tokens), got {self.target_mode!r}")
        if self.uses_codebook:
            if not isinstance(self.codebook_size, int) or self.codebook_size < 2:
                raise ValueError(f"target_mode {self.target_mode!r} predicts visual tokens: codebook_size must be an "
                                 f"integer >= 2, got {self.codebook_size!r}")
            if self.norm_pix_loss:
                raise ValueError(f"norm_pix_loss applies to pixel regression (target_mode 'p2p'), not to "
                                 f"{self.target_mode!r}: visual tokens are always fitted on normalised patches")
        if self.num_condition_classes and not self.num_condition_tokens:
            raise ValueError(f"num_condition_classes={self.num_condition_classes} needs num_condition_tokens >= 1 "
                             f"to carry the class embedding")
        if self.default_attention != "bidirectional":
            raise ValueError("an image model reads every patch at once: default_attention must be 'bidirectional'")


__all__ = ["LookAroundViTConfig", "IMAGE_POOLINGS", "TARGET_MODES"]
