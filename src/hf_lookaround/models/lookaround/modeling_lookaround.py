"""The LookAround model: one two-stream transformer for every pretraining objective.

Every objective is a *plan*: a group rank ``g[i]`` per token (see ``plans.py``). Two streams share
every weight (XLNet's two-stream attention):

- the content stream at ``i`` attends to ``j`` iff ``g[j] <= g[i]`` (it sees its own group);
- the query stream at ``i`` attends to content ``j`` iff ``g[j] < g[i]`` (never its own token).

The query stream starts from a learned vector plus the position of its target and is run only at
the target positions; its output there gives the prediction. Both streams go through each layer
as one sequence ``[content; query]`` that attends to the content keys, so every layer makes one
call to the attention backend (eager, SDPA or FlexAttention) through transformers' attention
interface. The single-stream forms reuse the content stream: causal is the plan ``g[i] = i``,
bidirectional is ``g = 0``.

Decoding: a KV cache holds the content stream's keys and values only. A forward with a cache takes the ranks of
all keys (cached and current), and query rows may be given explicitly by position and rank, e.g. at the
positions of the next group, whose tokens do not exist yet. ``config.prediction_stream`` says which stream a
checkpoint was trained to predict with; the causal and masked LM heads (``generate()``, ``fill-mask``) use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.dynamic_module_utils import custom_object_save
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    ModelOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_lookaround import (GLU_ACTIVATIONS, LEGACY_QUERY_STREAM_OBJECTIVES, LookAroundConfig,
                                     with_prediction_stream)
from .checks_lookaround import (
    check_backbone_inputs,
    check_block_diffusion_layout,
    check_masked_lm_query_inputs,
    check_next_token_view_inputs,
    check_pretraining_inputs,
    check_single_stream_head_inputs,
)
# generate(..., group_size=t): semi-AR group decoding; the next-token view of dar's one-stream form
from .loading_lookaround import check_loaded, check_weights_files
from .decoding_lookaround import is_block_diffusion_model, is_one_stream_group_model
from .features_lookaround import reads_query_stream, token_states
from .generation_lookaround import GroupDecodingMixin
from .inputs_lookaround import PreparedInputs
from .layout_lookaround import one_stream_next_token_layouts
from .masking_lookaround import (
    AUTO_ATTENTION,
    FLEX_ATTENTION_MIN_KEYS,
    NO_TARGET_RANK,
    STATIC_PLANS,
    AttentionPlan,
    PreparedAttention,
    block_diffusion_plan,
    build_prepared_attention,
    cache_lengths,
    create_plan_mask,
    infilling_ranks,
    may_attend,
    mixed_row_masks,
    register_auto_attention,
    resolve_attention_implementation,
    static_masks,
)


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------
class LookAroundRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon)).to(dtype)


def make_norm(config: LookAroundConfig) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return LookAroundRMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class LookAroundRotaryEmbedding(nn.Module):
    """RoPE over the original token positions, so it is correct in whatever order a plan predicts. The frequencies
    of a scaled variant (`config.rope_parameters`: linear, llama3, yarn) come from transformers' ROPE_INIT_FUNCTIONS,
    so a converted Llama or Qwen rotates exactly as the source did."""

    inv_freq: torch.Tensor

    def __init__(self, config: LookAroundConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters.get("rope_type", "default")
        inv_freq, self.attention_scaling = self.compute_rope()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def compute_rope(self) -> tuple[torch.Tensor, float]:
        """(inverse frequencies, the factor cos and sin are scaled by: 1 but for yarn)."""
        if self.rope_type != "default":
            return ROPE_INIT_FUNCTIONS[self.rope_type](self.config, None)
        dim, base = self.config.head_dim, self.config.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    def compute_inv_freq(self) -> torch.Tensor:
        return self.compute_rope()[0]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_scaling == 1.0:
            return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, L, d); cos/sin: (B, L, d)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
):
    if module.num_key_value_groups > 1:  # grouped-query attention: each key/value head serves a group of heads
        key = key.repeat_interleave(module.num_key_value_groups, dim=1)
        value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class LookAroundAttention(nn.Module):
    """Self-attention where all rows (content, then query stream) read the content keys and values."""

    def __init__(self, config: LookAroundConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # the mask always comes from the plan
        bias = config.attention_bias
        query_width = config.num_attention_heads * config.head_dim
        key_value_width = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, query_width, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, key_value_width, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, key_value_width, bias=bias)
        self.o_proj = nn.Linear(query_width, config.hidden_size, bias=config.attention_output_bias)
        if config.qk_norm:  # Qwen3: each head's queries and keys normalised before RoPE
            self.q_norm = LookAroundRMSNorm(config.head_dim, eps=config.norm_eps)
            self.k_norm = LookAroundRMSNorm(config.head_dim, eps=config.norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        num_content: int,
        attention_mask,
        row_factor: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        past_key_values: Cache | None = None,
        rows_from: int = 0,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``rows_from:`` attend (all of them by default); keys and values come from the first
        ``num_content`` rows. The output has the attending rows only."""
        batch = hidden_states.shape[0]
        attending = hidden_states[:, rows_from:] if rows_from else hidden_states
        rows = attending.shape[1]
        query = self.q_norm(self.q_proj(attending).view(batch, rows, -1, self.head_dim)).transpose(1, 2)
        content = hidden_states[:, :num_content]  # keys and values come from the content stream only
        key = self.k_norm(self.k_proj(content).view(batch, num_content, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(content).view(batch, num_content, -1, self.head_dim).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query = apply_rotary(query, cos[:, rows_from:], sin[:, rows_from:])
            key = apply_rotary(key, cos[:, :num_content], sin[:, :num_content])
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.config.attention_dropout,
            scaling=self.scaling,
            is_causal=attention_mask is None,  # no mask only on the plain causal fast path (create_plan_mask)
        )
        if row_factor is not None:
            attn_output = attn_output * row_factor
        attn_output = attn_output.reshape(batch, rows, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


class LookAroundMLP(nn.Module):
    def __init__(self, config: LookAroundConfig):
        super().__init__()
        self.is_glu = config.hidden_act in GLU_ACTIVATIONS
        act = GLU_ACTIVATIONS.get(config.hidden_act, config.hidden_act)
        bias = config.mlp_bias
        if self.is_glu:
            self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_glu:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act_fn(self.up_proj(x)))


def apply_norm(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return norm(hidden_states)


def skip_norm(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


class LookAroundLayer(GradientCheckpointingLayer):
    """One block, applied to ``[content; query]`` rows with shared weights."""

    def __init__(self, config: LookAroundConfig, layer_idx: int):
        super().__init__()
        # pre-norm normalises a branch's input, post-norm (BERT) the residual sum after it: chosen once, here
        pre_norm = config.norm_position == "pre"
        self.norm_before = apply_norm if pre_norm else skip_norm
        self.norm_after = skip_norm if pre_norm else apply_norm
        self.self_attn = LookAroundAttention(config, layer_idx)
        self.mlp = LookAroundMLP(config)
        self.attention_norm = make_norm(config)
        self.mlp_norm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        hidden_states: torch.Tensor,
        num_content: int,
        attention_mask=None,
        row_factor: torch.Tensor | None = None,
        position_embeddings=None,
        past_key_values: Cache | None = None,
        rows_from: int = 0,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns rows ``rows_from:`` (all by default; the last layer of a step whose content output nobody reads
        passes ``num_content`` and runs the query stream alone, its content rows still giving keys and values)."""
        residual = hidden_states[:, rows_from:] if rows_from else hidden_states
        attn, weights = self.self_attn(
            self.norm_before(self.attention_norm, hidden_states), num_content, attention_mask, row_factor,
            position_embeddings, past_key_values, rows_from=rows_from, **kwargs,
        )
        hidden_states = self.norm_after(self.attention_norm, residual + self.dropout(attn))
        mlp_out = self.mlp(self.norm_before(self.mlp_norm, hidden_states))
        hidden_states = self.norm_after(self.mlp_norm, hidden_states + self.dropout(mlp_out))
        return hidden_states, weights


class LookAroundContentRows(nn.Module):
    """The content stream's rows of ``[content; query]``. The backbone passes each layer's input and the final
    state through it, so that `_can_record_outputs` records them as `hidden_states`."""

    def forward(self, hidden_states: torch.Tensor, num_content: int) -> torch.Tensor:
        return hidden_states[:, :num_content]


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------
@dataclass
class LookAroundModelOutput(ModelOutput):
    """
    last_hidden_state (`(B, T, D)`): the content stream.
    query_hidden_state (`(B, M, D)`, two-stream only): the query stream's rows (at `target_positions`, or the
        explicit `query_position_ids` / `query_group_ids`).
    target_positions (`(B, M)`, with `group_ids` and no explicit rows): positions of the query rows, -1 for padding.
    past_key_values: the content stream's KV cache, with `use_cache` (query rows never enter it).
    hidden_states: the content stream after the embeddings and after each layer, if asked for.
    attentions: attention weights of each layer (eager only), if asked for.
    """

    last_hidden_state: torch.FloatTensor | None = None
    query_hidden_state: torch.FloatTensor | None = None
    target_positions: torch.LongTensor | None = None
    past_key_values: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class LookAroundForPreTrainingOutput(ModelOutput):
    """
    loss: mean cross-entropy over the targets of the plan.
    logits (`(B, M, V)`): predictions of the query stream at `target_positions`.
    target_positions (`(B, M)`): the positions predicted, -1 for padding slots (None with explicit query rows).
    past_key_values: the content stream's KV cache, with `use_cache`.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    target_positions: torch.LongTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    past_key_values: Cache | None = None


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------
class LookAroundPreTrainedModel(PreTrainedModel):
    config_class = LookAroundConfig
    config: LookAroundConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LookAroundLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # hidden_states: the content rows of each layer's input and of the final state (the query rows are not recorded)
    _can_record_outputs = {
        "hidden_states": OutputRecorder(LookAroundContentRows, capture_initial_hidden_state=False),
        "attentions": OutputRecorder(LookAroundAttention, index=1),
    }

    def unused_parameter_names(self) -> list[str]:
        """Parameters this head's forward never uses (frozen, so that DDP with `find_unused_parameters=False`
        and optimizers see only trained ones). Heads override it."""
        return []

    def freeze_unused_parameters(self) -> None:
        for name in self.unused_parameter_names():
            self.get_parameter(name).requires_grad_(False)

    def post_init(self):
        super().post_init()
        self.freeze_unused_parameters()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        # a cut weights file is refused in one line before transformers reads it (loading_lookaround)
        if pretrained_model_name_or_path is not None:
            check_weights_files(pretrained_model_name_or_path)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    @staticmethod
    def _finalize_model_loading(model, load_config, loading_info):
        # loading replaces parameters by new ones that require grad: freeze the unused ones again
        loading_info = PreTrainedModel._finalize_model_loading(model, load_config, loading_info)
        if isinstance(model, LookAroundPreTrainedModel):
            model.freeze_unused_parameters()
        # incomplete or non-finite weights, or an unfinished run, are refused wherever from_pretrained runs
        check_loaded(model, load_config.pretrained_model_name_or_path, loading_info.missing_keys)
        return loading_info

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        if attn_implementation == AUTO_ATTENTION:  # our kernel is registered where it is first asked for
            register_auto_attention()
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    @classmethod
    def is_remote_code(cls) -> bool:
        # FSDP2's fully_shard swaps the class for a subclass `FSDP<Name>` defined in torch: transformers would write
        # torch's module as the remote code; `save_pretrained` writes ours for it
        return super().is_remote_code() and unsharded_class(cls) is cls

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        own_class = unsharded_class(type(self))
        if own_class is not type(self) and own_class.is_remote_code() and self.should_save_on_this_rank(is_main_process):
            # what transformers does for a remote-code model, for our class: our files, `auto_map` naming it
            os.makedirs(save_directory, exist_ok=True)
            custom_object_save(object.__new__(own_class), save_directory, config=self.config)
        return super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LookAroundModel):
            init.normal_(module.query_embedding, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LookAroundRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())


def unsharded_class(cls: type) -> type:
    """The model class under FSDP2's dynamic `FSDP<Name>` subclass (the class itself when not sharded)."""
    if not cls.__name__.startswith("FSDP"):
        return cls
    name = cls.__name__.removeprefix("FSDP")
    return next((base for base in cls.__mro__[1:] if base.__name__ == name), cls)


@dataclass
class _Rows:
    plan: AttentionPlan
    row_positions: torch.Tensor  # (B, L) position id of each row (a query row: its target's)
    target_positions: torch.Tensor | None
    two_stream: bool
    num_query: int
    pattern: str
    key_len: int


def layer_masks(masks: PreparedAttention | None) -> tuple:
    """(attention_mask, row_factor) for a layer; (None, None) on the causal fast path (SDPA's own causal kernel)."""
    return (None, None) if masks is None else (masks.mask, masks.row_factor)


class LookAroundModel(LookAroundPreTrainedModel):
    """The shared backbone: two-stream with `group_ids`, single-stream (causal or bidirectional) without."""

    def __init__(self, config: LookAroundConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.query_embedding = nn.Parameter(torch.zeros(config.hidden_size))  # query stream's start vector
        if config.position_embedding_type == "absolute":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        else:
            self.rotary_emb = LookAroundRotaryEmbedding(config)
        self.layers = nn.ModuleList([LookAroundLayer(config, i) for i in range(config.num_hidden_layers)])
        # pre-norm needs a final norm; post-norm normalises the embeddings instead (as BERT does)
        self.norm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.content_rows = LookAroundContentRows()
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        group_ids: torch.LongTensor | None = None,
        target_positions: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        attention_pattern: str | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        query_position_ids: torch.LongTensor | None = None,
        query_group_ids: torch.LongTensor | None = None,
        prepared: PreparedInputs | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LookAroundModelOutput:
        r"""
        Ranks of the keys. The keys are the cached tokens (if `past_key_values` holds any, `past_len` of them) then
        the T current tokens; every key-indexed input covers all of them, as `attention_mask` does.

        group_ids (`(B, past_len + T)` long, optional): the plan's group rank of every key (without a cache,
            `(B, T)`). Given, the model runs the content and query streams; absent, ranks follow
            `attention_pattern` (causal: a token's rank is its index among the keys; bidirectional: all 0).
        target_positions (`(B, M)` long, optional): run the query stream at these current positions (indices
            into the T input tokens, -1 pads a slot); each row takes the rank and position of its token.
            Default with `group_ids` and no explicit query rows: every current position.
        query_position_ids, query_group_ids (`(B, M)` long, optional): query-stream rows given explicitly, instead of
            `target_positions`: the position id of each row's target (it may lie past the input, e.g. the next
            group, whose tokens do not exist yet) and its rank (`NO_TARGET_RANK` = -1 pads a slot). They read
            every key (cache and current content) under the same rule as every other row (`may_attend`).
        attention_pattern (`"causal"` or `"bidirectional"`, optional): the ranks without `group_ids`;
            defaults to `config.default_attention`.
        past_key_values (`Cache`, optional), use_cache: keys and values of the content stream of earlier tokens;
            those of the current tokens are appended. Query rows never enter the cache.
        prepared (`PreparedInputs`, optional): how the forward runs beyond these inputs (`inputs_lookaround`): masks
            built outside a compiled step, `content_output=False` when nothing reads the content stream's output
            (the last layer then runs the query rows alone and `last_hidden_state` is None), a one-stream mixture
            batch's `row_kind`. A batch may carry them as keys (`prepared_attention`, `content_output`, `row_kind`).
        kwargs: transformers' output flags (`output_hidden_states`, `output_attentions`, `return_dict`), read by
            `capture_outputs`.
        """
        prepared = PreparedInputs.take(prepared, kwargs)
        output_hidden_states, output_attentions = self._output_flags(kwargs)
        use_cache, past_key_values = self._kv_cache(use_cache, past_key_values)
        check_backbone_inputs(
            self.config, input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            group_ids=group_ids, target_positions=target_positions, position_ids=position_ids,
            attention_pattern=attention_pattern, query_position_ids=query_position_ids,
            query_group_ids=query_group_ids, past_key_values=past_key_values, row_kind=prepared.row_kind,
            output_attentions=output_attentions,
        )
        inputs_embeds = self.embed(input_ids, inputs_embeds)
        seq_len = inputs_embeds.shape[1]
        rows, masks, query_rows_alone = self._rows_and_masks(
            inputs_embeds, attention_mask, group_ids, target_positions, position_ids, attention_pattern,
            past_key_values, query_position_ids, query_group_ids, prepared, output_hidden_states, output_attentions)

        hidden, position_embeddings = self._embed_streams(inputs_embeds, rows)
        for layer in self.layers[:-1] if query_rows_alone else self.layers:
            self.content_rows(hidden, seq_len)  # recorded as a hidden state
            hidden, _ = layer(hidden, seq_len, *layer_masks(masks), position_embeddings, past_key_values)
        if query_rows_alone:
            hidden, _ = self.layers[-1](hidden, seq_len, masks.query_mask, masks.query_row_factor,
                                        position_embeddings, past_key_values, rows_from=seq_len)
        if self.config.norm_position == "pre":
            hidden = self.norm(hidden)
        content_state = self.content_rows(hidden, seq_len)  # recorded as the last hidden state
        content_state = None if query_rows_alone else content_state
        query_state = hidden[:, hidden.shape[1] - rows.num_query:]  # the last rows: the query stream
        return LookAroundModelOutput(
            last_hidden_state=content_state,
            query_hidden_state=query_state if rows.two_stream else None,
            target_positions=rows.target_positions,
            past_key_values=past_key_values if use_cache else None,
        )

    def _kv_cache(self, use_cache: bool | None, past_key_values: Cache | None) -> tuple[bool, Cache | None]:
        """A cache only outside training; an empty one when asked for a cache without one."""
        use_cache = bool(use_cache) and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        return use_cache, past_key_values

    def _rows_and_masks(self, inputs_embeds, attention_mask, group_ids, target_positions, position_ids,
                        attention_pattern, past_key_values, query_position_ids, query_group_ids, prepared,
                        output_hidden_states, output_attentions):
        """The rows of both streams (ranks, positions, the attention plan: `_rows`), the masks the layers take
        (`create_plan_mask`; None on the causal fast path) and whether the last layer runs the query rows alone."""
        batch, seq_len, _ = inputs_embeds.shape
        rows = self._rows(batch, seq_len, inputs_embeds.device, attention_mask, group_ids, target_positions,
                          position_ids, attention_pattern, past_key_values, query_position_ids, query_group_ids,
                          prepared.revealed_keys)
        # nobody reads the content stream's output: the last layer runs the query rows alone
        query_rows_alone = not prepared.content_output and rows.num_query > 0 and not output_hidden_states \
            and not output_attentions
        unpadded = not rows.two_stream and attention_mask is None and rows.key_len == seq_len and not output_attentions
        static_group_size = self._static_group_size(rows, unpadded)
        masks = create_plan_mask(rows.plan, self.config._attn_implementation, inputs_embeds.dtype, seq_len,
                                 plain_causal=unpadded and rows.pattern == "causal", query_rows_alone=query_rows_alone,
                                 prepared=prepared.attention, static_group_size=static_group_size,
                                 row_kind=prepared.row_kind, static_pattern=rows.pattern)
        return rows, masks, query_rows_alone

    def _embed_streams(self, inputs_embeds: torch.Tensor, rows: "_Rows") -> tuple[torch.Tensor, tuple | None]:
        """The first layer's input: the content rows, then (two-stream) the query rows, each with its (target's)
        position; and RoPE's position embeddings (None with absolute positions, which are added here)."""
        hidden = inputs_embeds
        if rows.two_stream:  # the query stream starts from a learned vector
            query = self.query_embedding.to(inputs_embeds.dtype).expand(inputs_embeds.shape[0], rows.num_query, -1)
            hidden = torch.cat([inputs_embeds, query], dim=1)
        position_embeddings = None
        if self.config.position_embedding_type == "rope":
            position_embeddings = self.rotary_emb(hidden, rows.row_positions)
        else:  # each row, content or query, gets the embedding of its (target's) original position
            hidden = hidden + self.embed_positions(rows.row_positions)
        if self.config.norm_position == "post":
            hidden = self.norm(hidden)
        return self.dropout(hidden), position_embeddings

    def _output_flags(self, kwargs) -> tuple[bool, bool]:
        """(output_hidden_states, output_attentions) as `capture_outputs` resolves them (the call's, else the config's):
        either needs every layer to run every row."""
        return tuple(bool(kwargs.get(name, getattr(self.config, name, False)))
                     for name in ("output_hidden_states", "output_attentions"))

    def _static_group_size(self, rows, unpadded: bool) -> int | None:
        """The group (or block) size of a block-causal or block-diffusion forward whose masks are the same for every
        batch (no padding, no cache): built once per shape (`STATIC_PLANS`)."""
        return self.config.attention_group_size if unpadded and rows.pattern in STATIC_PLANS else None

    def embed(self, input_ids: torch.LongTensor | None, inputs_embeds: torch.FloatTensor | None) -> torch.Tensor:
        """The content stream's input: token embeddings (or the given ones)."""
        return self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds

    def prepare_attention(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        group_ids: torch.LongTensor | None = None,
        target_positions: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        attention_pattern: str | None = None,
        query_position_ids: torch.LongTensor | None = None,
        query_group_ids: torch.LongTensor | None = None,
        content_output: bool = True,
        dtype: torch.dtype | None = None,
        row_kind: torch.LongTensor | None = None,
        revealed_keys: torch.BoolTensor | None = None,
        **unused,
    ) -> PreparedAttention:
        """The masks of a forward without a cache, built now (on the inputs' device) for `forward(...,
        prepared_attention=...)`: call it outside a compiled step, once per batch. Takes the same batch as
        `forward` (other keys, e.g. labels, are ignored). `content_output=False` also builds the query rows' own
        mask for a forward that does not return the content stream. `dtype`: the hidden states' (default: the
        embeddings'), which only the eager backend's additive mask depends on."""
        check_backbone_inputs(
            self.config, input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
            group_ids=group_ids, target_positions=target_positions, position_ids=position_ids,
            attention_pattern=attention_pattern, query_position_ids=query_position_ids,
            query_group_ids=query_group_ids, row_kind=row_kind,
        )
        inputs = input_ids if input_ids is not None else inputs_embeds
        batch, seq_len = inputs.shape[:2]
        rows = self._rows(batch, seq_len, inputs.device, attention_mask, group_ids, target_positions, position_ids,
                          attention_pattern, None, query_position_ids, query_group_ids, revealed_keys)
        dtype = dtype or self.embed_tokens.weight.dtype
        static = self._static_group_size(rows, unpadded=not rows.two_stream and attention_mask is None)
        with_query_rows = not content_output and rows.two_stream and rows.num_query > 0
        if rows.plan.annealed:  # the same masks as forward's: this batch's own while annealing
            return create_plan_mask(rows.plan, self.config._attn_implementation, dtype, seq_len,
                                    query_rows_alone=with_query_rows, static_group_size=static, row_kind=row_kind)
        if row_kind is not None:  # a one-stream mixture: each row's mask selected by its kind
            return mixed_row_masks(row_kind, static, seq_len, self.config._attn_implementation, dtype)
        if static is not None:  # the same masks as forward's: built once per shape
            return static_masks(rows.pattern, static, seq_len, self.config._attn_implementation, dtype, inputs.device)
        return build_prepared_attention(rows.plan, self.config._attn_implementation, dtype, seq_len,
                                        with_query_rows=with_query_rows)

    def _rows(self, batch, seq_len, device, attention_mask, group_ids, target_positions, position_ids,
              attention_pattern, past_key_values, query_position_ids, query_group_ids, revealed_keys=None) -> "_Rows":
        """Ranks and positions of every row (content, then query stream) and key, and the attention plan (of inputs
        that `check_backbone_inputs` passed). `revealed_keys`: attention-mask annealing (`PreparedInputs`)."""
        explicit_rows = query_position_ids is not None or query_group_ids is not None
        two_stream = group_ids is not None or explicit_rows

        # past_len is an int, or a 0-d tensor for a static cache (so that a compiled step does not recompile)
        past_len, key_len = cache_lengths(past_key_values, seq_len)
        key_valid = self._key_valid(attention_mask, batch, past_len, seq_len, key_len, device)
        # a materialised (B, T) index, not a stride-0 expand: it feeds gathers, cat and the position embedding
        content_index = (past_len + torch.arange(seq_len, device=device)).repeat(batch, 1)  # among the keys
        pattern = attention_pattern or self.config.default_attention
        block_diffusion = group_ids is None and pattern == "block_diffusion"
        if position_ids is None:  # BD3-LM's x_t ⊕ x_0: both copies of token i have position i
            position_ids = content_index % (seq_len // 2) if block_diffusion else content_index
        elif position_ids.shape != (batch, seq_len):
            position_ids = position_ids.expand(batch, seq_len)
        position_ids = position_ids.to(device)

        key_is_noised = None
        if block_diffusion:  # no cache (check_backbone_inputs): the layout's ranks and its noised half
            layout = block_diffusion_plan(self.config.attention_group_size, seq_len, device, key_valid)
            key_rank, key_is_noised = layout.key_rank, layout.key_is_noised
        elif group_ids is not None:
            key_rank = self._plan_key_ranks(group_ids, batch, past_len, seq_len, key_len, device)
        elif pattern == "causal":
            key_rank = torch.arange(key_len, device=device).expand(batch, key_len)
        elif pattern == "bidirectional":
            key_rank = torch.zeros(batch, key_len, dtype=torch.long, device=device)
        else:  # block_causal: groups of t consecutive keys, a key's rank is its group's index
            key_rank = torch.div(torch.arange(key_len, device=device), self.config.attention_group_size,
                                 rounding_mode="floor").expand(batch, key_len)
        content_rank = key_rank.gather(1, content_index)

        row_positions, row_rank, num_query = position_ids, content_rank, 0
        if two_stream:
            if not explicit_rows:
                if target_positions is None:
                    target_positions = torch.arange(seq_len, device=device).repeat(batch, 1)
                query_position_ids, query_group_ids = self._rows_at_targets(
                    target_positions, content_rank, position_ids, batch, seq_len
                )
            else:
                query_position_ids, query_group_ids = self._explicit_rows(query_position_ids, query_group_ids, batch, device)
            num_query = query_group_ids.shape[1]
            row_positions = torch.cat([position_ids, query_position_ids], dim=1)
            row_rank = torch.cat([content_rank, query_group_ids], dim=1)
        row_is_query = torch.arange(seq_len + num_query, device=device) >= seq_len
        plan = AttentionPlan(
            query_rank=row_rank,
            # the x_t rows of BD3-LM's layout are strict: they see the clean keys of earlier blocks only
            query_is_strict=row_is_query.repeat(batch, 1) if key_is_noised is None else key_is_noised,
            key_rank=key_rank,
            key_valid=key_valid,
            key_is_noised=key_is_noised,
        )
        if revealed_keys is not None:  # annealing: the keys are the current tokens, at their positions
            if key_len != seq_len or revealed_keys.shape != (batch, seq_len):
                raise ValueError(f"revealed_keys (attention-mask annealing) must have the shape of the input, "
                                 f"{(batch, seq_len)}, without a cache; got {tuple(revealed_keys.shape)}"
                                 + (f" and {key_len - seq_len} cached keys" if key_len != seq_len else ""))
            plan = dataclasses.replace(plan, row_position=row_positions, key_position=position_ids,
                                       key_revealed=revealed_keys.to(device=device, dtype=torch.bool))
        return _Rows(plan, row_positions, target_positions, two_stream, num_query, pattern, key_len)

    def _rows_at_targets(self, target_positions, content_rank, position_ids, batch, seq_len):
        """Query rows at current tokens: each takes its token's rank and position (-1 slots get NO_TARGET_RANK)."""
        target_positions = target_positions.to(content_rank.device)
        is_slot = target_positions >= 0
        gather_at = target_positions.clamp(min=0)
        ranks = torch.where(is_slot, content_rank.gather(1, gather_at), NO_TARGET_RANK)
        return position_ids.gather(1, gather_at), ranks

    @staticmethod
    def _explicit_rows(query_position_ids, query_group_ids, batch, device):
        query_position_ids = query_position_ids.to(device=device, dtype=torch.long)
        query_group_ids = query_group_ids.to(device=device, dtype=torch.long)
        is_slot = query_group_ids != NO_TARGET_RANK
        # padding slots see nothing; any valid position will do for them
        return torch.where(is_slot, query_position_ids, 0), query_group_ids

    def _plan_key_ranks(self, group_ids, batch, past_len, seq_len, key_len, device) -> torch.Tensor:
        """Ranks of all keys from `group_ids` (B, past_len + T); a static cache's empty slots get rank 0 (invalid)."""
        width = group_ids.shape[-1]
        group_ids = group_ids.to(device=device, dtype=torch.long)
        return F.pad(group_ids, (0, key_len - width)) if width < key_len else group_ids

    @staticmethod
    def _key_valid(attention_mask, batch, past_len, seq_len, key_len, device) -> torch.Tensor:
        """(B, key_len) bool: real tokens. A static cache's slots past the current tokens are never valid."""
        if attention_mask is None:
            return (torch.arange(key_len, device=device) < past_len + seq_len).expand(batch, key_len)
        width = attention_mask.shape[-1]
        valid = attention_mask.to(device) != 0
        return F.pad(valid, (0, key_len - width)) if width < key_len else valid


def positions_of(is_target: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """(B, T) bool -> (B, M) indices of the True entries of each row, in order, padded with -1.

    M is the largest count in the batch (a host sync), or `width` if given (entries past it are left out), at most
    T. No sort: each True entry goes to the slot given by the number of True entries before it."""
    if width is None:
        width = int(is_target.sum(-1).max()) if is_target.numel() else 0
    width = min(width, is_target.shape[1])
    slot = is_target.long().cumsum(-1) - 1
    slot = torch.where(is_target & (slot < width), slot, width)  # the rest go to a spare column
    positions = torch.full((is_target.shape[0], width + 1), -1, dtype=torch.long, device=is_target.device)
    indices = torch.arange(is_target.shape[1], device=is_target.device).expand_as(slot)
    return positions.scatter_(1, slot, indices)[:, :width]


logger = logging.get_logger(__name__)


def loss_or_zero(loss: torch.Tensor | None, logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False):
    """A batch without any target (every label -100) has no loss to average: cross-entropy gives nan (0 / 0),
    which would poison the weights. Its loss is defined as 0 (no gradient), with a warning."""
    if loss is None or torch.compiler.is_compiling():
        return loss
    counted = labels[..., 1:] if shifted else labels
    if counted.numel() and bool((counted != -100).any()):
        return loss
    logger.warning_once("a batch has no target (every label is -100): its loss is 0 instead of nan, and it trains "
                        "nothing; check the collator or the labels")
    return logits.sum() * 0.0


def check_loss_weights(loss_weights: torch.Tensor, labels: torch.Tensor) -> None:
    if loss_weights.shape != labels.shape:
        raise ValueError(f"loss_weights must have the shape of the labels {tuple(labels.shape)}, got "
                         f"{tuple(loss_weights.shape)}")


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, loss_weights: torch.Tensor, num_items_in_batch=None):
    """Cross-entropy with a weight per label: `sum(w * ce) / the number of labels` (`num_items_in_batch` under
    gradient accumulation), the unweighted loss when every `w` is 1. The diffusion objectives' collators give the
    weights that make it the negative ELBO per token (`objectives/mdlm.py`)."""
    check_loss_weights(loss_weights, labels)
    labels = labels.to(logits.device)
    ce = nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100,
                                     reduction="none")
    count = num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum()
    return (ce * loss_weights.flatten().to(ce)).sum() / count


class LookAroundLMHeadMixin:
    """An LM head tied to the input embeddings (all generating heads share the name `lm_head`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings


class LookAroundForPreTraining(LookAroundLMHeadMixin, LookAroundPreTrainedModel):
    """Two-stream pretraining: the LM head reads the query stream at the targets of the plan."""

    def __init__(self, config: LookAroundConfig):
        # this head trains the query stream: its own config says so (the caller's is left alone)
        config = with_prediction_stream(config, "query")
        if config.prediction_stream == "content" and config.objective == "ar":
            logger.warning("this checkpoint was trained single-stream (GPT's form of ar: the causal content stream "
                           "predicts the next token); this pretraining head reads its query stream, which was never "
                           "trained: load it with AutoModelForCausalLM (load_pretrained(..., head='causal-lm'))")
        super().__init__(config)
        self.loss_type = "ForMaskedLM"  # cross-entropy over the labelled targets, as a masked LM's
        self.model = LookAroundModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        group_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        target_positions: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        query_position_ids: torch.LongTensor | None = None,
        query_group_ids: torch.LongTensor | None = None,
        return_last_hidden_state: bool | None = None,
        query_target_ids: torch.LongTensor | None = None,
        loss_weights: torch.FloatTensor | None = None,
        prepared: PreparedInputs | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> LookAroundForPreTrainingOutput:
        r"""
        group_ids (`(B, T)`, or `(B, past_len + T)` with a cache): the plan (required). labels (`(B, T)`): the token
        to predict at each position, -100 where there is no loss. target_positions (`(B, M)`): where to predict;
        default: where labels are set, or every position without labels. For a compiled step pass them padded to a
        fixed width (collators' `pad_targets_to`); without them a compiled graph uses width T. query_position_ids /
        query_group_ids, past_key_values / use_cache: explicit query rows and the content cache, as in
        `LookAroundModel.forward` (the logits are then those of the explicit rows).
        prepared (`PreparedInputs`, optional): e.g. the masks from `model.prepare_attention(**batch)`, built outside
        a compiled step (a batch may carry them as `prepared_attention`).
        return_last_hidden_state (`bool`, optional): compute the content stream's final state. Default: only
        without labels; with labels the loss reads the query stream alone, so the last layer skips the content rows
        (the loss and its gradients are unchanged) and `last_hidden_state` is None.
        query_target_ids (`(B, M)`, with explicit query rows): the token each query row predicts, -100 for none; the
        loss is taken over them (`drop_unread_content` makes such a batch). Not called "labels": `Trainer` takes
        every forward argument with "label" in its name for a label it must find in each batch.
        loss_weights (like `labels`, or like `query_target_ids`): a weight per target in the loss (`weighted_loss`;
        the diffusion objectives' collators emit them).
        """
        check_pretraining_inputs(self.config, input_ids, inputs_embeds, group_ids, labels, query_position_ids,
                                 query_group_ids, query_target_ids)
        if labels is not None and target_positions is None:
            # a compiled graph cannot size the slots by the data: it takes every position
            width = labels.shape[1] if torch.compiler.is_compiling() else None
            target_positions = positions_of(labels != -100, width)
        if return_last_hidden_state is None:
            return_last_hidden_state = labels is None and query_target_ids is None
        prepared = PreparedInputs.take(prepared, kwargs).with_content_output(return_last_hidden_state)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, group_ids=group_ids,
            target_positions=target_positions, position_ids=position_ids, inputs_embeds=inputs_embeds,
            past_key_values=past_key_values, use_cache=use_cache, query_position_ids=query_position_ids,
            query_group_ids=query_group_ids, prepared=prepared, **kwargs,
        )
        logits = self.lm_head(outputs.query_hidden_state)
        loss = None
        if labels is not None:
            slots = outputs.target_positions
            target_labels = torch.where(slots >= 0, labels.gather(1, slots.clamp(min=0)), -100)
            if loss_weights is not None:
                check_loss_weights(loss_weights, labels)
                weights = loss_weights.to(slots.device).gather(1, slots.clamp(min=0))
                loss = weighted_loss(logits, target_labels, weights, kwargs.get("num_items_in_batch"))
            else:
                loss = self.loss_function(logits, target_labels, vocab_size=self.config.vocab_size, num_items_in_batch=kwargs.get("num_items_in_batch"))
            loss = loss_or_zero(loss, logits, labels)
        elif query_target_ids is not None:
            if loss_weights is not None:
                loss = weighted_loss(logits, query_target_ids, loss_weights, kwargs.get("num_items_in_batch"))
            else:
                loss = self.loss_function(logits, query_target_ids, vocab_size=self.config.vocab_size, num_items_in_batch=kwargs.get("num_items_in_batch"))
            loss = loss_or_zero(loss, logits, query_target_ids)
        return LookAroundForPreTrainingOutput(
            loss=loss,
            logits=logits,
            target_positions=outputs.target_positions,
            last_hidden_state=outputs.last_hidden_state,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            past_key_values=outputs.past_key_values,
        )


    def prepare_attention(self, labels: torch.LongTensor | None = None, target_positions=None,
                          return_last_hidden_state: bool | None = None, query_target_ids=None,
                          **batch) -> PreparedAttention:
        """The masks of `forward(**batch)`, built now: call it outside a compiled step, once per batch, and pass the
        result as `prepared=PreparedInputs(attention=...)` (or the batch key `prepared_attention`). Takes the batch
        `forward` takes (a collator's output)."""
        if target_positions is None and labels is not None:
            target_positions = positions_of(labels != -100)
        if return_last_hidden_state is None:
            return_last_hidden_state = labels is None and query_target_ids is None
        return self.model.prepare_attention(target_positions=target_positions,
                                            content_output=return_last_hidden_state, **batch)


class LookAroundSingleOrTwoStreamLM(LookAroundLMHeadMixin, LookAroundPreTrainedModel):
    """An LM head that predicts with the stream the checkpoint was trained on (`config.prediction_stream`)."""

    def __init__(self, config: LookAroundConfig):
        config = with_prediction_stream(config, "content")  # a fresh head trains the classic single-stream form
        super().__init__(config)
        self.model = LookAroundModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def predicts_with_query_stream(self) -> bool:
        return self.config.prediction_stream == "query"

    def unused_parameter_names(self) -> list[str]:
        return [] if self.predicts_with_query_stream else ["model.query_embedding"]


class LookAroundForMaskedLM(LookAroundSingleOrTwoStreamLM):
    """Masked LM over `[MASK]` inputs (BERT-style; works with the `fill-mask` pipeline).

    - `config.prediction_stream == "content"` (checkpoints pretrained single-stream, BERT-style): bidirectional
      single stream; logits at every position come from the content stream.
    - `"query"` (two-stream checkpoints): the pathway pretraining trained, with the ranks of the masked plan. A
      leading BOS has rank 0 alone, every other visible token rank 1 and every position to predict (holding
      `config.mask_token_id`, and with labels also every position whose label is not -100) rank 2 (without a
      leading BOS: 0 and 1); the query stream runs at the positions to predict and sees exactly the visible
      tokens (never the `[MASK]` inputs, nor each other). Logits at those positions are the query stream's. Logits at
      the other positions are the content stream's LM head; a two-stream checkpoint never trained them, so
      they mean nothing (BERT's are near the input token). The loss covers labels != -100, all of which are
      query-stream positions.
    """

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        loss_weights: torch.FloatTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        check_single_stream_head_inputs(self, kwargs, input_ids, inputs_embeds, labels)
        block_diffusion = is_block_diffusion_model(self.config)
        if block_diffusion:
            check_block_diffusion_layout(PreparedInputs.take(None, dict(kwargs)))
        common = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, inputs_embeds=inputs_embeds,
            **kwargs,
        )
        if block_diffusion:  # BD3-LM's x_t ⊕ x_0: logits at every row, the loss at the masked x_t rows (labels)
            outputs = self.model(**common, attention_pattern="block_diffusion")
            logits = self.lm_head(outputs.last_hidden_state)
        elif self.predicts_with_query_stream:
            is_target = self._positions_to_predict(input_ids, attention_mask, labels)
            targets = positions_of(is_target)
            outputs = self.model(**common, group_ids=self._masked_plan_ranks(input_ids, attention_mask, is_target),
                                 target_positions=targets)
            logits = self.lm_head(outputs.last_hidden_state)
            rows, slots = (targets >= 0).nonzero(as_tuple=True)
            query_logits = self.lm_head(outputs.query_hidden_state)
            logits = logits.index_put((rows, targets[rows, slots]), query_logits[rows, slots])
        else:
            outputs = self.model(**common, attention_pattern="bidirectional")
            logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None and loss_weights is not None:  # a weight per label (`weighted_loss`)
            loss = loss_or_zero(weighted_loss(logits, labels, loss_weights, kwargs.get("num_items_in_batch")),
                                logits, labels)
        elif labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=kwargs.get("num_items_in_batch"))
            loss = loss_or_zero(loss, logits, labels)
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )

    def prepare_attention(self, input_ids=None, attention_mask=None, inputs_embeds=None, position_ids=None,
                          revealed_keys=None, **unused):
        """BD3-LM's one-stream form: the masks of `forward(**batch, one_stream_layout=True)`, built now (outside a
        compiled step; without padding or annealing, the static masks built once per shape). Other masked LMs take
        no plan."""
        if not is_block_diffusion_model(self.config):
            raise ValueError("prepare_attention is for BD3-LM's one-stream form (default_attention='block_diffusion'); "
                             "this masked LM builds its bidirectional mask in forward")
        return self.model.prepare_attention(input_ids=input_ids, attention_mask=attention_mask,
                                            inputs_embeds=inputs_embeds, position_ids=position_ids,
                                            attention_pattern="block_diffusion", revealed_keys=revealed_keys)

    def _masked_plan_ranks(self, input_ids, attention_mask, is_target) -> torch.Tensor:
        """The ranks masked pretraining gave a BOS-prefixed block: BOS alone at rank 0, the visible tokens rank 1,
        the positions to predict rank 2; in a row that does not start with a visible BOS, visible rank 0 and
        targets rank 1 (:func:`masking_lookaround.infilling_ranks`)."""
        bos = self.config.bos_token_id
        is_condition = torch.zeros_like(is_target)
        if input_ids is not None and bos is not None:
            first = (input_ids[:, 0] == bos) & ~is_target[:, 0]
            if attention_mask is not None:
                first = first & (attention_mask[:, 0].to(first.device) != 0)
            is_condition[:, 0] = first
        return infilling_ranks(is_target, is_condition)

    def _positions_to_predict(self, input_ids, attention_mask, labels) -> torch.Tensor:
        check_masked_lm_query_inputs(self.config, input_ids, labels)
        mask_id = self.config.mask_token_id
        is_target = input_ids == mask_id if input_ids is not None else torch.zeros_like(labels, dtype=torch.bool)
        if labels is not None:
            is_target = is_target | (labels.to(is_target.device) != -100)
        if attention_mask is not None:
            is_target = is_target & (attention_mask.to(is_target.device) != 0)
        return is_target


class LookAroundForCausalLM(GroupDecodingMixin, LookAroundSingleOrTwoStreamLM, GenerationMixin):
    """Causal LM (GPT-style) with a KV cache for `generate()` (dynamic or static cache).

    - `config.prediction_stream == "content"`: the single-stream causal view; `logits[:, i]` is the content stream
      at `i`.
    - dar's one-stream form (`config.default_attention == "block_causal"`, groups of `t =
      config.attention_group_size`): a row sees its own group and every earlier one and predicts the token `t`
      places ahead, in a layout with start rows (BOS copies). Plain token ids get the causal view all the same:
      `logits[:, i]` predicts token `i + 1` from the tokens `<= i`, read from the `t` layouts of the input (one
      batched forward over `t` times the rows, so it costs `t` forwards' worth; `one_stream_next_token_layouts`).
      `one_stream_layout=True` says the input is already laid out (the collator's batches, which the pretraining
      Trainer passes so): `logits[:, j]` is then row `j`, which predicts the token `t` slots ahead. `generate()`
      decodes a group per forward through the backbone, not through this forward.
    - `"query"` (two-stream checkpoints): the AR plan, the pathway pretraining trained. The content stream is causal
      (a token's rank is its index among the keys) and a query row at position `i + 1` with rank `i + 1` gives
      `logits[:, i]`: it predicts token `i + 1` from the tokens `<= i`, exactly as the AR plan's query stream does.
      Only the rows kept by `logits_to_keep` run (in `generate()`, one per step); the cache holds content only.
      A row whose position would reach `max_position_embeddings` predicts nothing (its logits are meaningless);
      it only occurs after the last token of an input that fills every position.
    Both keep the transformers convention: labels are the input ids, shifted inside.

    A checkpoint pretrained single-stream with a masked objective (BERT's `[MASK]` form) has no causal view: its
    content stream was trained bidirectionally to predict `[MASK]` inputs, so loading it here is refused.
    """

    def __init__(self, config: LookAroundConfig):
        # a masked objective (any but the (semi-)AR and GVP ones) trained on the bidirectional content stream
        masked = config.objective not in (None, *LEGACY_QUERY_STREAM_OBJECTIVES)
        if masked and config.prediction_stream == "content" and config.default_attention == "bidirectional":
            raise ValueError(
                f"this checkpoint was pretrained with {config.objective!r} in the single-stream [MASK] form: its "
                "bidirectional content stream never learned to predict the next token, so it has no causal LM view; "
                "load it with AutoModelForMaskedLM, or score it with `hf-lookaround perplexity --protocol masked`")
        super().__init__(config)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        prepared: PreparedInputs | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""labels (`(B, T)`): the input ids themselves; they are shifted inside, -100 is ignored.
        prepared (`PreparedInputs`, optional): how the forward runs beyond these inputs: the masks from
        `model.prepare_attention(**batch)`, built outside a compiled step; a training layout of dar's one-stream
        form (`one_stream_layout=True`, or a one-stream mixture batch's `row_kind`, whose rows of kind 1 are BERT's
        `[MASK]` rows, bidirectional, with the label at `i + 1` the token masked at `i`): `logits[:, j]` is then row
        `j`'s, and the collator writes at `labels[:, j + 1]` the token row `j` predicts, `t` places ahead. A batch
        may carry them as keys (`prepared_attention`, `one_stream_layout`, `row_kind`).

        One of three modes runs, by what the checkpoint predicts with (see the class): the query stream
        (:meth:`_query_stream_logits`), the next-token view of dar's one-stream form on plain token ids
        (:meth:`_next_token_view_logits`), or the content stream (:meth:`_content_stream_logits`)."""
        if is_block_diffusion_model(self.config):
            raise ValueError("this checkpoint is BD3-LM's one-stream form (x_t ⊕ x_0): it has no causal LM view; "
                             "decode it with generate(diffusion_threshold=...), score it with `hf-lookaround "
                             "perplexity --protocol elbo`, or load it with AutoModelForMaskedLM")
        prepared = PreparedInputs.take(prepared, kwargs)
        check_single_stream_head_inputs(self, kwargs, input_ids, inputs_embeds, labels, prepared.row_kind)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        common = dict(
            input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
            attention_pattern=self.content_pattern, past_key_values=past_key_values, use_cache=use_cache,
            prepared=prepared, **kwargs,
        )
        if self.predicts_with_query_stream:
            mode = self._query_stream_logits
        elif prepared.row_kind is None and self.reads_next_token_from_layouts(prepared.one_stream_layout):
            mode = self._next_token_view_logits
        else:
            mode = self._content_stream_logits
        outputs, logits, full_logits = mode(common, position_ids, keep, labels is not None)
        loss = None
        if labels is not None:
            loss = self.loss_function(full_logits, labels, vocab_size=self.config.vocab_size, num_items_in_batch=kwargs.get("num_items_in_batch"))  # shifts inside
            loss = loss_or_zero(loss, full_logits, labels, shifted=True)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
        )

    # the three modes: each returns (backbone outputs, logits of the kept rows, logits of every row for the loss)
    def _query_stream_logits(self, common: dict, position_ids, keep, with_labels: bool):
        """A two-stream checkpoint: a query row at position `i + 1` with rank `i + 1` gives `logits[:, i]`. With
        labels every row is needed for the loss; otherwise only the kept ones run."""
        inputs = common["input_ids"] if common["input_ids"] is not None else common["inputs_embeds"]
        shape, device = inputs.shape[:2], inputs.device
        rows = torch.arange(shape[1], device=device)
        rows = rows if with_labels else rows[keep]
        query_positions, query_ranks, position_ids = self._next_token_rows(rows, position_ids,
                                                                           common["past_key_values"], shape)
        # the logits read the query rows only: the last layer skips the content rows
        outputs = self.model(**{**common, "prepared": common["prepared"].with_content_output(False)},
                             position_ids=position_ids, query_position_ids=query_positions,
                             query_group_ids=query_ranks)
        full_logits = self.lm_head(outputs.query_hidden_state)
        logits = full_logits[:, keep] if with_labels else full_logits
        return outputs, logits, full_logits

    def _next_token_view_logits(self, common: dict, position_ids, keep, with_labels: bool):
        """dar's one-stream form on plain ids: the row of each next token, from the `t` layouts of the input."""
        layouts, rows = self._next_token_layouts(common, position_ids)
        outputs = self.model(input_ids=layouts, attention_pattern="block_causal")
        hidden = outputs.last_hidden_state.flatten(0, 1)[rows]
        return outputs, *self._kept_and_full_logits(hidden, keep, with_labels)

    def _content_stream_logits(self, common: dict, position_ids, keep, with_labels: bool):
        """The single-stream causal view (or a training layout of dar's one-stream form): row `i`'s content state."""
        outputs = self.model(**common, position_ids=position_ids)
        return outputs, *self._kept_and_full_logits(outputs.last_hidden_state, keep, with_labels)

    def _kept_and_full_logits(self, hidden, keep, with_labels: bool):
        logits = self.lm_head(hidden[:, keep])
        full_logits = None
        if with_labels:
            full_logits = logits if logits.shape[1] == hidden.shape[1] else self.lm_head(hidden)
        return logits, full_logits

    def reads_next_token_from_layouts(self, one_stream_layout: bool) -> bool:
        """dar's one-stream form with groups of `t > 1`, given plain token ids: its rows predict `t` places ahead, so
        the next-token view reads the `t` layouts of the input. (`t = 1` is the causal pattern: no layout.)"""
        one_stream = is_one_stream_group_model(self.config)
        if one_stream_layout and not one_stream:
            raise ValueError("one_stream_layout=True is for dar's one-stream form (default_attention='block_causal', "
                             "prediction_stream='content'); this checkpoint takes plain token ids: drop it")
        return one_stream and not one_stream_layout and self.config.attention_group_size > 1

    def _next_token_layouts(self, common: dict, position_ids):
        """`(layouts, rows)` of plain token ids (`one_stream_next_token_layouts`), after refusing what the view
        cannot take: it lays out its own rows, positions and masks, and keeps no cache."""
        input_ids, attention_mask = common["input_ids"], common["attention_mask"]
        check_next_token_view_inputs(
            self.config, input_ids, attention_mask, inputs_embeds=common["inputs_embeds"], position_ids=position_ids,
            past_key_values=common["past_key_values"], prepared_attention=common["prepared"].attention,
            use_cache=common["use_cache"], output_hidden_states=common.get("output_hidden_states"),
            output_attentions=common.get("output_attentions"),
        )
        config = self.config
        return one_stream_next_token_layouts(input_ids, attention_mask, config.attention_group_size,
                                             config.bos_token_id, config.pad_token_id or 0)

    @property
    def content_pattern(self) -> str:
        """The content stream's pattern: block-causal for dar's one-stream form, else causal."""
        return "block_causal" if self.config.default_attention == "block_causal" else "causal"

    def prepare_attention(self, input_ids=None, attention_mask=None, inputs_embeds=None, position_ids=None,
                          row_kind=None, revealed_keys=None, **unused):
        """The masks of a single-stream batch (the content stream's pattern), built outside a compiled step: pass
        the result as `prepared_attention`."""
        if self.predicts_with_query_stream:
            raise ValueError("prepare_attention serves the single-stream form; a two-stream checkpoint's causal view "
                             "builds its query rows inside forward")
        return self.model.prepare_attention(input_ids=input_ids, attention_mask=attention_mask,
                                            inputs_embeds=inputs_embeds, position_ids=position_ids,
                                            attention_pattern=self.content_pattern, row_kind=row_kind,
                                            revealed_keys=revealed_keys)

    def _next_token_rows(self, rows, position_ids, past_key_values, shape):
        """Query rows of the AR plan: the row after current token `r` has position `pos[r] + 1`, rank `index + 1`."""
        batch, seq_len = shape
        past_len, _ = cache_lengths(past_key_values, seq_len)
        if position_ids is None:
            position_ids = (past_len + torch.arange(seq_len, device=rows.device)).expand(batch, seq_len)
        elif position_ids.shape != (batch, seq_len):
            position_ids = position_ids.expand(batch, seq_len)
        query_positions = position_ids[:, rows] + 1
        query_ranks = (past_len + rows + 1).expand(batch, -1)
        # past the last position the model has there is nothing to predict: the row becomes a padding slot
        beyond = query_positions >= self.config.max_position_embeddings
        return query_positions.masked_fill(beyond, 0), query_ranks.masked_fill(beyond, NO_TARGET_RANK), position_ids

    def create_masks_for_generate(self, config=None, inputs_embeds=None, attention_mask=None, past_key_values=None,
                                  **kwargs):
        """`generate()` asks for the mask up front with a compilable (static) cache. Ours stays the 2D mask of real
        tokens, widened to every cache slot (empty slots invalid), so that every decoding step has the same shapes."""
        if attention_mask is None or attention_mask.dim() != 2:
            return attention_mask
        _, key_len = cache_lengths(past_key_values, inputs_embeds.shape[1])
        return F.pad(attention_mask, (0, key_len - attention_mask.shape[1]))

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        limit = self.config.max_position_embeddings
        if input_ids_length > limit:
            raise ValueError(
                f"the prompt has {input_ids_length} tokens, more than max_position_embeddings={limit}; "
                "shorten it (nothing is truncated for you)"
            )
        if generation_config.max_length > limit:
            raise ValueError(
                f"generation would reach {generation_config.max_length} tokens (a {input_ids_length}-token prompt and "
                f"up to {generation_config.max_length - input_ids_length} new ones), but the model has "
                f"max_position_embeddings={limit}: ask for at most max_new_tokens={limit - input_ids_length}"
            )


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None, pooling: str) -> torch.Tensor:
    """Pool (B, T, D) token states into (B, D): `cls` (first token), `mean` (over real tokens) or `last`."""
    if pooling == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], device=hidden.device)
    mask = attention_mask.to(hidden.dtype)
    if pooling == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
    if pooling == "last":  # last real token, with right padding
        last = (mask.sum(1).long() - 1).clamp(min=0)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"pooling must be 'cls', 'mean' or 'last', got {pooling!r}")


