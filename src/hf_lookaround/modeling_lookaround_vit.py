"""The LookAround vision model: a two-stream ViT on the text backbone.

An image is cut into non-overlapping patches (a strided convolution, as ViT), a learned CLS token is
put in front, and the sequence ``[CLS, patch_0, ..., patch_{N-1}]`` (patches in raster order) goes
through :class:`~hf_lookaround.modeling_lookaround.LookAroundModel` as ``inputs_embeds``. Plans,
masks, both streams and every attention backend are the backbone's: nothing about who sees whom is
re-implemented here. A plan over images is drawn for ``N + 1`` positions with
``num_condition_tokens=1`` (the CLS token has rank 0 and is never a target).

- :class:`LookAroundViTModel`: features; single-stream bidirectional without a plan, two-stream with one.
- :class:`LookAroundViTForPreTraining`: a linear pixel head on the query stream regresses the pixels of
  each target patch (MSE over target patches only). Masked/variable-masked plans give MAE-style
  pretraining, GVP plans predict groups of patches in a random order (paper (b)).
- :class:`LookAroundViTForImageClassification`: pooled features (`cls` or `mean`) and a linear classifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import ImageClassifierOutput, ModelOutput
from transformers.utils import can_return_tuple

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


@dataclass
class LookAroundViTModelOutput(ModelOutput):
    """
    last_hidden_state (`(B, N+1, D)`): the content stream, CLS first.
    pooler_output (`(B, D)`): the image feature (`config.classifier_pooling`: CLS or mean of the patches).
    query_hidden_state (`(B, M, D)`, two-stream only): the query stream at `target_positions`.
    target_positions (`(B, M)`, two-stream only): positions in ``[CLS, patches]`` (>= 1), -1 for padding.
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
    loss: mean squared error over the pixels of the target patches (normalised per patch with
        `config.norm_pix_loss`).
    logits (`(B, M, p*p*C)`): the predicted pixels of each target patch (in the loss's space).
    target_positions (`(B, M)`): positions in ``[CLS, patches]`` predicted (patch = position - 1), -1 padding.
    """


class LookAroundViTPreTrainedModel(LookAroundPreTrainedModel):
    config_class = LookAroundViTConfig
    config: LookAroundViTConfig
    base_model_prefix = "vit"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _can_compile_fullgraph = True

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


class LookAroundViTEmbeddings(nn.Module):
    """Patch embedding (a convolution with stride = kernel = patch size) and a learned CLS token in front."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__()
        self.config = config
        self.patch_embeddings = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        c, s = self.config.num_channels, self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c, s, s):
            raise ValueError(
                f"pixel_values must have shape (batch, {c}, {s}, {s}) (num_channels, image_size, image_size of the "
                f"config), got {tuple(pixel_values.shape)}; resize the images or build a config for their size"
            )
        dtype = self.patch_embeddings.weight.dtype
        patches = self.patch_embeddings(pixel_values.to(dtype)).flatten(2).transpose(1, 2)  # (B, N, D)
        return torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)


