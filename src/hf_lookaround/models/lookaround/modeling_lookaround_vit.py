"""The LookAround vision model: a two-stream ViT on the text backbone.

An image is cut into non-overlapping patches (a strided convolution, as ViT), a learned CLS token and
``config.num_condition_tokens`` condition tokens are put in front, and the sequence
``[CLS, cond_1..cond_C, patch_0, ..., patch_{N-1}]`` (patches in raster order) goes through
:class:`~hf_lookaround.modeling_lookaround.LookAroundModel` as ``inputs_embeds``. Plans, masks, both
streams and every attention backend are the backbone's: nothing about who sees whom is re-implemented
here. A plan over images is drawn for ``config.sequence_length`` positions with
``num_condition_tokens=config.num_prefix_tokens`` (the prefix has rank 0: every group sees it, and it is
never a target).

Target modes (``config.target_mode``, paper (b)): ``p2p`` reads pixels and regresses pixels; ``p2d``
reads pixels and predicts visual tokens; ``d2d`` reads and predicts visual tokens. A visual token is the
id of the nearest centroid of a k-means codebook over per-patch normalised patches
(:mod:`hf_lookaround.data.visual_tokenizer` fits it); the codebook is a buffer of the model, saved with the
weights. Encoding and decoding live here so that remote code needs nothing else.

- :class:`LookAroundViTModel`: features; single-stream bidirectional without a plan, two-stream with one.
- :class:`LookAroundViTForPreTraining`: a linear head on the query stream predicts each target patch:
  its pixels (p2p, MSE over target patches only) or its visual token (p2d/d2d, cross-entropy over the
  codebook). Masked/variable-masked plans give MAE-style pretraining, GVP plans predict groups of patches
  in a random order (paper (b)).
- :class:`LookAroundViTForImageClassification`: pooled features (`cls` or `mean`) and a linear classifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import ImageClassifierOutput, ModelOutput
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .checks_lookaround import (
    check_codebook_is_set,
    check_codebook_tables,
    check_codebook_width,
    check_image_classification_inputs,
    check_pixel_decoder_is_set,
    check_pixel_values,
    check_vit_inputs,
    check_vit_pretraining_inputs,
    check_visual_token_ids,
)
from .configuration_lookaround_vit import LookAroundViTConfig
from .modeling_lookaround import LookAroundForPreTrainingOutput, LookAroundModel, LookAroundPreTrainedModel


def patchify(pixel_values: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, p*p*C), patches in raster order, pixels of a patch as (p, p, C)."""
    b, c, h, w = pixel_values.shape
    p = patch_size
    x = pixel_values.reshape(b, c, h // p, p, w // p, p)
    return torch.einsum("bchpwq->bhwpqc", x).reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(patches: torch.Tensor, patch_size: int, num_channels: int) -> torch.Tensor:
    """(B, N, p*p*C) -> (B, C, H, W): the inverse of :func:`patchify` (square images)."""
    b, n, _ = patches.shape
    p, side = patch_size, int(round(n**0.5))
    x = patches.reshape(b, side, side, p, p, num_channels)
    return torch.einsum("bhwpqc->bchpwq", x).reshape(b, num_channels, side * p, side * p)


def normalise_patches(patches: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each patch minus its mean, over its standard deviation (MAE's ``norm_pix_loss`` target)."""
    mean = patches.mean(-1, keepdim=True)
    var = patches.var(-1, keepdim=True, unbiased=False)
    return (patches - mean) / (var + eps).sqrt()


_ENCODE_CHUNK = 65536


def encode_patches(patches_normalised: torch.Tensor, codebook: torch.Tensor) -> torch.LongTensor:
    """(..., P) normalised patches -> (...) ids of their nearest centroid in ``codebook`` (K, P), squared
    Euclidean distance; ties go to the lower id."""
    check_codebook_width(patches_normalised.shape[-1], codebook)
    x = patches_normalised.float().reshape(-1, codebook.shape[-1])
    c = codebook.float()
    c_norm = c.square().sum(-1)
    # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2 (||x||^2 is the same for every centroid); in chunks of rows so
    # that a whole data set never needs a (patches x K) matrix at once
    ids = [(c_norm - 2 * chunk @ c.T).argmin(-1) for chunk in x.split(_ENCODE_CHUNK)]
    return (torch.cat(ids) if len(ids) != 1 else ids[0]).reshape(patches_normalised.shape[:-1])


def decode_ids(ids: torch.LongTensor, codebook: torch.Tensor) -> torch.Tensor:
    """(...) ids -> (..., P): the centroid (or any per-id table of the codebook's shape) of each id."""
    check_visual_token_ids(ids, codebook.shape[0])
    return codebook[ids]


@dataclass
class LookAroundViTModelOutput(ModelOutput):
    """
    last_hidden_state (`(B, T, D)`): the content stream over ``[CLS, conditions, patches]``
        (``T = config.sequence_length``).
    pooler_output (`(B, D)`): the image feature (`config.classifier_pooling`: CLS or mean of the patches).
    query_hidden_state (`(B, M, D)`, two-stream only): the query stream at `target_positions`.
    target_positions (`(B, M)`, two-stream only): positions in ``[CLS, conditions, patches]``
        (>= `config.num_prefix_tokens`), -1 for padding.
    hidden_states, attentions: per layer, if asked for.
    """

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    query_hidden_state: torch.FloatTensor | None = None
    target_positions: torch.LongTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class LookAroundViTForPreTrainingOutput(LookAroundForPreTrainingOutput):
    """
    loss: p2p: mean squared error over the pixels of the target patches (normalised per patch with
        `config.norm_pix_loss`); p2d/d2d: mean cross-entropy of the target patches' visual-token ids.
    logits (`(B, M, p*p*C)` or `(B, M, K)`): p2p: the predicted pixels of each target patch (in the loss's
        space); p2d/d2d: scores over the K visual tokens.
    target_positions (`(B, M)`): positions in ``[CLS, conditions, patches]`` predicted
        (patch = position - `config.num_prefix_tokens`), -1 padding.
    target_ids (`(B, M)`, p2d/d2d): the visual-token id of each target patch (-100 at padding slots).
    """

    target_ids: torch.LongTensor | None = None


class LookAroundViTPreTrainedModel(LookAroundPreTrainedModel):
    config_class = LookAroundViTConfig
    config: LookAroundViTConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _can_compile_fullgraph = True
    # the visual tokenizer's tables stay float32 when a checkpoint is loaded in half precision: rounding the
    # centroids would move nearest-centroid ties, i.e. change which visual token a patch is
    _keep_in_fp32_modules_strict = ["visual_codebook"]

    def unused_parameter_names(self) -> list[str]:
        # patches enter the text backbone as inputs_embeds: its token embedding is never used (frozen for DDP)
        names = [f"{prefix}encoder.embed_tokens.weight" for prefix in ("vit.", "")
                 if f"{prefix}encoder.embed_tokens.weight" in dict(self.named_parameters())]
        if isinstance(self, LookAroundViTForImageClassification):  # classification reads the content stream only
            names.append("vit.encoder.query_embedding")
        return names

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LookAroundViTEmbeddings):
            init.normal_(module.cls_token, mean=0.0, std=self.config.initializer_range)
            if module.condition_tokens is not None:
                init.normal_(module.condition_tokens, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LookAroundViTModel) and module.config.uses_codebook:
            # all zeros = no codebook set yet (a fitted codebook has K >= 2 distinct centroids)
            init.zeros_(module.visual_codebook)
            init.zeros_(module.visual_codebook_pixels)

    def set_visual_codebook(self, codebook: torch.Tensor, pixel_decoder: torch.Tensor | None = None) -> None:
        """Store the visual tokenizer (p2d/d2d) in the model: it is saved and loaded with the weights.

        codebook (`(K, C*p*p)`): centroids of per-patch normalised patches
            (:func:`hf_lookaround.visual_tokenizer.fit_codebook`); a patch's visual token is its nearest centroid.
        pixel_decoder (`(K, C*p*p)`, optional): the pixels each id decodes to when images are generated
            (:func:`hf_lookaround.visual_tokenizer.fit_pixel_decoder`: the mean raw patch of each centroid's
            members). Without it the model trains and predicts ids, but cannot turn sampled ids into pixels.
        """
        self.base_model._set_visual_codebook(codebook, pixel_decoder)

    @property
    def has_visual_codebook(self) -> bool:
        vit = self.base_model
        return vit.config.uses_codebook and bool(vit.visual_codebook.any())


class LookAroundViTEmbeddings(nn.Module):
    """The input sequence ``[CLS, cond_1..cond_C, patch_0..patch_{N-1}]``.

    Patches: a convolution with stride = kernel = patch size (p2p, p2d) or an embedding of visual-token ids
    (d2d). Condition tokens: a learned vector per slot, plus the class embedding of `class_labels`
    (class -1: none), or embeddings given as `condition_embeds`."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__()
        self.config = config
        if config.target_mode == "d2d":
            self.visual_token_embeddings = nn.Embedding(config.codebook_size, config.hidden_size)
        else:
            self.patch_embeddings = nn.Conv2d(
                config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
            )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        # class-conditional: a learned vector per condition slot plus the class embedding (the slot vectors alone
        # for class -1). Without a class table the condition tokens are always given (condition_embeds).
        class_conditional = config.num_condition_tokens and config.num_condition_classes
        self.condition_tokens = (nn.Parameter(torch.zeros(1, config.num_condition_tokens, config.hidden_size))
                                 if class_conditional else None)
        self.class_embeddings = (nn.Embedding(config.num_condition_classes, config.hidden_size)
                                 if class_conditional else None)

    def forward(self, patch_embeds: torch.Tensor, class_labels: torch.Tensor | None = None,
                condition_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """patch_embeds (`(B, N, D)`) -> the whole sequence `(B, T, D)`."""
        batch = patch_embeds.shape[0]
        parts = [self.cls_token.to(patch_embeds.dtype).expand(batch, -1, -1)]
        condition = self.condition_sequence(batch, class_labels, condition_embeds)
        if condition is not None:
            parts.append(condition.to(patch_embeds.dtype))
        return torch.cat(parts + [patch_embeds], dim=1)

    def embed_pixels(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.patch_embeddings.weight.dtype
        return self.patch_embeddings(pixel_values.to(dtype)).flatten(2).transpose(1, 2)  # (B, N, D)

    def condition_sequence(self, batch: int, class_labels, condition_embeds) -> torch.Tensor | None:
        """The condition tokens `(B, C, D)`, None without any (`check_condition_inputs` has checked the inputs)."""
        if not self.config.num_condition_tokens:
            return None
        if condition_embeds is not None:
            return condition_embeds
        class_labels = torch.as_tensor(class_labels, device=self.condition_tokens.device)
        has_class = (class_labels >= 0)[:, None, None]
        classes = self.class_embeddings(class_labels.clamp(min=0))[:, None, :]  # the same class in every slot
        return self.condition_tokens + torch.where(has_class, classes, torch.zeros_like(classes))


class LookAroundViTModel(LookAroundViTPreTrainedModel):
    """Features of images: single-stream bidirectional without `group_ids`, two-stream with a plan."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__(config)
        self.embeddings = LookAroundViTEmbeddings(config)
        self.encoder = LookAroundModel(config)  # the text backbone: masks, streams, backends
        if config.uses_codebook:
            # the visual tokenizer: centroids of normalised patches (encoding) and the pixels of each id
            # (decoding generated ids); persistent, so saved with the weights. All zeros = not set yet.
            self.register_buffer("visual_codebook", torch.zeros(config.codebook_size, config.patch_dim))
            self.register_buffer("visual_codebook_pixels", torch.zeros(config.codebook_size, config.patch_dim))
        self.post_init()

    def get_input_embeddings(self):
        if self.config.target_mode == "d2d":
            return self.embeddings.visual_token_embeddings
        return self.embeddings.patch_embeddings

    # ------------------------------------------------------------------ the visual tokenizer
    def _set_visual_codebook(self, codebook, pixel_decoder=None) -> None:
        check_codebook_tables(self.config, codebook, pixel_decoder)
        codebook = torch.as_tensor(codebook)
        with torch.no_grad():
            self.visual_codebook.copy_(codebook)
            # a new codebook invalidates the old decoder: zeros = no decoder
            self.visual_codebook_pixels.copy_(torch.as_tensor(pixel_decoder) if pixel_decoder is not None else 0)

    def _require_codebook(self) -> None:
        check_codebook_is_set(self.config, self.visual_codebook)

    def visual_token_ids(self, pixel_values: torch.Tensor) -> torch.LongTensor:
        """(B, C, H, W) -> (B, N): the visual token of every patch (nearest centroid of the normalised patch)."""
        self._require_codebook()
        check_pixel_values(pixel_values, self.config)
        patches = normalise_patches(patchify(pixel_values.float(), self.config.patch_size))
        return encode_patches(patches, self.visual_codebook)

    def decode_visual_tokens(self, ids: torch.LongTensor) -> torch.Tensor:
        """(B, N) ids -> (B, N, C*p*p) pixels of each patch, through the pixel decoder."""
        self._require_codebook()
        check_pixel_decoder_is_set(self.visual_codebook_pixels)
        return decode_ids(ids, self.visual_codebook_pixels)

    def patch_embeddings_of(self, pixel_values=None, input_ids=None) -> torch.Tensor:
        """(B, N, D): the embedding of every patch, from pixels (p2p, p2d; d2d tokenises them first) or from
        visual-token ids (d2d)."""
        if self.config.target_mode != "d2d":
            return self.embeddings.embed_pixels(pixel_values)
        if input_ids is None:
            input_ids = self.visual_token_ids(pixel_values)
        return self.embeddings.visual_token_embeddings(input_ids)

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.FloatTensor | None = None,
        group_ids: torch.LongTensor | None = None,
        target_positions: torch.LongTensor | None = None,
        input_ids: torch.LongTensor | None = None,
        class_labels: torch.LongTensor | None = None,
        condition_embeds: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LookAroundViTModelOutput:
        r"""
        pixel_values (`(B, C, H, W)`): the images.
        input_ids (`(B, N)` long, d2d only): visual-token ids of the patches, instead of `pixel_values`.
        class_labels (`(B,)` long, optional): the class carried by the condition tokens (-1: no class). Features
            without a plan (probing, classification, the pipeline) of a class-conditional model default to -1:
            the true class is never read from a label by accident; a plan needs an explicit choice.
        condition_embeds (`(B, num_condition_tokens, D)`, optional): the condition tokens, given directly.
        group_ids (`(B, T)` long, optional): the plan's rank of ``[CLS, conditions, patch_0, ...]``
            (``T = config.sequence_length``); the prefix must have the lowest rank (draw plans with
            ``num_condition_tokens=config.num_prefix_tokens``). Given, both streams run.
        target_positions (`(B, M)` long, optional): positions (>= `config.num_prefix_tokens`) where the query
            stream runs, -1 pads.
        kwargs: transformers' output flags (`output_hidden_states`, `output_attentions`), read by the backbone's
            `capture_outputs`; `return_dict`, read by `can_return_tuple`.
        """
        class_labels = self._default_class_labels(pixel_values, input_ids, group_ids, class_labels, condition_embeds)
        check_vit_inputs(self.config, pixel_values=pixel_values, input_ids=input_ids, group_ids=group_ids,
                         target_positions=target_positions, class_labels=class_labels,
                         condition_embeds=condition_embeds)
        patch_embeds = self.patch_embeddings_of(pixel_values, input_ids)
        embeds = self.embeddings(patch_embeds, class_labels, condition_embeds)
        outputs = self.encoder(
            inputs_embeds=embeds,
            group_ids=group_ids,
            target_positions=target_positions,
            attention_pattern="bidirectional",
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        prefix = self.config.num_prefix_tokens
        pooled = hidden[:, 0] if self.config.classifier_pooling == "cls" else hidden[:, prefix:].mean(1)
        return LookAroundViTModelOutput(
            last_hidden_state=hidden,
            pooler_output=pooled,
            query_hidden_state=outputs.query_hidden_state,
            target_positions=outputs.target_positions,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    def _default_class_labels(self, pixel_values, input_ids, group_ids, class_labels, condition_embeds):
        """Features without a plan (probing, classification, the pipeline) of a class-conditional model carry no
        class (-1) unless told otherwise: the true class is never read from a label by accident. A plan needs an
        explicit choice."""
        given = pixel_values if pixel_values is not None else input_ids
        if (group_ids is not None or class_labels is not None or condition_embeds is not None or given is None
                or self.embeddings.class_embeddings is None):
            return class_labels
        return torch.full(given.shape[:1], -1, dtype=torch.long, device=given.device)


class LookAroundViTForPreTraining(LookAroundViTPreTrainedModel):
    """Prediction of the target patches of a plan (masked, variable-masked or GVP) from the query stream:
    their pixels (p2p) or their visual tokens (p2d, d2d)."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__(config)
        self.vit = LookAroundViTModel(config)
        # hidden -> the pixels of one patch (p2p) or scores over the visual tokens (p2d, d2d)
        width = config.codebook_size if config.uses_codebook else config.patch_dim
        self.decoder = nn.Linear(config.hidden_size, width)
        self.post_init()

    def get_input_embeddings(self):
        return self.vit.get_input_embeddings()

    def target_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, N, p*p*C): what the head regresses (raw or per-patch normalised pixels)."""
        patches = patchify(pixel_values.float(), self.config.patch_size)
        return normalise_patches(patches) if self.config.norm_pix_loss else patches

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.FloatTensor | None = None,
        group_ids: torch.LongTensor | None = None,
        target_positions: torch.LongTensor | None = None,
        input_ids: torch.LongTensor | None = None,
        class_labels: torch.LongTensor | None = None,
        condition_embeds: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LookAroundViTForPreTrainingOutput:
        r"""
        group_ids (`(B, T)`): the plan (required). target_positions (`(B, M)`): the patches to predict, as
        positions in ``[CLS, conditions, patches]`` (patch ``p`` is position ``p + config.num_prefix_tokens``),
        -1 for padding (required: the collator in `hf_lookaround.data.image_collator` emits both). The loss is the MSE
        (p2p) or the cross-entropy of the visual tokens (p2d, d2d) over target patches only.
        input_ids (`(B, N)`, d2d only): visual-token ids instead of pixel_values (they are also the targets).
        class_labels (`(B,)`) or condition_embeds (`(B, C, D)`): what the condition tokens carry.
        """
        check_vit_pretraining_inputs(group_ids, target_positions)
        outputs = self.vit(
            pixel_values, group_ids=group_ids, target_positions=target_positions, input_ids=input_ids,
            class_labels=class_labels, condition_embeds=condition_embeds, **kwargs,
        )
        logits = self.decoder(outputs.query_hidden_state)
        slots = outputs.target_positions
        is_slot = slots >= 0
        patch_index = (slots - self.config.num_prefix_tokens).clamp(min=0)
        target_ids = None
        if self.config.uses_codebook:
            # the targets are data: ids of the true patches (from the codebook, or given in d2d)
            ids = input_ids if input_ids is not None else self.vit.visual_token_ids(pixel_values)
            target_ids = torch.where(is_slot, ids.gather(1, patch_index), -100)
            # mean over real target slots; padded slots (-100) weigh nothing
            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), target_ids.flatten(), ignore_index=-100)
            if not is_slot.any():  # cross_entropy of no target is nan: a batch without targets costs nothing
                loss = logits.sum() * 0.0
        else:
            valid = is_slot.to(logits.dtype)[..., None]
            target = self.target_patches(pixel_values).gather(
                1, patch_index[..., None].expand(-1, -1, logits.shape[-1])
            )
            # mean over the pixels of real target slots; padded slots weigh nothing
            squared = (logits.float() - target) ** 2 * valid
            loss = squared.sum() / (valid.sum() * logits.shape[-1]).clamp(min=1)
        return LookAroundViTForPreTrainingOutput(
            loss=loss,
            logits=logits,
            target_positions=slots,
            target_ids=target_ids,
            last_hidden_state=outputs.last_hidden_state,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class LookAroundViTForImageClassification(LookAroundViTPreTrainedModel):
    """Image classification (or regression) on pooled features: `config.classifier_pooling` is `cls` or `mean`."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.vit = LookAroundViTModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def get_input_embeddings(self):
        return self.vit.get_input_embeddings()

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        input_ids: torch.LongTensor | None = None,
        class_labels: torch.LongTensor | None = None,
        condition_embeds: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ImageClassifierOutput:
        r"""labels (`(B,)`): class ids in ``[0, num_labels)``, or floats for regression / multi-label.
        input_ids (d2d), class_labels, condition_embeds: as in [`LookAroundViTModel`] (a class-conditional model
        classifies with no class, -1, unless told otherwise; a model without a class table needs
        condition_embeds)."""
        check_image_classification_inputs(self, kwargs, labels)
        outputs = self.vit(pixel_values, input_ids=input_ids, class_labels=class_labels,
                           condition_embeds=condition_embeds, **kwargs)
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = None
        if labels is not None:
            loss = self.loss_function(labels.to(logits.device), logits, self.config)
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "LookAroundViTPreTrainedModel",
    "LookAroundViTModel",
    "LookAroundViTForPreTraining",
    "LookAroundViTForImageClassification",
    "LookAroundViTModelOutput",
    "LookAroundViTForPreTrainingOutput",
    "patchify",
    "unpatchify",
    "normalise_patches",
    "encode_patches",
    "decode_ids",
]
