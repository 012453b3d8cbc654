"""Start from a pretrained causal LM: convert Llama, Mistral, Qwen2, Qwen3 and GPT-2 checkpoints into LookAround
checkpoints (`hf-lookaround convert`), and export a LookAround checkpoint whose causal view is exactly one of those
families' forward back to that family's format (`hf-lookaround export`). docs/adaptation.md says what converts
exactly and how the new parts start.

A family is two things here: how its config reads as a LookAround config (:func:`lookaround_config`), and how its
weight names map one to one onto the content stream (:class:`Family`: a rename table, plus GPT-2's fused and
transposed ``Conv1D`` projections). The same table, read backwards, exports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
MASK_TOKEN = "<|mask|>"  # added where the tokenizer has no mask token


class ConversionError(ValueError):
    """A source or checkpoint that cannot be converted or exported exactly; the message says why in one line."""


# ----------------------------------------------------------------------------------------------------------------
# families: config fields and weight names
# ----------------------------------------------------------------------------------------------------------------
# source name prefix -> LookAround name prefix ({i}: a layer index); read backwards, they export
# Llama-style decoders (llama, mistral, qwen2, qwen3) differ from the content stream's names in the norms only
LLAMA_RENAMES = (
    ("model.layers.{i}.input_layernorm.", "model.layers.{i}.attention_norm."),
    ("model.layers.{i}.post_attention_layernorm.", "model.layers.{i}.mlp_norm."),
)
GPT2_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.wpe.", "model.embed_positions."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.{i}.ln_1.", "model.layers.{i}.attention_norm."),
    ("transformer.h.{i}.ln_2.", "model.layers.{i}.mlp_norm."),
    ("transformer.h.{i}.attn.c_proj.", "model.layers.{i}.self_attn.o_proj."),
    ("transformer.h.{i}.mlp.c_fc.", "model.layers.{i}.mlp.up_proj."),
    ("transformer.h.{i}.mlp.c_proj.", "model.layers.{i}.mlp.down_proj."),
)
GPT2_FUSED_QKV = re.compile(r"^transformer\.h\.(\d+)\.attn\.c_attn\.(weight|bias)$")
LOOKAROUND_QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")


def _rename(name: str, renames, backwards: bool = False) -> str:
    for old, new in renames:
        old, new = (new, old) if backwards else (old, new)
        match = re.match(re.escape(old).replace(re.escape("{i}"), r"(\d+)"), name)
        if match:
            return new.replace("{i}", match.group(1) if match.groups() else "") + name[match.end():]
    return name


def _is_conv1d(lookaround_name: str) -> bool:
    """GPT-2's Conv1D projections (stored (in, out)) other than the fused q/k/v, by their LookAround name."""
    return lookaround_name.endswith(".weight") and (".self_attn.o_proj." in lookaround_name
                                                    or ".mlp." in lookaround_name)


def to_lookaround_weights(model_type: str, state: dict) -> dict:
    """The source's weights under the content stream's names (GPT-2's ``Conv1D`` weights, stored (in, out),
    transposed to ``nn.Linear``'s (out, in); its fused q/k/v split)."""
    if model_type != "gpt2":
        return {_rename(name, LLAMA_RENAMES): tensor for name, tensor in state.items()}
    out = {}
    for name, tensor in state.items():
        if not name.startswith(("transformer.", "lm_head.")):  # GPT-2's own hub files name the body without it
            name = "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")):  # old checkpoints' causal-mask buffers
            continue
        fused = GPT2_FUSED_QKV.match(name)
        if fused:
            layer, kind = fused.groups()
            for proj, part in zip("qkv", tensor.chunk(3, dim=-1)):
                out[f"model.layers.{layer}.self_attn.{proj}_proj.{kind}"] = \
                    part.t().contiguous() if kind == "weight" else part.contiguous()
            continue
        new = _rename(name, GPT2_RENAMES)
        out[new] = tensor.t().contiguous() if _is_conv1d(new) else tensor
    return out