class LookAroundViTModel(LookAroundViTPreTrainedModel):
    """Features of images: single-stream bidirectional without `group_ids`, two-stream with a plan."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__(config)
        self.embeddings = LookAroundViTEmbeddings(config)
        self.encoder = LookAroundModel(config)  # the text backbone: masks, streams, backends
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings.patch_embeddings

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.FloatTensor | None = None,
        group_ids: torch.LongTensor | None = None,
        target_positions: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> LookAroundViTModelOutput:
        r"""
        pixel_values (`(B, C, H, W)`): the images.
        group_ids (`(B, N+1)` long, optional): the plan's rank of ``[CLS, patch_0, ...]``; CLS must have the
            lowest rank (draw plans with ``num_condition_tokens=1``). Given, both streams run.
        target_positions (`(B, M)` long, optional): positions (>= 1) where the query stream runs, -1 pads.
        """
        if pixel_values is None:
            raise ValueError("LookAroundViTModel needs pixel_values of shape (batch, channels, height, width)")
        embeds = self.embeddings(pixel_values)
        if group_ids is not None:
            self._check_plan(group_ids, target_positions, embeds.shape[:2])
        outputs = self.encoder(
            inputs_embeds=embeds,
            group_ids=group_ids,
            target_positions=target_positions,
            attention_pattern="bidirectional",
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
        )
        hidden = outputs.last_hidden_state
        pooled = hidden[:, 0] if self.config.classifier_pooling == "cls" else hidden[:, 1:].mean(1)
        return LookAroundViTModelOutput(
            last_hidden_state=hidden,
            pooler_output=pooled,
            query_hidden_state=outputs.query_hidden_state,
            target_positions=outputs.target_positions,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )

    @staticmethod
    def _check_plan(group_ids, target_positions, shape) -> None:
        if tuple(group_ids.shape) != tuple(shape):
            raise ValueError(
                f"group_ids must cover [CLS, patches]: shape {tuple(shape)}, got {tuple(group_ids.shape)}; "
                f"draw the plan for num_patches + 1 positions with num_condition_tokens=1"
            )
        if torch.compiler.is_compiling():
            return  # value checks need a host sync
        if (group_ids[:, :1] > group_ids[:, 1:]).any():
            raise ValueError("the CLS token (position 0) must have the lowest rank of its row (a condition token)")
        if target_positions is not None and (target_positions == 0).any():
            raise ValueError("position 0 is the CLS token and has no pixels: it cannot be a target")


class LookAroundViTForPreTraining(LookAroundViTPreTrainedModel):
    """Pixel regression from the query stream at the targets of a plan (masked, variable-masked or GVP)."""

    def __init__(self, config: LookAroundViTConfig):
        super().__init__(config)
        self.vit = LookAroundViTModel(config)
        self.decoder = nn.Linear(config.hidden_size, config.patch_dim)  # hidden -> the pixels of one patch
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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> LookAroundViTForPreTrainingOutput:
        r"""
        group_ids (`(B, N+1)`): the plan (required). target_positions (`(B, M)`): the patches to predict, as
        positions in ``[CLS, patches]`` (patch ``p`` is position ``p + 1``), -1 for padding (required: the
        collators in `hf_lookaround.vision` emit both). The loss is the MSE over target patches only.
        """
        if group_ids is None or target_positions is None:
            raise ValueError(
                "LookAroundViTForPreTraining needs group_ids and target_positions (a plan); "
                "hf_lookaround.vision.ImagePlanCollator emits them"
            )
        outputs = self.vit(
            pixel_values, group_ids=group_ids, target_positions=target_positions,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        logits = self.decoder(outputs.query_hidden_state)
        slots = outputs.target_positions
        valid = (slots >= 1).to(logits.dtype)[..., None]
        target = self.target_patches(pixel_values).gather(
            1, (slots - 1).clamp(min=0)[..., None].expand(-1, -1, logits.shape[-1])
        )
        # mean over the pixels of real target slots; padded slots weigh nothing
        squared = (logits.float() - target) ** 2 * valid
        loss = squared.sum() / (valid.sum() * logits.shape[-1]).clamp(min=1)
        return LookAroundViTForPreTrainingOutput(
            loss=loss,
            logits=logits,
            target_positions=slots,
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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutput:
        r"""labels (`(B,)`): class ids in ``[0, num_labels)``, or floats for regression / multi-label."""
        outputs = self.vit(pixel_values, output_hidden_states=output_hidden_states,
                           output_attentions=output_attentions)
        logits = self.classifier(self.dropout(outputs.pooler_output))
        loss = None
        if labels is not None:
            labels = labels.to(logits.device)
            if (self.config.problem_type in (None, "single_label_classification") and self.num_labels > 1
                    and labels.dtype in (torch.long, torch.int) and not torch.compiler.is_compiling()
                    and labels.numel() and (labels.min() < 0 or labels.max() >= self.num_labels)):
                raise ValueError(f"class labels must lie in [0, {self.num_labels}), got {labels.unique().tolist()}")
            loss = self.loss_function(labels, logits, self.config)
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
]
