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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    CausalLMOutputWithPast,
    MaskedLMOutput,
    ModelOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple

from .configuration_lookaround import GLU_ACTIVATIONS, LookAroundConfig

# A rank no real token has: padded target slots get it, so they see nothing.
NO_TARGET_RANK = -1


# ----------------------------------------------------------------------------------------------
# The mask rule. This is the only place that says who may see whom.
# ----------------------------------------------------------------------------------------------
def may_attend(query_rank, key_rank, query_is_strict, key_valid):
    """True where a row of rank ``query_rank`` may attend to a content key of rank ``key_rank``.

    Content rows (``query_is_strict`` False) see ranks ``<=`` their own; query-stream rows
    (``query_is_strict`` True) see ranks ``<`` their target's. Invalid (padding) keys are never seen.
    Element-wise, so it serves broadcast tensors and FlexAttention's ``mask_mod`` alike.
    """
    return key_valid & ((key_rank < query_rank) | ((key_rank == query_rank) & ~query_is_strict))


@dataclass
class AttentionPlan:
    """Who attends to whom in one forward: ranks of the rows (content then query stream) and of the keys."""

    query_rank: torch.Tensor  # (B, L) long, L = T content rows (+ M query rows)
    query_is_strict: torch.Tensor  # (B, L) bool: True on query-stream rows
    key_rank: torch.Tensor  # (B, K) long
    key_valid: torch.Tensor  # (B, K) bool

    def dense(self) -> torch.Tensor:
        """Boolean mask (B, 1, L, K), built on the device from the ranks."""
        return may_attend(
            self.query_rank[:, :, None],
            self.key_rank[:, None, :],
            self.query_is_strict[:, :, None],
            self.key_valid[:, None, :],
        )[:, None]

    def row_sees_something(self) -> torch.Tensor:
        """(B, L) bool: a row sees at least one key iff it may attend to the lowest valid key rank."""
        big = torch.iinfo(self.key_rank.dtype).max
        lowest = torch.where(self.key_valid, self.key_rank, big).amin(-1, keepdim=True)
        return may_attend(self.query_rank, lowest, self.query_is_strict, self.key_valid.any(-1, keepdim=True))

    def block_mask(self):
        """A FlexAttention ``BlockMask`` from the same rule."""
        from torch.nn.attention.flex_attention import create_block_mask

        # int32 everywhere: inductor's CPU code generation fails on bool/int64 loads inside mask_mod
        q_rank, k_rank = self.query_rank.int(), self.key_rank.int()
        strict, k_valid = self.query_is_strict.int(), self.key_valid.int()

        def mask_mod(b, h, q_idx, kv_idx):
            return may_attend(q_rank[b, q_idx], k_rank[b, kv_idx], strict[b, q_idx] != 0, k_valid[b, kv_idx] != 0)

        batch, rows = q_rank.shape
        return create_block_mask(mask_mod, batch, None, rows, k_rank.shape[1], device=q_rank.device)


def prepare_attention_mask(plan: AttentionPlan, implementation: str, dtype: torch.dtype):
    """The mask in the form the backend takes, and the (B, L, 1, 1) factor that zeroes rows that see nothing.

    Rows that see nothing (a query row with no lower rank, a padded target slot) would give NaN in a
    softmax. They are let see every key inside the kernel, then multiplied by zero: no NaN, and
    exactly zero gradient to every key.
    """
    sees = plan.row_sees_something()
    row_factor = sees[:, :, None, None].to(dtype)
    if implementation == "flex_attention":
        return plan.block_mask(), row_factor
    mask = plan.dense() | ~sees[:, None, :, None]
    if implementation == "sdpa":
        return mask, row_factor
    # eager (and any other kernel taking an additive mask)
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill(~mask, torch.finfo(dtype).min), row_factor


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
    """RoPE over the original token positions, so it is correct in whatever order a plan predicts."""

    inv_freq: torch.Tensor

    def __init__(self, config: LookAroundConfig):
        super().__init__()
        self.rope_theta = config.rope_theta
        self.dim = config.head_dim
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.rope_theta ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


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
        self.num_key_value_groups = 1
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # the mask always comes from the plan
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        num_content: int,
        attention_mask,
        row_factor: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, rows, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, rows, -1, self.head_dim).transpose(1, 2)
        content = hidden_states[:, :num_content]  # keys and values come from the content stream only
        key = self.k_proj(content).view(batch, num_content, -1, self.head_dim).transpose(1, 2)
        value = self.v_proj(content).view(batch, num_content, -1, self.head_dim).transpose(1, 2)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query = apply_rotary(query, cos, sin)
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
            is_causal=kwargs.get("is_causal", False),
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


