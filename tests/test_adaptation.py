"""`hf-lookaround convert` (issue 39): a Llama, Mistral, Qwen2, Qwen3 or GPT-2 folder becomes a LookAround checkpoint
whose causal view gives the source's logits (fp32, 1e-4), with the package and in a process without it; and
`hf-lookaround export` writes such a checkpoint back in its family's format, with the same logits."""

import json
import random
import textwrap

import pytest
import torch
from conftest import one_line_error

SOURCE_WORDS = [f"w{i}" for i in range(58)]  # the source tokenizer's corpus


def source_texts(count=50, length=40, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(SOURCE_WORDS) for _ in range(length)) for _ in range(count)]


def source_tokenizer():
    """A byte-level BPE of 300 tokens with BOS and EOS but no pad and no mask token, as Llama's and Qwen's are
    (transformers reads a Qwen2 folder's tokenizer with its own BPE class, so it must be a BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(source_texts(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


SOURCE_VOCAB = 300
COMMON = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=64,
              bos_token_id=1, eos_token_id=2)
# name -> (config class, fields): every family, GQA, both bias layouts, q/k norms, tied and untied, each RoPE scaling
FAMILIES = {
    "llama_gqa_untied_linear": ("LlamaConfig", dict(COMMON, vocab_size=SOURCE_VOCAB, num_attention_heads=4,
                                                    num_key_value_heads=2, tie_word_embeddings=False,
                                                    rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 10000.0})),
    "llama_bias_tied_llama3_padded_vocab": ("LlamaConfig", dict(
        COMMON, vocab_size=SOURCE_VOCAB + 3, num_attention_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 500000.0})),
    "mistral_mqa_head_dim": ("MistralConfig", dict(COMMON, vocab_size=SOURCE_VOCAB, num_attention_heads=2,
                                                   num_key_value_heads=1, head_dim=24, sliding_window=64,
                                                   tie_word_embeddings=False)),
    "qwen2_qkv_bias_tied": ("Qwen2Config", dict(COMMON, vocab_size=SOURCE_VOCAB, num_attention_heads=4, num_key_value_heads=2,
                                                tie_word_embeddings=True)),
    "qwen3_qk_norm_untied": ("Qwen3Config", dict(COMMON, vocab_size=SOURCE_VOCAB, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)),
    "qwen3_bias_yarn": ("Qwen3Config", dict(COMMON, vocab_size=SOURCE_VOCAB, num_attention_heads=2, head_dim=16,
                                            num_key_value_heads=2, attention_bias=True,
                                            tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 16,
                                                             "rope_theta": 10000.0})),
    "gpt2_tied": ("GPT2Config", dict(vocab_size=SOURCE_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)),
}


def save_source(folder, name, seed=0):
    """A tiny random causal LM of the family ``name`` in ``folder``, every weight drawn at a visible scale (norm
    weights near 1, biases non-zero), so that a weight mapped to the wrong place shows in the logits."""
    import transformers

    class_name, fields = FAMILIES[name]
    config = getattr(transformers, class_name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            is_norm = "norm" in param_name or ".ln_" in param_name
            param.copy_(torch.randn_like(param) * (0.1 if is_norm else 0.3) + (1.0 if is_norm and
                                                                                 param_name.endswith("weight") else 0))
    model.save_pretrained(folder)
    tokenizer = source_tokenizer()
    assert len(tokenizer) == SOURCE_VOCAB
    tokenizer.save_pretrained(folder)
    return model


def random_ids(seed=1, batch=2, length=24):
    return torch.randint(0, SOURCE_VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def source_columns(vocab_size, mask_id):
    """The logits a conversion keeps: every id of the source's vocabulary but the mask token's, which is new (past
    the vocabulary: not a column of the source) or replaces an unused padding row (its logit changes)."""
    return [i for i in range(vocab_size) if i != mask_id]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (source folder, converted folder, source logits): every family, converted once per module."""
    from hf_lookaround import cli

    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in FAMILIES:
        source = save_source(root / name, name)
        with torch.no_grad():
            logits = source(input_ids=random_ids()).logits
        assert cli.main(["convert", str(root / name), "-o", str(root / f"{name}_lookaround")]) == 0
        out[name] = (root / name, root / f"{name}_lookaround", logits)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_causal_view_of_a_conversion_gives_the_source_logits(converted, name):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import hf_lookaround  # noqa: F401  (registers the Auto classes)

    source_dir, out, want = converted[name]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "LookAroundForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(out)
    mask_id = tokenizer.mask_token_id
    assert tokenizer.mask_token == "<|mask|>" and model.config.mask_token_id == mask_id
    with torch.no_grad():
        got = model(input_ids=random_ids()).logits
    keep = source_columns(want.shape[-1], mask_id)
    torch.testing.assert_close(got[..., keep], want[..., keep], rtol=0, atol=1e-4)
    assert model.config.vocab_size == max(want.shape[-1], mask_id + 1)
    # the new row is the mean of the source's token rows, and the query stream starts from it
    embeddings = model.model.embed_tokens.weight
    mean = embeddings[:SOURCE_VOCAB].mean(0)
    torch.testing.assert_close(embeddings[mask_id], mean)
    torch.testing.assert_close(model.model.query_embedding, mean)
    if not model.config.tie_word_embeddings:
        torch.testing.assert_close(model.lm_head.weight[mask_id], model.lm_head.weight[:SOURCE_VOCAB].mean(0))
    assert AutoConfig.from_pretrained(out).source_model_type == AutoConfig.from_pretrained(source_dir).model_type