def from_lookaround_weights(model_type: str, state: dict) -> dict:
    """:func:`to_lookaround_weights` backwards: the content stream's weights under the family's names."""
    import torch

    if model_type != "gpt2":
        return {_rename(name, LLAMA_RENAMES, backwards=True): tensor for name, tensor in state.items()}
    out, qkv = {}, {}
    for name, tensor in state.items():
        match = LOOKAROUND_QKV.match(name)
        if match:
            layer, proj, kind = match.groups()
            qkv.setdefault((layer, kind), {})[proj] = tensor.t() if kind == "weight" else tensor
            continue
        out[_rename(name, GPT2_RENAMES, backwards=True)] = tensor.t().contiguous() if _is_conv1d(name) else tensor
    for (layer, kind), parts in qkv.items():
        out[f"transformer.h.{layer}.attn.c_attn.{kind}"] = torch.cat([parts[p] for p in "qkv"], dim=-1).contiguous()
    return out


def _sliding_window(source) -> int | None:
    """The window a source's attention uses at some layer (None: full causal attention everywhere)."""
    window = getattr(source, "sliding_window", None)
    if source.model_type == "mistral":
        return window
    layer_types = getattr(source, "layer_types", None) or []
    return window if "sliding_attention" in layer_types else None


def lookaround_config(source, max_length: int | None = None):
    """The LookAround config whose causal view computes ``source``'s forward (a transformers config of a supported
    type), with the positions cut to ``max_length`` if given. Anything the LookAround forward would compute
    differently is refused in one line."""
    from .models.lookaround.configuration_lookaround import GLU_ACTIVATIONS, PLAIN_ACTIVATIONS, ROPE_TYPES, \
        LookAroundConfig

    model_type = source.model_type
    if model_type not in SUPPORTED_TYPES:
        raise ConversionError(f"model_type {model_type!r} is not supported: convert one of {', '.join(SUPPORTED_TYPES)}")
    common = dict(prediction_stream="content", default_attention="causal", source_model_type=model_type,
                  pad_token_id=None, bos_token_id=None, eos_token_id=None, mask_token_id=None,
                  tie_word_embeddings=bool(getattr(source, "tie_word_embeddings", model_type == "gpt2")),
                  initializer_range=source.initializer_range, use_cache=True)
    if model_type == "gpt2":
        if getattr(source, "add_cross_attention", False):
            raise ConversionError("this GPT-2 has cross-attention (add_cross_attention): only decoder-only models convert")
        if not source.scale_attn_weights or source.scale_attn_by_inverse_layer_idx:
            raise ConversionError("this GPT-2 scales attention otherwise than by 1/sqrt(head_dim) "
                                  "(scale_attn_weights / scale_attn_by_inverse_layer_idx): not supported")
        if source.activation_function not in PLAIN_ACTIVATIONS:
            raise ConversionError(f"GPT-2 activation {source.activation_function!r} is not supported: one of "
                                  f"{PLAIN_ACTIVATIONS}")
        positions = source.n_positions
        fields = dict(
            vocab_size=source.vocab_size, hidden_size=source.n_embd, num_hidden_layers=source.n_layer,
            num_attention_heads=source.n_head, intermediate_size=source.n_inner or 4 * source.n_embd,
            norm_type="layernorm", norm_eps=source.layer_norm_epsilon, hidden_act=source.activation_function,
            position_embedding_type="absolute", attention_bias=True, mlp_bias=True,
        )
    else:
        act = {v: k for k, v in GLU_ACTIVATIONS.items()}.get(source.hidden_act)
        if act is None:
            raise ConversionError(f"{model_type} with hidden_act {source.hidden_act!r} is not supported: the gated "
                                  f"MLP converts with one of {sorted(GLU_ACTIVATIONS.values())}")
        rope = dict(source.rope_parameters or {})
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            raise ConversionError(f"rope_type {rope.get('rope_type')!r} is not supported: one of {ROPE_TYPES} "
                                  "(frequencies that do not depend on the sequence length)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConversionError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
        positions = source.max_position_embeddings
        # Llama and Qwen3: one flag for q/k/v/o; Mistral: no bias; Qwen2: q/k/v always, the output never
        attention_bias = {"mistral": False, "qwen2": True}.get(model_type, bool(getattr(source, "attention_bias", False)))
        fields = dict(
            vocab_size=source.vocab_size, hidden_size=source.hidden_size,
            num_hidden_layers=source.num_hidden_layers, num_attention_heads=source.num_attention_heads,
            num_key_value_heads=source.num_key_value_heads or source.num_attention_heads,
            head_dim=getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads,
            intermediate_size=source.intermediate_size, norm_type="rmsnorm", norm_eps=source.rms_norm_eps,
            hidden_act=act, position_embedding_type="rope", rope_parameters=rope,
            attention_bias=attention_bias,
            attention_output_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(source, "mlp_bias", False)), qk_norm=model_type == "qwen3",
        )
    if max_length is not None:
        if not 1 <= max_length <= positions:
            raise ConversionError(f"--max_length {max_length} must lie in [1, {positions}] (the source's positions)")
        positions = max_length
    window = _sliding_window(source)
    if window is not None and window < positions:
        raise ConversionError(
            f"this {model_type} uses a sliding window of {window} tokens, shorter than the {positions} positions "
            f"converted, and the LookAround model attends to every earlier token: convert with --max_length {window} "
            "(or less), where the window never cuts anything off")
    return LookAroundConfig(**fields, **common, max_position_embeddings=positions)