class LookAroundLayer(GradientCheckpointingLayer):
    """One block, applied to ``[content; query]`` rows with shared weights."""

    def __init__(self, config: LookAroundConfig, layer_idx: int):
        super().__init__()
        self.pre_norm = config.norm_position == "pre"
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
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.pre_norm:
            attn, weights = self.self_attn(
                self.attention_norm(hidden_states), num_content, attention_mask, row_factor,
                position_embeddings, past_key_values, **kwargs,
            )
            hidden_states = hidden_states + self.dropout(attn)
            hidden_states = hidden_states + self.dropout(self.mlp(self.mlp_norm(hidden_states)))
        else:
            attn, weights = self.self_attn(
                hidden_states, num_content, attention_mask, row_factor, position_embeddings, past_key_values,
                **kwargs,
            )
            hidden_states = self.attention_norm(hidden_states + self.dropout(attn))
            hidden_states = self.mlp_norm(hidden_states + self.dropout(self.mlp(hidden_states)))
        return hidden_states, weights


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------
@dataclass
class LookAroundModelOutput(ModelOutput):
    """
    last_hidden_state (`(B, T, D)`): the content stream.
    query_hidden_state (`(B, M, D)`, two-stream only): the query stream at `target_positions`.
    target_positions (`(B, M)`, two-stream only): positions of the query rows, -1 for padding slots.
    past_key_values: the KV cache (single-stream causal with `use_cache`).
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
    target_positions (`(B, M)`): the positions predicted, -1 for padding slots.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    target_positions: torch.LongTensor | None = None
    last_hidden_state: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


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

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, LookAroundModel):
            init.normal_(module.query_embedding, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LookAroundRotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq())


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
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @can_return_tuple
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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> LookAroundModelOutput:
        r"""
        group_ids (`(B, T)` long, optional): the plan's group rank of every token. Given, the model runs the
            content and query streams; absent, it runs one stream with `attention_pattern`.
        target_positions (`(B, M)` long, optional): where to run the query stream (-1 pads a row). Default: all.
        attention_pattern (`"causal"` or `"bidirectional"`, optional): the single-stream pattern;
            defaults to `config.default_attention`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            self._check_token_ids(input_ids, "input_ids")
            inputs_embeds = self.embed_tokens(input_ids)
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(
                f"inputs_embeds must have shape (batch, seq_len, {self.config.hidden_size}), "
                f"got {tuple(inputs_embeds.shape)}"
            )
        batch, seq_len, _ = inputs_embeds.shape
        device = inputs_embeds.device
        two_stream = group_ids is not None
        if two_stream and (past_key_values is not None or use_cache):
            raise ValueError("the KV cache serves single-stream causal decoding; do not pass it with group_ids")
        if not two_stream and target_positions is not None:
            raise ValueError("target_positions select query-stream rows and need group_ids (a plan)")
        use_cache = bool(use_cache) and not two_stream and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        total_len = past_len + seq_len
        if total_len > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {total_len} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}; split or shorten the input (nothing is truncated for you)"
            )

        key_valid = self._key_valid(attention_mask, batch, total_len, device)
        if position_ids is None:
            position_ids = torch.arange(past_len, total_len, device=device).expand(batch, seq_len)
        elif position_ids.shape != (batch, seq_len):
            position_ids = position_ids.expand(batch, seq_len) if position_ids.shape[-1] == seq_len else None
            if position_ids is None:
                raise ValueError(f"position_ids must have shape ({batch}, {seq_len})")

        pattern = attention_pattern or self.config.default_attention
        if two_stream:
            plan, row_positions, hidden, target_positions = self._two_stream_inputs(
                inputs_embeds, group_ids, target_positions, key_valid, position_ids
            )
        else:
            if pattern not in ("causal", "bidirectional"):
                raise ValueError(f"attention_pattern must be 'causal' or 'bidirectional', got {pattern!r}")
            ranks = torch.arange(total_len, device=device).expand(batch, total_len)
            if pattern == "bidirectional":
                ranks = torch.zeros_like(ranks)
            plan = AttentionPlan(
                query_rank=ranks[:, past_len:],
                query_is_strict=torch.zeros(batch, seq_len, dtype=torch.bool, device=device),
                key_rank=ranks,
                key_valid=key_valid,
            )
            row_positions, hidden = position_ids, inputs_embeds

        implementation = self.config._attn_implementation
        causal_fast_path = (
            not two_stream and pattern == "causal" and attention_mask is None and past_len == 0
            and implementation == "sdpa" and not output_attentions
        )
        if causal_fast_path:  # lets SDPA pick its flash kernel
            mask, row_factor, extra = None, None, {"is_causal": True}
        else:
            mask, row_factor = prepare_attention_mask(plan, implementation, hidden.dtype)
            extra = {}

        position_embeddings = None
        if self.config.position_embedding_type == "rope":
            position_embeddings = self.rotary_emb(hidden, row_positions)
        else:  # each row, content or query, gets the embedding of its (target's) original position
            hidden = hidden + self.embed_positions(row_positions)
        if self.config.norm_position == "post":
            hidden = self.norm(hidden)
        hidden = self.dropout(hidden)

        all_hidden, all_attn = [], []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden[:, :seq_len])
            hidden, weights = layer(
                hidden, seq_len, mask, row_factor, position_embeddings, past_key_values, **extra
            )
            if output_attentions:
                all_attn.append(weights)
        if self.config.norm_position == "pre":
            hidden = self.norm(hidden)
        if output_hidden_states:
            all_hidden.append(hidden[:, :seq_len])

        return LookAroundModelOutput(
            last_hidden_state=hidden[:, :seq_len],
            query_hidden_state=hidden[:, seq_len:] if two_stream else None,
            target_positions=target_positions,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
        )

    def _two_stream_inputs(self, inputs_embeds, group_ids, target_positions, key_valid, position_ids):
        """Rows ``[content; query]``, their positions and the attention plan of both streams."""
        batch, seq_len, _ = inputs_embeds.shape
        device = inputs_embeds.device
        if group_ids.shape != (batch, seq_len):
            raise ValueError(
                f"group_ids must have the shape of the input, ({batch}, {seq_len}); got {tuple(group_ids.shape)}"
            )
        group_ids = group_ids.to(device=device, dtype=torch.long)
        if target_positions is None:
            target_positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        if target_positions.dim() != 2 or target_positions.shape[0] != batch:
            raise ValueError(f"target_positions must have shape ({batch}, M), got {tuple(target_positions.shape)}")
        self._check_target_positions(target_positions, seq_len)
        is_slot = target_positions >= 0
        gather_at = target_positions.clamp(min=0)
        target_rank = torch.where(is_slot, group_ids.gather(1, gather_at), NO_TARGET_RANK)
        target_pos_ids = position_ids.gather(1, gather_at)

        query = self.query_embedding.to(inputs_embeds.dtype).expand(batch, target_positions.shape[1], -1)
        plan = AttentionPlan(
            query_rank=torch.cat([group_ids, target_rank], dim=1),
            query_is_strict=torch.cat(
                [torch.zeros_like(group_ids, dtype=torch.bool), torch.ones_like(target_rank, dtype=torch.bool)], 1
            ),
            key_rank=group_ids,
            key_valid=key_valid,
        )
        rows = torch.cat([inputs_embeds, query], dim=1)
        return plan, torch.cat([position_ids, target_pos_ids], dim=1), rows, target_positions

    @staticmethod
    def _key_valid(attention_mask, batch, total_len, device) -> torch.Tensor:
        if attention_mask is None:
            return torch.ones(batch, total_len, dtype=torch.bool, device=device)
        if attention_mask.shape != (batch, total_len):
            raise ValueError(
                f"attention_mask must have shape ({batch}, {total_len}) (past + current tokens), "
                f"got {tuple(attention_mask.shape)}"
            )
        return attention_mask.to(device) != 0

    def _check_token_ids(self, ids: torch.Tensor, name: str) -> None:
        if ids.dim() != 2:
            raise ValueError(f"{name} must have shape (batch, seq_len), got {tuple(ids.shape)}")
        if torch.compiler.is_compiling() or ids.numel() == 0:
            return  # value checks need a host sync: skipped inside a compiled graph
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(
                f"{name} holds ids outside the vocabulary [0, {self.config.vocab_size}): "
                f"min {int(ids.min())}, max {int(ids.max())}; check the tokenizer matches the model"
            )

    @staticmethod
    def _check_target_positions(target_positions: torch.Tensor, seq_len: int) -> None:
        if torch.compiler.is_compiling() or target_positions.numel() == 0:
            return
        if target_positions.min() < -1 or target_positions.max() >= seq_len:
            raise ValueError(f"target_positions must lie in [0, {seq_len}) or be -1 for padding")


