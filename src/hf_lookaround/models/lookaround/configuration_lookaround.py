"""Configuration of the LookAround text model family (two-stream (semi-)autoregressive and masked)."""

import copy

from transformers import PreTrainedConfig

from .masking_lookaround import one_stream_start_rows

NORM_TYPES = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
GLU_ACTIVATIONS = {"swiglu": "silu", "geglu": "gelu"}
PLAIN_ACTIVATIONS = ("gelu", "gelu_new", "relu", "silu")
POSITION_EMBEDDING_TYPES = ("rope", "absolute")
ATTENTION_PATTERNS = ("causal", "bidirectional", "block_causal", "block_diffusion")
POOLINGS = ("cls", "mean", "last")
# RoPE variants whose frequencies do not depend on the sequence length (transformers' ROPE_INIT_FUNCTIONS computes them)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
FEATURES = ("prediction_state", "content_last_layer")  # the named token states (features_lookaround)
PREDICTION_STREAMS = ("query", "content")
# Configs written before `prediction_stream` existed name only their objective, one of these five. This file is
# remote code and cannot read the package's objectives table (objectives.py); newer configs record the stream.
LEGACY_QUERY_STREAM_OBJECTIVES = ("ar", "dar", "gvp")  # their plan always trains the query stream
LEGACY_MASKED_OBJECTIVES = ("mlm", "vmlm")  # query stream unless pretrained single-stream ([MASK] inputs)


def infer_prediction_stream(objective: str | None, architectures: list[str] | None) -> str | None:
    """The stream a checkpoint was trained to predict with, for configs written before `prediction_stream` existed.

    (Semi-)AR and GVP plans train the query stream. Masked objectives do too, unless pretrained in the single-stream
    `[MASK]` form, whose checkpoints were saved from `LookAroundForMaskedLM`. Without an objective, a checkpoint
    saved from `LookAroundForPreTraining` is two-stream; otherwise nothing says (None: the head decides).
    """
    architectures = list(architectures or [])
    if objective in LEGACY_QUERY_STREAM_OBJECTIVES:
        return "query"
    if objective in LEGACY_MASKED_OBJECTIVES:
        return "content" if "LookAroundForMaskedLM" in architectures else "query"
    if "LookAroundForPreTraining" in architectures:
        return "query"
    return None

def with_prediction_stream(config, stream: str):
    """``config`` if it records a prediction stream; else a copy that records ``stream`` (a head's own pathway).
    A head never writes to the config it was given: other heads may share it."""
    if config.prediction_stream is not None:
        return config
    config = copy.deepcopy(config)
    config.prediction_stream = stream
    return config


# name -> (hidden, layers, heads, intermediate). Sizes a researcher can name in one word.
PRESETS = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "mini": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=512),
    "small": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=1024),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