class LookAroundForSequenceClassification(LookAroundPreTrainedModel):
    """Sequence (pair) classification or regression on pooled token states: the content stream's last layer, or with
    `config.classifier_features="prediction_state"` the state that predicts in the checkpoint's own training layout
    (`features_lookaround`; the probes read the same)."""

    def __init__(self, config: LookAroundConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LookAroundModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def unused_parameter_names(self) -> list[str]:
        if reads_query_stream(self.config, self.config.classifier_features):
            return []
        return ["model.query_embedding"]  # classification reads the content stream only

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        attention_pattern: str | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput:
        check_single_stream_head_inputs(self, kwargs, input_ids, inputs_embeds, labels=None)  # class labels: `_loss`
        features = self.config.classifier_features
        # BD3-LM's one-stream form reads x_t ⊕ x_0 only: its content_last_layer as pretrained is laid out too
        if features == "prediction_state" or (is_block_diffusion_model(self.config) and attention_pattern is None):
            if inputs_embeds is not None or position_ids is not None or kwargs.get("output_hidden_states") \
                    or kwargs.get("output_attentions"):
                raise ValueError(f"classifier_features={features!r} on this checkpoint lays out its own rows from "
                                 "input_ids and attention_mask: drop inputs_embeds, position_ids and output flags")
            hidden = token_states(self.model, input_ids, attention_mask, features, attention_pattern)
            outputs = LookAroundModelOutput(last_hidden_state=hidden)
        else:
            outputs = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                inputs_embeds=inputs_embeds, attention_pattern=attention_pattern, **kwargs,
            )
            hidden = outputs.last_hidden_state
        pooled = pool(hidden, attention_mask, self.config.classifier_pooling)
        logits = self.score(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels.to(logits.device))
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        config = self.config
        if config.problem_type is None:
            if self.num_labels == 1:
                config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                config.problem_type = "single_label_classification"
            else:
                config.problem_type = "multi_label_classification"
        if config.problem_type == "single_label_classification":
            if not torch.compiler.is_compiling() and labels.numel() and (
                labels.min() < 0 or labels.max() >= self.num_labels
            ):
                raise ValueError(f"class labels must lie in [0, {self.num_labels}), got {labels.unique().tolist()}")
        else:  # regression, multi-label: float targets
            labels = labels.float()
        return self.loss_function(labels, logits.float(), config)


__all__ = [
    "LookAroundPreTrainedModel",
    "LookAroundModel",
    "LookAroundForPreTraining",
    "LookAroundForMaskedLM",
    "LookAroundForCausalLM",
    "LookAroundForSequenceClassification",
    "LookAroundModelOutput",
    "LookAroundForPreTrainingOutput",
    "AttentionPlan",
    "PreparedAttention",
    "PreparedInputs",
    "may_attend",
    "resolve_attention_implementation",
    "AUTO_ATTENTION",
    "FLEX_ATTENTION_MIN_KEYS",
    "pool",
]