def test_conversions_load_with_remote_code_in_a_process_without_the_package(converted, run_without_package,
                                                                               tmp_path):
    expected = {name: (str(out), logits) for name, (_, out, logits) in converted.items()}
    torch.save({"ids": random_ids(), "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch, transformers
        io = torch.load({str(tmp_path / "io.pt")!r})
        for name, (folder, want) in io["expected"].items():
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            assert not type(model).__module__.startswith("hf_lookaround"), type(model).__module__
            mask_id = model.config.mask_token_id
            keep = [i for i in range(want.shape[-1]) if i != mask_id]
            with torch.no_grad():
                got = model(input_ids=io["ids"]).logits
            torch.testing.assert_close(got[..., keep], want[..., keep], rtol=0, atol=1e-4, msg=name)
        assert not any(m.startswith("hf_lookaround") for m in sys.modules)
        print("REMOTE-OK", len(io["expected"]))
    """)
    result = run_without_package(script)
    assert f"REMOTE-OK {len(FAMILIES)}" in result.stdout, result.stderr[-3000:]


def test_the_tokenizer_of_a_conversion_loads_as_convert_says_without_a_prompt_or_a_model_type_warning(
        tmp_path, run_without_package, capsys):
    """Issue 43: transformers 5.17's AutoTokenizer reads config.json through AutoConfig before the tokenizer files
    (tokenization_auto.py), and config.json's auto_map makes the config remote code. So a plain
    ``AutoTokenizer.from_pretrained(CKPT)`` without the package asks "Do you wish to run the custom code?" (15 s on a
    terminal; here stdin is closed, so it fails at once), then falls back to a bare PreTrainedConfig, which logs
    "You are using a model of type `lookaround` to instantiate a model of type ``". The checkpoint cannot avoid it
    (remote code needs that auto_map); what `convert` prints (the tokenizer with trust_remote_code=True as the
    model) loads both and generates without either message."""
    from hf_lookaround import cli

    save_source(tmp_path / "src", "gpt2_tied")
    out = tmp_path / "converted"
    assert cli.main(["convert", str(tmp_path / "src"), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "AutoTokenizer.from_pretrained" in said and said.count("trust_remote_code=True") == 1
    # how convert loaded the source (a local folder, offline) is not saved as the conversion's own settings
    saved = json.loads((out / "tokenizer_config.json").read_text())
    assert "local_files_only" not in saved and "is_local" not in saved and saved["mask_token"]
    asked, warned = "contains custom code", "to instantiate a model of type ``"
    for plain in (True, False):
        result = run_without_package(textwrap.dedent(f"""
            import sys, transformers
            folder = {str(out)!r}
            if {plain}:
                transformers.AutoTokenizer.from_pretrained(folder)
            else:  # as convert says, without the package
                tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
                model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
                ids = tokenizer(tokenizer.bos_token + "a b", add_special_tokens=False, return_tensors="pt").input_ids
                assert model.generate(ids, max_new_tokens=2, do_sample=False).shape[1] == ids.shape[1] + 2
            assert not any(m.startswith("hf_lookaround") for m in sys.modules)
            print("LOADED")
        """))
        text = result.stdout + result.stderr
        assert "LOADED" in result.stdout, text[-3000:]
        if plain:  # the cause, shown: what the fault hunt saw
            assert asked in text and warned in text, text[-3000:]
        else:
            assert asked not in text and warned not in text, text[-3000:]


def test_unsupported_and_broken_sources_are_refused_in_one_line(tmp_path, capsys):
    import transformers

    bert = tmp_path / "bert"
    transformers.BertConfig(vocab_size=SOURCE_VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(bert)
    line = one_line_error(capsys, ["convert", str(bert), "-o", str(tmp_path / "a")])
    assert "'bert'" in line and "llama, mistral, qwen2, qwen3, gpt2" in line

    line = one_line_error(capsys, ["convert", str(tmp_path / "nowhere"), "-o", str(tmp_path / "b")])
    assert "no config.json" in line

    broken = tmp_path / "broken"
    save_source(broken, "qwen2_qkv_bias_tied")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    line = one_line_error(capsys, ["convert", str(broken), "-o", str(tmp_path / "c")])
    assert "model.safetensors" in line and "corrupt" in line

    # a sliding window shorter than the positions would change the forward: refused, and exact below it
    windowed = tmp_path / "windowed"
    save_source(windowed, "mistral_mqa_head_dim")
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    line = one_line_error(capsys, ["convert", str(windowed), "-o", str(tmp_path / "d")])
    assert "sliding window of 16" in line and "--max_length 16" in line
    from hf_lookaround import cli

    assert cli.main(["convert", str(windowed), "-o", str(tmp_path / "d"), "--max_length", "16"]) == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["max_position_embeddings"] == 16

    line = one_line_error(capsys, ["convert", str(windowed), "-o", str(tmp_path / "d"), "--max_length", "16"])
    assert "already holds files" in line


# ------------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("name", list(FAMILIES))
def test_export_writes_the_family_back_with_the_same_logits(converted, name, tmp_path):
    import transformers

    import hf_lookaround  # noqa: F401
    from hf_lookaround import cli

    source_dir, out, want = converted[name]
    assert cli.main(["export", str(out), "-o", str(tmp_path / "exported")]) == 0
    family = json.loads((source_dir / "config.json").read_text())["model_type"]
    written = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert written["model_type"] == family and "auto_map" not in written
    assert not list((tmp_path / "exported").glob("*.py"))  # plain transformers code, no remote code
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    assert type(exported).__module__.startswith(f"transformers.models.{family}")
    lookaround = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        got, view = exported(input_ids=random_ids()).logits, lookaround(input_ids=random_ids()).logits
    torch.testing.assert_close(got, view, rtol=0, atol=1e-4)  # every column, the mask token's too
    keep = source_columns(want.shape[-1], lookaround.config.mask_token_id)
    torch.testing.assert_close(got[..., keep], want[..., keep], rtol=0, atol=1e-4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert tokenizer.mask_token_id == lookaround.config.mask_token_id


def test_export_refuses_checkpoints_whose_causal_view_is_no_family_forward(tmp_path, capsys, tiny_model):
    import hf_lookaround as H

    two_stream = tiny_model(H.LookAroundForPreTraining, objective="ar")
    two_stream.save_pretrained(tmp_path / "two_stream")
    line = one_line_error(capsys, ["export", str(tmp_path / "two_stream"), "-o", str(tmp_path / "a")])
    assert "two-stream" in line and "single-stream causal" in line

    one_stream_dar = tiny_model(H.LookAroundForCausalLM, objective="dar", default_attention="block_causal",
                                attention_group_size=2, prediction_stream="content")
    one_stream_dar.save_pretrained(tmp_path / "dar")
    line = one_line_error(capsys, ["export", str(tmp_path / "dar"), "-o", str(tmp_path / "b")])
    assert "'block_causal'" in line

    post_norm = tiny_model(H.LookAroundForCausalLM, default_attention="causal", prediction_stream="content",
                           norm_position="post")
    post_norm.save_pretrained(tmp_path / "post")
    line = one_line_error(capsys, ["export", str(tmp_path / "post"), "-o", str(tmp_path / "c")])
    assert "post-norm" in line

    # a single-stream causal checkpoint trained from scratch (rmsnorm, RoPE, SwiGLU) is a Llama
    gpt = tiny_model(H.LookAroundForCausalLM, default_attention="causal", prediction_stream="content", objective="ar")
    gpt.save_pretrained(tmp_path / "ar")
    from hf_lookaround import cli

    assert cli.main(["export", str(tmp_path / "ar"), "-o", str(tmp_path / "d")]) == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["model_type"] == "llama"
    import transformers

    llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "d").eval()
    ids = random_ids() % gpt.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(llama(input_ids=ids).logits, gpt(input_ids=ids).logits, rtol=0, atol=1e-4)


def test_lm_evaluation_harness_scores_a_conversion_as_it_scores_the_source(converted):
    """lm-evaluation-harness's `hf` model reads a conversion as any causal LM: its log-likelihoods are the source's,
    less only the mask token's share of each softmax (a new column: log-probabilities can only fall, and little)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    source_dir, out, _ = converted["qwen3_qk_norm_untied"]
    pairs = [("w1 w2 w3", " w4 w5"), ("w10 w11", " w12"), ("w40 w3 w7 w9", " w9 w9 w1")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    scores = {}
    for name, path in (("source", source_dir), ("converted", out)):
        lm = HFLM(pretrained=str(path), trust_remote_code=True, device="cpu", dtype="float32", batch_size=2)
        scores[name] = torch.tensor([ll for ll, _ in lm.loglikelihood(requests)], dtype=torch.float64)
    gap = scores["source"] - scores["converted"]
    assert (gap >= -1e-5).all() and (gap < 0.05).all(), (scores, gap)


def test_a_bf16_source_converts_in_bf16_and_gpt2_positions_cut_to_max_length(tmp_path):
    import transformers
    from safetensors import safe_open

    import hf_lookaround  # noqa: F401
    from hf_lookaround import cli

    source = save_source(tmp_path / "qwen2", "qwen2_qkv_bias_tied").to(torch.bfloat16)
    source.save_pretrained(tmp_path / "qwen2")
    assert cli.main(["convert", str(tmp_path / "qwen2"), "-o", str(tmp_path / "out")]) == 0
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    ids = random_ids()
    load = transformers.AutoModelForCausalLM.from_pretrained
    want = load(tmp_path / "qwen2", dtype=torch.float32).eval()(input_ids=ids).logits
    got = load(tmp_path / "out", dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(got[..., :SOURCE_VOCAB], want, rtol=0, atol=1e-4)

    gpt2 = save_source(tmp_path / "gpt2", "gpt2_tied")
    assert cli.main(["convert", str(tmp_path / "gpt2"), "-o", str(tmp_path / "gpt2_32"), "--max_length", "32"]) == 0
    short = load(tmp_path / "gpt2_32").eval()
    assert short.model.embed_positions.weight.shape[0] == 32
    ids = random_ids(length=32)
    with torch.no_grad():
        torch.testing.assert_close(short(input_ids=ids).logits[..., :SOURCE_VOCAB], gpt2(input_ids=ids).logits,
                                   rtol=0, atol=1e-4)