class LookAroundConfig(PreTrainedConfig):
    r"""
    Configuration of a [`LookAroundModel`]: one backbone for every objective (AR, semi-AR, masked, GVP).

    Args:
        vocab_size, hidden_size, num_hidden_layers, num_attention_heads, intermediate_size:
            the usual transformer sizes; `hidden_size` must be divisible by `num_attention_heads`.
        max_position_embeddings (`int`): the longest sequence the model accepts (longer input is an error).
        hidden_dropout_prob, attention_dropout (`float`): dropout on residual branches / attention weights.
        initializer_range (`float`): std of the normal initialiser.
        norm_type (`"rmsnorm"` or `"layernorm"`), norm_position (`"pre"` or `"post"`), norm_eps.
        hidden_act (`"swiglu"`, `"geglu"`, `"gelu"`, `"gelu_new"`, `"relu"` or `"silu"`).
        position_embedding_type (`"rope"` or `"absolute"`): both index the *original* token order, so they stay
            correct whatever order a plan predicts in.
        rope_theta (`float`): RoPE base.
        rope_parameters (`dict`, optional): transformers' RoPE parameters (`rope_type` one of "default", "linear",
            "llama3", "yarn", with their `factor` etc.), standardised by transformers' rope config handling; its
            `rope_theta` wins over the field of that name. Default: plain RoPE with `rope_theta`.
        num_key_value_heads (`int`, optional): grouped-query attention's key/value heads (default: one per
            attention head); must divide `num_attention_heads`.
        head_dim (`int`, optional): the width of a head (default `hidden_size // num_attention_heads`).
        attention_bias, mlp_bias (`bool`): biases in the projections (attention: q, k, v and the output).
        attention_output_bias (`bool`, optional): the attention output projection's bias apart from q/k/v's (Qwen2:
            biases on q, k, v only); default `attention_bias`.
        qk_norm (`bool`): an RMSNorm over each head of the queries and keys before RoPE (Qwen3).
        default_attention (`"causal"`, `"bidirectional"` or `"block_causal"`): the single-stream pattern used when no
            plan is given (features for probing, classification). Pretraining scripts set it to match the objective.
            `"block_causal"`: a token sees the tokens of its own group and of every earlier group, groups being
            `attention_group_size` consecutive tokens (dar's one-stream form, after SAT: the row of a token
            predicts the token `attention_group_size` places ahead, in the next group).
            `"block_diffusion"`: BD3-LM's one-stream form, inputs laid out as `x_t ⊕ x_0` (the noised sequence, then
            the clean one) in blocks of `attention_group_size` after BOS: a noised block sees itself and the clean
            blocks before it, the clean half is block-causal (`masking_lookaround.block_diffusion_plan`).
        attention_group_size (`int`): the group size of the `"block_causal"` pattern (1 is causal), the block size
            of `"block_diffusion"`.
        classifier_pooling (`"cls"`, `"mean"` or `"last"`): how the sequence classifier pools tokens.
        classifier_dropout (`float`, optional): dropout before the classifier (defaults to `hidden_dropout_prob`).
        classifier_features (`"content_last_layer"` or `"prediction_state"`): the token states the sequence
            classifier pools (`features_lookaround`): the content stream's last layer, or the state that predicts in
            the checkpoint's own training layout.
        objective (`str`, optional), plan_params (`dict`, optional): what the checkpoint was pretrained with;
            informational, written into model cards.
        decoding_group_sizes (`list[int]`, optional): the group sizes `t` the checkpoint's plan trained, those
            `generate(group_size=t)` decodes with (`[]`: none; a masked or any-order checkpoint infills instead).
            Recorded from the objective's parameters at pretraining; unset in configs written before it existed,
            whose decoders read it from `objective` and `plan_params`.
        diffusion_block_size (`int`, optional): the block a masked-diffusion checkpoint denoises, recorded from its
            objective's parameters (`bd3lm`: its block size b; `mdlm`: 0, one block of every new token); None for a
            checkpoint that diffusion decoding does not serve.
        prediction_stream (`"query"` or `"content"`, optional): the stream the checkpoint was trained to predict
            with, and so the one `LookAroundForCausalLM` (`generate()`) and `LookAroundForMaskedLM` (`fill-mask`)
            predict with. `"query"`: two-stream pretraining (every plan of `hf-lookaround pretrain` except the
            single-stream `[MASK]` form); `"content"`: the classic single-stream GPT/BERT forms. Left unset, it
            is inferred from `objective` (configs written before this field existed); if that says nothing,
            the first head built on the config records its own pathway (`LookAroundForPreTraining`: query;
            the causal and masked LM heads: content).
        trained_block_size (`int`, optional): the tokens per sequence the checkpoint was pretrained on (`pretrain
            --block_size`), which `max_position_embeddings` (the positional capacity) does not tell; the default
            window of `hf-lookaround perplexity`. The saved tokenizer's `model_max_length` says the same.
        source_model_type (`str`, optional): the causal LM family a converted checkpoint came from (`hf-lookaround
            convert`: "llama", "mistral", "qwen2", "qwen3", "gpt2"); `hf-lookaround export` writes that format back.
        pad_token_id, bos_token_id, eos_token_id, mask_token_id: special token ids.
        tie_word_embeddings (`bool`): tie the LM head to the input embeddings.
    """

    model_type = "lookaround"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 1024
    hidden_dropout_prob: float = 0.0
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    norm_type: str = "rmsnorm"
    norm_position: str = "pre"
    norm_eps: float = 1e-6
    hidden_act: str = "swiglu"
    position_embedding_type: str = "rope"
    rope_theta: float = 10000.0
    rope_parameters: dict | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = False
    attention_output_bias: bool | None = None
    qk_norm: bool = False
    mlp_bias: bool = False
    default_attention: str = "bidirectional"
    attention_group_size: int = 1
    classifier_pooling: str = "mean"
    classifier_dropout: float | None = None
    classifier_features: str = "content_last_layer"
    objective: str | None = None
    plan_params: dict | None = None
    decoding_group_sizes: list[int] | None = None
    diffusion_block_size: int | None = None
    prediction_stream: str | None = None
    trained_block_size: int | None = None
    source_model_type: str | None = None
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    mask_token_id: int | None = 3
    tie_word_embeddings: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        self.plan_params = dict(self.plan_params or {})
        if self.head_dim is None:  # derived from the width: the heads must divide it
            self.check_positive_ints("hidden_size", "num_attention_heads")
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}); pick a head count that divides it, or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.attention_output_bias is None:
            self.attention_output_bias = self.attention_bias
        super().__post_init__(**kwargs)  # standardises rope_parameters (rope_theta joins it)
        self.rope_theta = self.rope_parameters["rope_theta"]  # one value: rope_parameters' wins
        if self.prediction_stream is None:
            self.prediction_stream = infer_prediction_stream(self.objective, self.architectures)
        self.validate_lookaround()

    def __setattr__(self, name, value):
        # `rope_theta` and rope_parameters' "rope_theta" are one value: setting either (e.g. --config_overrides
        # rope_theta=...) sets both, so that the model and a reloaded config.json see the same base
        super().__setattr__(name, value)
        parameters = self.__dict__.get("rope_parameters")
        if name == "rope_theta" and isinstance(parameters, dict) and parameters.get("rope_theta") != value:
            parameters["rope_theta"] = value
        elif name == "rope_parameters" and isinstance(value, dict) and value.get("rope_theta") is not None \
                and self.__dict__.get("rope_theta") != value["rope_theta"]:
            super().__setattr__("rope_theta", value["rope_theta"])

    @property
    def n_positions(self) -> int:
        """The longest input whose every next token the causal LM predicts (GPT-2's name, which
        lm-evaluation-harness reads before `max_position_embeddings`). The query stream predicts token `i + 1` at
        position `i + 1`, so the causal view of a two-stream checkpoint takes one token less than the positions.
        dar's one-stream form (block-causal, `t > 1`) lays its input out after start rows (up to `2t - 2` BOS
        copies) and a BOS when the input has none in front: `2t - 1` positions less."""
        if self.prediction_stream == "query":
            return self.max_position_embeddings - 1
        if self.default_attention == "block_causal" and self.attention_group_size > 1:
            return self.max_position_embeddings - one_stream_start_rows(self.attention_group_size, 1) - 1
        return self.max_position_embeddings

    def check_positive_ints(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def validate_lookaround(self) -> None:
        """Raise a ValueError that says what to fix for any inconsistent value."""
        self.check_positive_ints("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "intermediate_size", "max_position_embeddings", "attention_group_size",
                                 "num_key_value_heads", "head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                             f"({self.num_attention_heads}): each key/value head serves a whole group of query heads")
        if self.position_embedding_type == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.head_dim}")
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_parameters' rope_type must be one of {ROPE_TYPES} (frequencies that do not "
                             f"depend on the sequence length), got {rope_type!r}")
        choices = {
            "norm_type": NORM_TYPES,
            "norm_position": NORM_POSITIONS,
            "hidden_act": tuple(GLU_ACTIVATIONS) + PLAIN_ACTIVATIONS,
            "position_embedding_type": POSITION_EMBEDDING_TYPES,
            "default_attention": ATTENTION_PATTERNS,
            "classifier_pooling": POOLINGS,
            "classifier_features": FEATURES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        sizes = self.decoding_group_sizes
        if sizes is not None and (not isinstance(sizes, (list, tuple))
                                  or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in sizes)):
            raise ValueError(f"decoding_group_sizes must be a list of positive ints (or None), got {sizes!r}")
        block = self.diffusion_block_size
        if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 0):
            raise ValueError(f"diffusion_block_size must be an int >= 0 (0: one block) or None, got {block!r}")
        if self.prediction_stream not in PREDICTION_STREAMS + (None,):
            raise ValueError(f"prediction_stream must be one of {PREDICTION_STREAMS}, got {self.prediction_stream!r}")
        for name in ("hidden_dropout_prob", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must lie in [0, 1), got {getattr(self, name)}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id"):
            value = getattr(self, name, None)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {self.vocab_size})")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "LookAroundConfig":
        """A config of a named size (`tiny`, `mini`, `small`, `base`, `large`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


__all__ = ["LookAroundConfig", "PRESETS", "ROPE_TYPES", "PREDICTION_STREAMS", "infer_prediction_stream"]