# ----------------------------------------------------------------------------------------------------------------
# convert
# ----------------------------------------------------------------------------------------------------------------
def read_source(src) -> tuple:
    """(config, tokenizer) of a local causal LM folder, checked: a supported type, valid safetensors weights."""
    from transformers import AutoConfig

    from .data.tokenization import auto_tokenizer

    from .hub.files import read_json
    from .hub.weights import check_weights

    folder = Path(src)
    if not (folder / "config.json").is_file():
        raise ConversionError(f"{src} is not a model folder (no config.json): pass a local folder saved by "
                              "save_pretrained or downloaded from the Hub")
    raw = read_json(folder / "config.json")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type == "lookaround":
        raise ConversionError(f"{src} is already a LookAround checkpoint: nothing to convert")
    if model_type not in SUPPORTED_TYPES:
        raise ConversionError(f"model_type {model_type!r} in {src} is not supported: convert one of "
                              f"{', '.join(SUPPORTED_TYPES)}")
    check_weights(folder)
    try:
        config = AutoConfig.from_pretrained(folder)
        tokenizer = auto_tokenizer(folder)
    except (OSError, ValueError, TypeError) as err:
        raise ConversionError(f"cannot read the config or tokenizer of {src}: {str(err).splitlines()[0]}") from None
    return config, tokenizer