def token_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Cross-entropy over the labelled tokens (-100 ignored), in float32.

    With `num_items_in_batch` (what `Trainer` passes under gradient accumulation or token averaging
    across devices) the sum is divided by that count, so every target weighs the same in a step.
    """
    if num_items_in_batch is None:
        return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100)
    total = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def positions_of(is_target: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B, M) indices of the True entries of each row, in order, padded with -1."""
    width = int(is_target.sum(-1).max()) if is_target.numel() else 0
    order = torch.argsort((~is_target).to(torch.int8), dim=-1, stable=True)[:, :width]
    return torch.where(is_target.gather(1, order), order, -1)


def check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Labels are token ids in [0, vocab) or -100 (no loss)."""
    if torch.compiler.is_compiling() or labels.numel() == 0:
        return
    bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        raise ValueError(
            f"labels must be token ids in [0, {vocab_size}) or -100 (no loss); found "
            f"{sorted(set(labels[bad].tolist()))[:5]}"
        )


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
        super().__init__(config)
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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> LookAroundForPreTrainingOutput:
        r"""
        group_ids (`(B, T)`): the plan (required). labels (`(B, T)`): the token to predict at each position,
        -100 where there is no loss. target_positions (`(B, M)`): where to predict; default: where labels are
        set, or every position without labels.
        """
        if group_ids is None:
            raise ValueError("LookAroundForPreTraining needs group_ids (a plan); collators in hf_lookaround emit them")
        if labels is not None:
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            if labels.shape != shape:
                raise ValueError(f"labels must have shape {tuple(shape)}, got {tuple(labels.shape)}")
            check_labels(labels, self.config.vocab_size)
            if target_positions is None:
                target_positions = positions_of(labels != -100)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, group_ids=group_ids,
            target_positions=target_positions, position_ids=position_ids, inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        logits = self.lm_head(outputs.query_hidden_state)
        loss = None
        if labels is not None:
            slots = outputs.target_positions
            target_labels = torch.where(slots >= 0, labels.gather(1, slots.clamp(min=0)), -100)
            loss = token_loss(logits, target_labels, kwargs.get("num_items_in_batch"))
        return LookAroundForPreTrainingOutput(
            loss=loss,
            logits=logits,
            target_positions=outputs.target_positions,
            last_hidden_state=outputs.last_hidden_state,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class LookAroundForMaskedLM(LookAroundLMHeadMixin, LookAroundPreTrainedModel):
    """Single-stream bidirectional masked LM over `[MASK]` inputs (BERT-style, works with `fill-mask`)."""

    def __init__(self, config: LookAroundConfig):
        super().__init__(config)
        self.model = LookAroundModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, attention_pattern="bidirectional",
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise ValueError(f"labels must have shape {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
            check_labels(labels, self.config.vocab_size)
            loss = token_loss(logits, labels, kwargs.get("num_items_in_batch"))
        return MaskedLMOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class LookAroundForCausalLM(LookAroundLMHeadMixin, LookAroundPreTrainedModel, GenerationMixin):
    """Single-stream causal LM (GPT-style) with a KV cache for `generate()`."""

    def __init__(self, config: LookAroundConfig):
        super().__init__(config)
        self.model = LookAroundModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

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
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""labels (`(B, T)`): the input ids themselves; they are shifted inside, -100 is ignored."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, attention_pattern="causal", past_key_values=past_key_values,
            use_cache=use_cache, output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        hidden = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep])
        loss = None
        if labels is not None:
            if labels.shape != hidden.shape[:2]:
                raise ValueError(f"labels must have shape {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
            check_labels(labels, self.config.vocab_size)
            full_logits = logits if logits.shape[1] == labels.shape[1] else self.lm_head(hidden)
            loss = token_loss(full_logits[:, :-1], labels[:, 1:], kwargs.get("num_items_in_batch"))
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states, attentions=outputs.attentions,
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
    """Sequence (pair) classification or regression on pooled single-stream features."""

    def __init__(self, config: LookAroundConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = LookAroundModel(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        attention_pattern: str | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput:
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, attention_pattern=attention_pattern,
            output_hidden_states=output_hidden_states, output_attentions=output_attentions,
        )
        pooled = pool(outputs.last_hidden_state, attention_mask, self.config.classifier_pooling)
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
        if config.problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1)) if self.num_labels == 1 else \
                F.mse_loss(logits.float(), labels.float())
        if config.problem_type == "single_label_classification":
            if not torch.compiler.is_compiling() and labels.numel() and (
                labels.min() < 0 or labels.max() >= self.num_labels
            ):
                raise ValueError(f"class labels must lie in [0, {self.num_labels}), got {labels.unique().tolist()}")
            return F.cross_entropy(logits.float().view(-1, self.num_labels), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


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
    "may_attend",
    "pool",
]
