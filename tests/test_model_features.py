"""The config features that express Llama, Mistral, Qwen2, Qwen3 and GPT-2 (issue 39): grouped-query attention, an
explicit head width, q/k/v bias apart from the output bias, per-head q/k norms, untied embeddings, RoPE scaling and
GPT-2's learned positions. Each is checked against an independent statement of what it must compute; that a
converted source model gives its own logits is tests/test_adaptation.py's."""

import pytest
import torch

import hf_lookaround as H
from hf_lookaround.objectives import make_plan


def inputs(batch=2, length=12, vocab=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, length), generator=g)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_grouped_query_attention_is_multi_head_attention_with_repeated_key_value_heads(tiny_model, impl):
    """2 key/value heads serving 4 query heads = 4 heads whose key/value projections repeat each of the 2."""
    gqa = tiny_model(H.LookAroundForPreTraining, impl, num_attention_heads=4, num_key_value_heads=2)
    assert gqa.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)  # 2 heads of width 8
    mha = tiny_model(H.LookAroundForPreTraining, impl, num_attention_heads=4)
    state = gqa.state_dict()
    for name, tensor in state.items():
        if ".k_proj." in name or ".v_proj." in name:  # (2 * 8, ...) -> (4 * 8, ...): each head twice, in order
            state[name] = tensor.unflatten(0, (2, 8)).repeat_interleave(2, dim=0).flatten(0, 1)
    mha.load_state_dict(state)
    ids = inputs()
    plan = make_plan("dar", [12, 12], 12, t=2, generator=torch.Generator().manual_seed(0))
    for kw in (dict(group_ids=plan.group_ids), dict(group_ids=torch.zeros_like(ids))):
        torch.testing.assert_close(gqa(input_ids=ids, **kw).logits, mha(input_ids=ids, **kw).logits,
                                   rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_keeps_the_two_stream_masks(tiny_model):
    from hf_lookaround.leakcheck import audit_two_stream

    model = tiny_model(H.LookAroundForPreTraining, num_attention_heads=4, num_key_value_heads=1, head_dim=4,
                       qk_norm=True)
    ids = inputs()
    plan = make_plan("gvp", [12, 12], 12, num_groups=3, generator=torch.Generator().manual_seed(1))
    report = audit_two_stream(model, ids, torch.ones_like(ids), plan.group_ids, plan.is_target)
    assert report.leaks == [] and report.blind == [], report
    assert report.targets_checked == int(plan.is_target.sum()) and report.targets_seeing_something > 0


def test_explicit_head_dim_sets_the_projection_widths(tiny_model):
    model = tiny_model(H.LookAroundForCausalLM, num_attention_heads=2, head_dim=24, num_key_value_heads=1)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (48, 32) and attn.k_proj.weight.shape == (24, 32)
    assert attn.o_proj.weight.shape == (32, 48)
    assert model(input_ids=inputs()).logits.shape == (2, 12, 61)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        H.LookAroundConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="or set head_dim explicitly"):
        H.LookAroundConfig(hidden_size=30, num_attention_heads=4)
    assert H.LookAroundConfig(hidden_size=30, num_attention_heads=4, head_dim=8).head_dim == 8


def test_qkv_bias_apart_from_the_output_bias(tiny_model):
    qwen2 = tiny_model(H.LookAroundForCausalLM, attention_bias=True, attention_output_bias=False).model.layers[0]
    assert qwen2.self_attn.q_proj.bias is not None and qwen2.self_attn.v_proj.bias is not None
    assert qwen2.self_attn.o_proj.bias is None
    llama = tiny_model(H.LookAroundForCausalLM, attention_bias=True).model.layers[0]  # one flag for all four
    assert llama.self_attn.o_proj.bias is not None
    assert tiny_model(H.LookAroundForCausalLM).model.layers[0].self_attn.o_proj.bias is None


def test_qk_norm_normalises_each_head_of_queries_and_keys(tiny_model):
    """Scaling q_proj and k_proj leaves a qk-normed model unchanged (each head's q and k are RMS-normalised);
    without the norm it changes the output."""
    ids = inputs()
    for qk_norm, unchanged in ((True, True), (False, False)):
        model = tiny_model(H.LookAroundForCausalLM, qk_norm=qk_norm, norm_eps=1e-12)
        before = model(input_ids=ids).logits
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(7.0)
                layer.self_attn.k_proj.weight.mul_(0.2)
        after = model(input_ids=ids).logits
        assert torch.allclose(before, after, atol=1e-4) == unchanged
    attn = model.model.layers[0].self_attn
    assert isinstance(tiny_model(H.LookAroundForCausalLM, qk_norm=True).model.layers[0].self_attn.q_norm,
                      type(model.model.norm))
    assert not any("q_norm" in name for name, _ in attn.named_parameters())