def _prepare_tokenizer(tokenizer, source) -> None:
    """Give the tokenizer what pretraining needs:

    - a mask token (`[MASK]` inputs, the masked objectives' single-stream form), `MASK_TOKEN` if it has none;
    - a BOS (every block starts with one, the rank-0 condition): the source config's BOS token, else EOS;
    - a pad token (collators fill short rows with it; it is never attended): EOS, as is usual for these families.
    """
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    if tokenizer.bos_token is None:
        bos = getattr(source, "bos_token_id", None)
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(bos) if isinstance(bos, int) else tokenizer.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def convert(src, max_length: int | None = None, dtype=None):
    """``(model, tokenizer)``: the `LookAroundForCausalLM` whose causal view gives the logits of the causal LM in
    the folder ``src`` (for every token of its vocabulary), and its tokenizer with a mask token.

    New vocabulary rows (the mask token) start from the mean of the existing input embeddings, and an untied
    output row from the mean of the output rows: a token nobody has seen, at the scale of the others. The query
    stream's start vector is the mask token's input row, so a two-stream query starts as a [MASK] input would.
    """
    from transformers import AutoModelForCausalLM

    from .models.lookaround.modeling_lookaround import LookAroundForCausalLM

    source_config, tokenizer = read_source(src)
    config = lookaround_config(source_config, max_length)
    try:
        source = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or "auto")
    except (OSError, ValueError, RuntimeError) as err:
        raise ConversionError(f"cannot load the weights of {src}: {str(err).splitlines()[0]}") from None
    state = to_lookaround_weights(source_config.model_type, source.state_dict())
    known = len(tokenizer)
    _prepare_tokenizer(tokenizer, source_config)
    mask_id = tokenizer.mask_token_id
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    for name in ("bos_token_id", "eos_token_id", "mask_token_id"):
        setattr(config, name, getattr(tokenizer, name))
    pad = getattr(source_config, "pad_token_id", None)
    config.pad_token_id = pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
    config.validate_lookaround()

    # a new mask id may fall on an unused padding row of the matrix (it is set too); a mask token the source
    # tokenizer already had keeps its row
    new_rows = [mask_id] if mask_id >= known else []
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state and not (name == "lm_head.weight" and config.tie_word_embeddings):
            state[name] = _with_rows(state[name], config.vocab_size, new_rows, known)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    state["model.query_embedding"] = state["model.embed_tokens.weight"][mask_id].clone()
    if "model.embed_positions.weight" in state:  # GPT-2's learned positions, cut to --max_length
        state["model.embed_positions.weight"] = state["model.embed_positions.weight"][: config.max_position_embeddings]

    # built in the source's dtype (no float32 copy of a bf16 model); every weight is then overwritten
    model = LookAroundForCausalLM._from_config(config, dtype=state["model.embed_tokens.weight"].dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [n for n in missing if not n.endswith("inv_freq")]
    if missing or unexpected:  # a table that does not cover the source is a bug here, not a user error
        raise RuntimeError(f"conversion left {missing[:4]} unset and {unexpected[:4]} unused")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval(), tokenizer


def _with_rows(weight, vocab_size: int, new_rows: list[int], known: int):
    """``weight`` (V, D) grown to ``vocab_size`` rows; rows past V and the ``new_rows`` get the mean of the rows
    of the source's tokens (the first ``known``)."""
    import torch

    mean = weight[: min(known, weight.shape[0])].float().mean(0).to(weight.dtype)
    if vocab_size > weight.shape[0]:
        weight = torch.cat([weight, mean.expand(vocab_size - weight.shape[0], -1)])
    weight = weight.clone()
    for row in new_rows:
        weight[row] = mean
    return weight


def convert_folder(src, dst, max_length: int | None = None) -> Path:
    """`hf-lookaround convert SRC -o DST`: write the converted checkpoint and its tokenizer to the new folder ``dst``."""
    out = Path(dst)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{dst} already holds files: write the converted checkpoint to a new folder")
    model, tokenizer = convert(src, max_length)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------------------------
# export
# ----------------------------------------------------------------------------------------------------------------
def export_family(config) -> str:
    """The family whose forward a LookAround checkpoint's causal view computes exactly, or a one-line refusal."""
    if getattr(config, "model_type", None) != "lookaround":
        raise ConversionError("only LookAround text checkpoints export")
    if config.prediction_stream != "content" or config.default_attention != "causal":
        form = ("two-stream (its causal view is the query stream's AR plan)" if config.prediction_stream == "query"
                else f"trained with {config.default_attention!r} attention")
        raise ConversionError(f"this checkpoint is {form}: its next-token logits are not a causal decoder's "
                              "forward, so no plain family reproduces them; only a single-stream causal checkpoint "
                              "(a conversion, or `pretrain --objective ar --ar_form single_stream`) exports")
    if config.norm_position != "pre":
        raise ConversionError("a post-norm checkpoint has no causal-LM family to export to (they are pre-norm)")
    gpt2_like = (config.norm_type == "layernorm" and config.position_embedding_type == "absolute"
                 and config.hidden_act not in ("swiglu", "geglu") and config.attention_bias
                 and config.attention_output_bias and config.mlp_bias and not config.qk_norm
                 and config.num_key_value_heads == config.num_attention_heads
                 and config.head_dim * config.num_attention_heads == config.hidden_size)
    llama_like = (config.norm_type == "rmsnorm" and config.position_embedding_type == "rope"
                  and config.hidden_act in ("swiglu", "geglu"))
    fits = {
        "gpt2": gpt2_like,
        "llama": llama_like and not config.qk_norm and config.attention_bias == config.attention_output_bias,
        "mistral": llama_like and not config.qk_norm and not config.attention_bias
        and not config.attention_output_bias and not config.mlp_bias,
        "qwen2": llama_like and not config.qk_norm and config.attention_bias and not config.attention_output_bias
        and not config.mlp_bias,
        "qwen3": llama_like and config.qk_norm and config.attention_bias == config.attention_output_bias
        and not config.mlp_bias,
    }
    source = getattr(config, "source_model_type", None)
    if fits.get(source):
        return source
    for family, ok in fits.items():
        if ok:
            return family
    raise ConversionError("no supported family computes this checkpoint's forward (its norm, positions, activation "
                          f"and biases); exportable families: {', '.join(SUPPORTED_TYPES)}")


def family_config(config, family: str):
    """The transformers config of ``family`` that computes the same forward as the LookAround ``config``."""
    from transformers import AutoConfig

    ids = dict(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
               tie_word_embeddings=config.tie_word_embeddings, vocab_size=config.vocab_size)
    if family == "gpt2":
        return AutoConfig.for_model(
            "gpt2", n_embd=config.hidden_size, n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
            n_inner=config.intermediate_size, n_positions=config.max_position_embeddings,
            layer_norm_epsilon=config.norm_eps, activation_function=config.hidden_act, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    act = {"swiglu": "silu", "geglu": "gelu"}[config.hidden_act]
    fields = dict(hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                  num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
                  head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                  max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.norm_eps,
                  hidden_act=act, rope_parameters=dict(config.rope_parameters), **ids)
    if family == "llama":
        fields.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif family == "qwen3":
        fields.update(attention_bias=config.attention_bias)
    if family == "mistral":
        fields.update(sliding_window=None)
    if family in ("qwen2", "qwen3"):
        fields.update(use_sliding_window=False)
    return AutoConfig.for_model(family, **fields)


def export(checkpoint, dst) -> str:
    """`hf-lookaround export CKPT -o OUT`: write the checkpoint in its family's format; returns the family."""
    from transformers import AutoModelForCausalLM

    from .data.tokenization import auto_tokenizer

    from .hub.load import load_pretrained

    out = Path(dst)
    if out.exists() and any(out.iterdir()):
        raise ConversionError(f"{dst} already holds files: export to a new folder")
    from transformers import AutoConfig

    from .hub.weights import check_local_checkpoint

    check_local_checkpoint(checkpoint, "hf-lookaround export")
    config = AutoConfig.from_pretrained(checkpoint)
    family = export_family(config)
    model = load_pretrained(checkpoint, head="causal-lm")
    state = {k: v for k, v in model.state_dict().items() if k != "model.query_embedding"}
    target = AutoModelForCausalLM.from_config(family_config(config, family), dtype=model.dtype)
    missing, unexpected = target.load_state_dict(from_lookaround_weights(family, state), strict=False)
    missing = [n for n in missing if not n.endswith(("inv_freq", ".attn.bias", ".attn.masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"export left {missing[:4]} unset and {unexpected[:4]} unused")
    target.tie_weights()
    target.save_pretrained(out)
    try:
        auto_tokenizer(checkpoint).save_pretrained(out)
    except (OSError, ValueError):
        pass  # a checkpoint without a tokenizer exports its weights alone
    return family




# ----------------------------------------------------------------------------------------------------------------
# pretrain --init_from, --lora_r
# ----------------------------------------------------------------------------------------------------------------
INIT_FOLDER = "init_from"  # under --output_dir: the conversion a run with --init_from starts from


def prepare_init(model_args, training_args, callbacks: list) -> list:
    """The pretraining run's init step (`--init_from`, `--lora_r`): resolves where the weights start from and
    returns ``callbacks`` with, for a LoRA run, the one that merges the adapters when training ends."""
    resolve_init_from(model_args, training_args)
    if (getattr(model_args, "lora_r", 0) or 0) <= 0:
        return callbacks
    return [*callbacks, merge_lora_at_train_end()]


def merge_lora_at_train_end():
    """A `TrainerCallback` that folds the LoRA adapters into the weights when training ends, before the final
    model is saved (defined here: this module imports transformers only when used)."""
    from transformers import TrainerCallback

    class MergeLoraAtTrainEnd(TrainerCallback):
        def on_train_end(self, args, state, control, model=None, **kwargs):
            if model is not None:
                merge_lora(model)

    return MergeLoraAtTrainEnd()


def resolve_init_from(model_args, training_args) -> None:
    """`pretrain --init_from SRC`: start from SRC's weights. A LookAround checkpoint is read as
    `--model_name_or_path`; a causal LM folder is converted first (the main process writes `output_dir/init_from`,
    atomically; a resumed run reuses it) and read from there, tokenizer and mask token included. Every objective
    and form then loads it into its own head (`build_model`)."""
    import os
    import shutil

    from .hub.files import read_json

    src = getattr(model_args, "init_from", None)
    if not src:
        return
    if model_args.model_name_or_path or model_args.config_name:
        raise ValueError("--init_from replaces --model_name_or_path and --config_name: give only one of them")
    config = read_json(Path(src) / "config.json") if (Path(src) / "config.json").is_file() else None
    if not isinstance(config, dict):
        raise ValueError(f"--init_from {src}: no config.json there; pass a local causal LM or LookAround folder")
    if config.get("model_type") == "lookaround":
        model_args.model_name_or_path = str(src)
        return
    target = Path(training_args.output_dir) / INIT_FOLDER
    with training_args.main_process_first(local=False, desc="converting --init_from"):
        if training_args.process_index == 0 and not (target / "config.json").is_file():
            partial = target.with_name(INIT_FOLDER + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            convert_folder(src, partial)
            os.replace(partial, target)  # whole or absent
    model_args.model_name_or_path = str(target)


DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_lora(model, model_args):
    """`--lora_r R`: LoRA adapters (peft) on ``--lora_target_modules`` (default: every attention and MLP
    projection), injected into the model itself, so that the Trainer, the collators and the masks see the same
    LookAround head; every other weight is frozen. :func:`merge_lora` folds them into the weights before the final
    save, which is then a plain LookAround checkpoint."""
    rank = getattr(model_args, "lora_r", 0) or 0
    if rank <= 0:
        return model
    from peft import LoraConfig, inject_adapter_in_model

    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    targets = [t.strip() for t in (model_args.lora_target_modules or ",".join(DEFAULT_LORA_TARGETS)).split(",")
               if t.strip()]
    unknown = [t for t in targets if t not in present]
    if model_args.lora_target_modules and unknown:
        raise ValueError(f"--lora_target_modules {', '.join(unknown)}: no such module in the model; choose among "
                         f"{', '.join(t for t in DEFAULT_LORA_TARGETS if t in present)}")
    targets = [t for t in targets if t in present]  # a GPT-2-style MLP has no gate_proj
    config = LoraConfig(r=rank, lora_alpha=model_args.lora_alpha or 2 * rank, lora_dropout=model_args.lora_dropout,
                        target_modules=targets)
    model = inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


# a LoRA run's checkpoint: model.safetensors holds the merged weights (a plain LookAround checkpoint of that step,
# which every command reads), this file the adapted modules' own state (their frozen base weights and the adapters),
# from which a resumed run goes on exactly
LORA_STATE_NAME = "lora_state.safetensors"


def lora_modules(model) -> dict:
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def lora_checkpoint_state(model, state_dict: dict | None = None) -> tuple[dict, dict] | None:
    """A LoRA model's state for a checkpoint, in two parts: (the merged weights under plain LookAround names, the
    adapted modules' own tensors: ``base_layer`` weights and ``lora_`` adapters). None for a model without
    adapters. The model is left as it is (the merge is computed, not applied)."""
    modules = lora_modules(model)
    if not modules:
        return None
    state = model.state_dict() if state_dict is None else state_dict
    merged, lora = {}, {}
    for key, value in state.items():
        owner = next((name for name in modules if key.startswith(name + ".")), None)
        if owner is None:
            merged[key] = value
            continue
        lora[key] = value
        rest = key[len(owner) + 1:]
        if rest.startswith("base_layer."):
            plain = f"{owner}.{rest[len('base_layer.'):]}"
            merged[plain] = value
            if rest == "base_layer.weight":  # W + (B A) * scale of each active adapter, as LoraLayer.merge adds
                merged[plain] = value.detach().clone()
                for adapter in modules[owner].active_adapters:
                    delta = lora_delta(modules[owner], adapter, state, owner)
                    if delta is not None:
                        merged[plain] += delta.to(value.dtype).to(value.device)
    return merged, lora


def lora_delta(module, adapter: str, state: dict, owner: str):
    """``(B A) * scale`` of one adapter, as peft's ``Linear.get_delta_weight`` computes it, but from the tensors of
    ``state`` (a full state dict) rather than the module's own: under FSDP the module holds shards of A and B."""
    import torch

    a, b = state.get(f"{owner}.lora_A.{adapter}.weight"), state.get(f"{owner}.lora_B.{adapter}.weight")
    if a is None or b is None:
        return None
    a, b = a.detach(), b.detach()
    if a.device.type == "cpu" and a.dtype in (torch.float16, torch.bfloat16):  # as peft: no half matmul on the CPU
        a, b = a.float(), b.float()
    delta = b @ a
    return (delta.T if module.fan_in_fan_out else delta) * module.scaling[adapter]


def load_lora_checkpoint(model, folder) -> object | None:
    """Load a LoRA run's checkpoint (:data:`LORA_STATE_NAME` beside the merged ``model.safetensors``) into ``model``,
    which carries the same adapters: the adapted modules from the LoRA file, every other tensor from the merged
    weights. Returns ``load_state_dict``'s result, or None where the folder holds no LoRA state."""
    import os

    from safetensors.torch import load_file

    path = os.path.join(folder, LORA_STATE_NAME)
    if not os.path.isfile(path):
        return None
    modules = lora_modules(model)
    if not modules:
        raise ValueError(f"{folder} is a checkpoint of a LoRA run (it holds {LORA_STATE_NAME}): resume it with the "
                         "same --lora_r, --lora_target_modules and --lora_alpha")
    lora = load_file(path)
    plain = {k: v for k, v in load_file(os.path.join(folder, "model.safetensors")).items()
             if not any(k.startswith(name + ".") for name in modules)}
    from .training.checkpointing import is_sharded

    if not is_sharded(model):
        return model.load_state_dict({**plain, **lora}, strict=False)
    # FSDP2: every rank hands its full copy to torch, which keeps each parameter's own shard
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    return set_model_state_dict(model, {**plain, **lora}, options=StateDictOptions(full_state_dict=True,
                                                                                     strict=False))


def check_lora_trainer(trainer) -> None:
    """Refuse, in one line, a LoRA run under a setup whose adapters this package does not handle: FSDP1 (its flat
    parameters mix frozen and trained weights; peft needs ``use_orig_params=True`` there, and the merge would
    act on flat shards). FSDP2, the recipe's (``examples/accelerate/fsdp.yaml``), keeps each parameter apart."""
    if not lora_modules(trainer.model) or not getattr(trainer, "is_fsdp_enabled", False):
        return
    version = getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)
    if version != 2:
        raise ValueError(f"--lora_r under FSDP version {version} is not supported: use FSDP2 (fsdp_version: 2 "
                         "in the accelerate config, as examples/accelerate/fsdp.yaml does)")


def merge_lora(model) -> bool:
    """Fold every LoRA adapter into its base weight and put the base layer back in place (so the state dict has
    the plain LookAround names); returns whether there was any."""
    from peft.tuners.lora import LoraLayer

    from .training.checkpointing import is_sharded

    if is_sharded(model):
        # FSDP2: the adapters and weights are shards; the final save gathers the full state dict (under either
        # state dict type) and writes the merge computed from it (lora_checkpoint_state): merged all the same
        return False
    merged = False
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], module.get_base_layer())
            merged = True
    if merged:
        for param in model.parameters():
            param.requires_grad_(True)
        model.freeze_unused_parameters()
    return merged


__all__ = ["SUPPORTED_TYPES", "MASK_TOKEN", "ConversionError", "convert", "convert_folder", "lookaround_config",
           "export", "export_family", "family_config", "to_lookaround_weights", "from_lookaround_weights",
           "prepare_init", "with_lora", "merge_lora", "LORA_STATE_NAME", "lora_checkpoint_state",
           "load_lora_checkpoint", "check_lora_trainer", "lora_modules"]