def test_untied_output_embeddings_are_their_own_weights_and_survive_a_save(tiny_model, tmp_path):
    model = tiny_model(H.LookAroundForCausalLM, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    model.save_pretrained(tmp_path)
    loaded = H.LookAroundForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert torch.equal(loaded.model.embed_tokens.weight, model.model.embed_tokens.weight)
    tied = tiny_model(H.LookAroundForCausalLM)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()


def test_linear_rope_scaling_divides_the_positions(tiny_model):
    """RoPE with linear factor f at positions f * p is plain RoPE at positions p."""
    plain = tiny_model(H.LookAroundForCausalLM)
    scaled = tiny_model(H.LookAroundForCausalLM, rope_parameters={"rope_type": "linear", "factor": 4.0})
    ids = inputs()
    positions = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(scaled(input_ids=ids, position_ids=4 * positions).logits,
                               plain(input_ids=ids, position_ids=positions).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scaled(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)


def test_llama3_rope_scaling_keeps_high_frequencies_and_divides_low_ones(tiny_config):
    """Llama 3.1's rule: wavelengths shorter than original_max / high_freq_factor unchanged, longer than
    original_max / low_freq_factor divided by the factor (in between: smoothed)."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    config = tiny_config(hidden_size=64, num_attention_heads=2, rope_parameters=rope)
    plain = H.models.lookaround.modeling_lookaround.LookAroundRotaryEmbedding(tiny_config(hidden_size=64,
                                                                                          num_attention_heads=2))
    scaled = H.models.lookaround.modeling_lookaround.LookAroundRotaryEmbedding(config)
    wavelength = 2 * torch.pi / plain.inv_freq
    short, long = wavelength < 64 / 4.0, wavelength > 64 / 1.0
    assert short.any() and long.any()
    torch.testing.assert_close(scaled.inv_freq[short], plain.inv_freq[short])
    torch.testing.assert_close(scaled.inv_freq[long], plain.inv_freq[long] / 8.0)
    assert config.rope_theta == 10000.0 and config.rope_parameters["rope_type"] == "llama3"


def test_rope_parameters_default_to_rope_theta_and_refuse_length_dependent_types(tiny_config):
    config = tiny_config(rope_theta=500.0)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
    assert tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 7.0}).rope_theta == 7.0
    overridden = tiny_config()
    overridden.rope_theta = 500.0  # what --config_overrides does: the model and a saved config follow
    assert overridden.rope_parameters["rope_theta"] == 500.0
    assert H.LookAroundConfig.from_dict(overridden.to_dict()).rope_theta == 500.0
    rotary = H.models.lookaround.modeling_lookaround.LookAroundRotaryEmbedding
    torch.testing.assert_close(rotary(overridden).inv_freq, rotary(tiny_config(rope_theta=500.0)).inv_freq)
    with pytest.raises(ValueError, match="rope_type must be one of"):
        tiny_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0})


def test_gpt2_learned_positions_layernorm_gelu_and_biases(tiny_model):
    """GPT-2's parts: learned absolute positions, LayerNorm with bias, gelu_new, biases everywhere."""
    model = tiny_model(H.LookAroundForCausalLM, position_embedding_type="absolute", norm_type="layernorm",
                       norm_eps=1e-5, hidden_act="gelu_new", attention_bias=True, mlp_bias=True)
    layer = model.model.layers[0]
    assert model.model.embed_positions.weight.shape == (64, 32)
    assert isinstance(layer.attention_norm, torch.nn.LayerNorm) and layer.attention_norm.bias is not None
    assert layer.mlp.up_proj.bias is not None and not hasattr(layer.mlp, "gate_proj")
    assert all(getattr(layer.self_attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    ids = inputs()
    shifted = model(input_ids=ids, position_ids=torch.arange(1, 13).expand(2, 12)).logits
    assert not torch.allclose(shifted, model(input_ids=ids).logits)  # the positions are read


def test_defaults_keep_an_existing_checkpoint_config(tiny_config):
    """A config.json written before these fields existed loads to the same widths and plain RoPE."""
    old = {k: v for k, v in tiny_config().to_dict().items()
           if k not in ("head_dim", "num_key_value_heads", "attention_output_bias", "qk_norm", "rope_parameters")}
    config = H.LookAroundConfig.from_dict(old)
    assert (config.head_dim, config.num_key_value_heads, config.attention_output_bias, config.qk_norm) == (
        16, 2, False, False)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    names = set(H.LookAroundForPreTraining(config).state_dict())
    assert not any("q_norm" in n or "k_norm" in n for n in names)
