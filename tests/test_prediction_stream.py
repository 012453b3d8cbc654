"""The standard entry points (causal LM, masked LM, generate, fill-mask) use the stream a checkpoint was trained on."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, GenerationConfig

import hf_lookaround as H
from hf_lookaround.evaluation.perplexity import ar_perplexity
from hf_lookaround.objectives.ar import plan as autoregressive_plan

VOCAB = 61  # tiny_config's vocabulary (tests/conftest.py)


@pytest.fixture(scope="module")
def tokenizer(word_tokenizer):
    """Here: the word-level tokenizer over the tiny config's ids (tests/conftest.py), not the session's BPE one."""
    return word_tokenizer


@pytest.fixture(scope="module", params=[{}, dict(position_embedding_type="absolute")], ids=["rope", "absolute"])
def two_stream_checkpoint(request, tmp_path_factory, tiny_model):
    """A two-stream pretraining checkpoint (random weights) as `hf-lookaround pretrain` would save it."""
    path = tmp_path_factory.mktemp("two_stream")
    model = tiny_model(H.LookAroundForPreTraining, "sdpa", objective="ar", **request.param)
    assert model.config.prediction_stream == "query"
    model.save_pretrained(path)
    return path


def random_texts(n, seed, lengths=(5, 30)):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (n,), generator=g).tolist()
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 4, (k,), generator=g)) for k in sizes]


# --------------------------------------------------------------------------------------------- config
def test_prediction_stream_is_inferred_for_configs_without_it(tiny_config):
    assert tiny_config(objective="ar").prediction_stream == "query"
    assert tiny_config(objective="gvp").prediction_stream == "query"
    assert tiny_config(objective="mlm").prediction_stream == "query"
    # a masked checkpoint pretrained single-stream was saved from LookAroundForMaskedLM
    assert tiny_config(objective="vmlm", architectures=["LookAroundForMaskedLM"]).prediction_stream == "content"
    assert tiny_config(architectures=["LookAroundForPreTraining"]).prediction_stream == "query"
    assert tiny_config().prediction_stream is None
    # the first head built on an undecided config records its pathway
    assert H.LookAroundForPreTraining(tiny_config()).config.prediction_stream == "query"
    assert H.LookAroundForCausalLM(tiny_config()).config.prediction_stream == "content"
    assert H.LookAroundForCausalLM(tiny_config(objective="dar")).config.prediction_stream == "query"
    with pytest.raises(ValueError, match="prediction_stream must be one of"):
        tiny_config(prediction_stream="both")


# --------------------------------------------------------------------------------------------- causal LM
def test_causal_lm_perplexity_equals_the_ar_plan(two_stream_checkpoint, tokenizer):
    """AutoModelForCausalLM of a two-stream checkpoint scores exactly what the AR plan's query stream scores."""
    pretraining = H.LookAroundForPreTraining.from_pretrained(two_stream_checkpoint).eval()
    causal = AutoModelForCausalLM.from_pretrained(two_stream_checkpoint).eval()
    assert isinstance(causal, H.LookAroundForCausalLM) and causal.config.prediction_stream == "query"
    texts = random_texts(6, seed=0)
    via_plan = ar_perplexity(pretraining, tokenizer, texts, max_length=16, stride=8, batch_size=4)
    via_causal = ar_perplexity(causal, tokenizer, texts, max_length=16, stride=8, batch_size=4)
    assert via_plan.extra.get("ar_mode") == "two_stream" and via_causal.num_tokens == via_plan.num_tokens
    assert abs(via_causal.perplexity - via_plan.perplexity) <= 1e-6 * via_plan.perplexity
    # the content stream (what the causal head ran before) gives a different number
    content = H.LookAroundForCausalLM.from_pretrained(two_stream_checkpoint, prediction_stream="content").eval()
    assert abs(ar_perplexity(content, tokenizer, texts, max_length=16, stride=8).perplexity - via_plan.perplexity) > 1e-3

    # the loss with labels (HF convention: labels = input ids, shifted inside), right padding ignored
    ids = torch.randint(4, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    plan = autoregressive_plan(mask.sum(-1), ids.shape[1])
    want = pretraining(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids,
                       labels=torch.where(plan.is_target, ids, -100)).loss
    got = causal(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    torch.testing.assert_close(got.loss, want, rtol=1e-6, atol=1e-6)
    assert got.logits.shape == (2, 12, VOCAB)
    # logits_to_keep runs only the kept query rows, with the same values
    last = causal(input_ids=ids, attention_mask=mask, logits_to_keep=3).logits
    torch.testing.assert_close(last, got.logits[:, -3:], rtol=0, atol=1e-5)


def query_stream_greedy(pretraining, prompt, steps):
    """Greedy decoding recomputed from scratch through the query stream of the AR plan at every step."""
    seq = prompt
    for _ in range(steps):
        n = seq.shape[1]
        logits = pretraining(input_ids=seq, group_ids=torch.arange(n).expand_as(seq),
                             query_position_ids=torch.full((seq.shape[0], 1), n),
                             query_group_ids=torch.full((seq.shape[0], 1), n)).logits
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@torch.no_grad()
def test_greedy_generate_runs_the_query_stream(two_stream_checkpoint, impl):
    pretraining = H.LookAroundForPreTraining.from_pretrained(two_stream_checkpoint, attn_implementation=impl).eval()
    causal = AutoModelForCausalLM.from_pretrained(two_stream_checkpoint, attn_implementation=impl).eval()
    prompt = torch.randint(4, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with_cache = causal.generate(prompt, use_cache=True, **kwargs)
    without = causal.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(with_cache, without)
    assert torch.equal(with_cache, query_stream_greedy(pretraining, prompt, 10))
    # left padding: the padded prompt continues exactly as the prompt alone
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:1]], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    batch = torch.cat([padded, torch.cat([prompt[1:, :3], prompt[1:]], 1)])
    batch_mask = torch.cat([mask, torch.ones(1, 8, dtype=torch.long)])
    out = causal.generate(batch, attention_mask=batch_mask, **kwargs)
    assert torch.equal(out[0, 3:], with_cache[0])


@pytest.mark.parametrize("stream", ["query", "content"])
@torch.no_grad()
def test_static_cache_generation_equals_dynamic(two_stream_checkpoint, stream):
    causal = AutoModelForCausalLM.from_pretrained(two_stream_checkpoint, prediction_stream=stream).eval()
    prompt = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    kwargs = dict(attention_mask=mask, max_new_tokens=9, do_sample=False, pad_token_id=0)
    dynamic = causal.generate(prompt, **kwargs)
    static = causal.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("stream", ["query", "content"])
@torch.no_grad()
def test_compiled_static_cache_decoding_does_not_recompile(stream, tiny_model):
    """transformers compiles the decoding step with a static cache; every step must reuse one graph. The eager
    backend checks the graph and its guards without inductor's code generation (the GPU benchmark times it)."""
    from transformers import CompileConfig

    model = tiny_model(H.LookAroundForCausalLM, "sdpa", prediction_stream=stream)
    prompt = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(prompt)
    mask[0, :1] = 0
    compile_config = CompileConfig(backend="eager", fullgraph=True, mode=None)
    compile_config._compile_all_devices = True
    config = GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static",
                              compile_config=compile_config)
    eager = model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    try:
        model.generate(prompt, attention_mask=mask, generation_config=config)  # warm-up: compiles once
        with torch._dynamo.config.patch(error_on_recompile=True):
            out = model.generate(prompt, attention_mask=mask, generation_config=config)
            other = torch.randint(4, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
            model.generate(other, attention_mask=torch.ones_like(other), generation_config=config)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, eager)


def test_generation_longer_than_the_model_is_refused_before_it_starts(two_stream_checkpoint):
    causal = AutoModelForCausalLM.from_pretrained(two_stream_checkpoint).eval()
    prompt = torch.randint(4, VOCAB, (1, 60))
    calls = []
    causal.register_forward_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="max_position_embeddings=64: ask for at most max_new_tokens=4"):
        causal.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert not calls, "nothing may be generated before the error"
    with pytest.raises(ValueError, match="more than max_position_embeddings"):
        causal.generate(torch.randint(4, VOCAB, (1, 65)), max_new_tokens=1, do_sample=False, pad_token_id=0)
    # exactly up to the limit works
    assert causal.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (1, 64)


# --------------------------------------------------------------------------------------------- masked LM
@torch.no_grad()
def test_fill_mask_scores_are_the_query_streams(two_stream_checkpoint, tokenizer):
    from transformers import pipeline

    pretraining = H.LookAroundForPreTraining.from_pretrained(two_stream_checkpoint).eval()
    masked = AutoModelForMaskedLM.from_pretrained(two_stream_checkpoint).eval()
    assert masked.config.prediction_stream == "query"
    fill = pipeline("fill-mask", model=masked, tokenizer=tokenizer, top_k=5)
    text = "w1 w2 [MASK] w4 w5 w6"
    preds = fill(text)
    ids = tokenizer(text, return_tensors="pt").input_ids
    is_mask = ids == tokenizer.mask_token_id
    want = pretraining(input_ids=ids, group_ids=is_mask.long(), target_positions=is_mask.nonzero()[:, 1:]).logits
    probs = want[0, 0].softmax(-1)
    top = probs.topk(5)
    assert [p["token"] for p in preds] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([p["score"] for p in preds]), top.values, rtol=1e-5, atol=1e-6)

    # two masks: each is predicted from the unmasked tokens only, never from the other mask
    ids = tokenizer("w1 [MASK] w3 [MASK] w5", return_tensors="pt").input_ids
    is_mask = ids == tokenizer.mask_token_id
    logits = masked(input_ids=ids).logits
    want = pretraining(input_ids=ids, group_ids=is_mask.long(), target_positions=is_mask.nonzero()[:, 1][None]).logits
    torch.testing.assert_close(logits[is_mask], want[0], rtol=1e-5, atol=1e-5)
    changed = ids.clone()
    changed[0, 0] = 9  # an unmasked token matters ...
    assert (masked(input_ids=changed).logits[is_mask] - logits[is_mask]).abs().max() > 1e-4


@torch.no_grad()
def test_masked_lm_loss_covers_the_labelled_positions(two_stream_checkpoint):
    pretraining = H.LookAroundForPreTraining.from_pretrained(two_stream_checkpoint).eval()
    masked = AutoModelForMaskedLM.from_pretrained(two_stream_checkpoint).eval()
    ids = torch.randint(4, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    labels = torch.full_like(ids, -100)
    labels[0, [2, 5]] = ids[0, [2, 5]]
    labels[1, [1, 7]] = ids[1, [1, 7]]
    inputs = ids.clone()
    inputs[0, 2] = inputs[1, 1] = 3  # [MASK]; positions 5 and 7 keep (BERT's 10 %) or change their token
    inputs[1, 7] = 11
    loss = masked(input_ids=inputs, labels=labels).loss
    want = pretraining(input_ids=ids, group_ids=(labels != -100).long(), labels=labels).loss
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)


def test_masked_lm_without_a_mask_token_is_a_clear_error(two_stream_checkpoint):
    masked = AutoModelForMaskedLM.from_pretrained(two_stream_checkpoint, mask_token_id=None).eval()
    with pytest.raises(ValueError, match="mask_token_id is None"):
        masked(input_ids=torch.randint(4, VOCAB, (1, 6)))


def test_a_single_stream_checkpoint_keeps_its_pathway(tmp_path, tiny_model):
    model = tiny_model(H.LookAroundForMaskedLM, objective="mlm")
    model.config.prediction_stream = "content"
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.prediction_stream == "content"
    ids = torch.randint(4, VOCAB, (1, 8))
    ids[0, 3] = 3
    with torch.no_grad():
        want = loaded.lm_head(loaded.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                           attention_pattern="bidirectional").last_hidden_state)
        torch.testing.assert_close(loaded(input_ids=ids).logits, want)


# --------------------------------------------------------------------------------------------- DDP
HEADS = [H.LookAroundForPreTraining, H.LookAroundForMaskedLM, H.LookAroundForCausalLM,
         H.LookAroundForSequenceClassification]


def head_loss(model, ids, mask):
    if isinstance(model, H.LookAroundForPreTraining):
        plan = autoregressive_plan(mask.sum(-1), ids.shape[1])
        return model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids,
                     labels=torch.where(plan.is_target, ids, -100)).loss
    if isinstance(model, H.LookAroundForMaskedLM):
        inputs, labels = ids.clone(), torch.full_like(ids, -100)
        inputs[:, 2], labels[:, 2] = 3, ids[:, 2]
        return model(input_ids=inputs, attention_mask=mask, labels=labels).loss
    if isinstance(model, H.LookAroundForCausalLM):
        return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    return model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1])).loss


# the pretraining head always trains the query stream; every other head runs either stream
HEADS_AND_STREAMS = [(cls, stream) for cls in HEADS for stream in ("query", "content")
                     if not (cls is H.LookAroundForPreTraining and stream == "content")]


@pytest.mark.parametrize("cls,stream", HEADS_AND_STREAMS, ids=lambda v: getattr(v, "__name__", v))
def test_every_trainable_parameter_gets_a_gradient(cls, stream, tmp_path, tiny_model):
    """DDP with find_unused_parameters=False needs every parameter that requires grad in the graph of the loss,
    also after from_pretrained (which replaces the parameters)."""
    tiny_model(cls, prediction_stream=stream, num_labels=2).save_pretrained(tmp_path)
    ids = torch.randint(4, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    for model in (tiny_model(cls, prediction_stream=stream, num_labels=2), cls.from_pretrained(tmp_path)):
        model.train()
        head_loss(model, ids, mask).backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"{cls.__name__}/{stream}: parameters without a gradient: {missing}"
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        uses_query = stream == "query" and cls is not H.LookAroundForSequenceClassification
        assert frozen == (set() if uses_query else {"model.query_embedding"})


@pytest.mark.parametrize("head", ["pretraining", "classification"])
def test_every_trainable_vit_parameter_gets_a_gradient(head, tmp_path, tiny_vit_config):
    from hf_lookaround.models.lookaround.modeling_lookaround_vit import (
        LookAroundViTForImageClassification,
        LookAroundViTForPreTraining,
    )
    from hf_lookaround.objectives import make_plan

    config = tiny_vit_config(image_size=8, patch_size=4, num_hidden_layers=1, num_labels=2)
    cls = LookAroundViTForPreTraining if head == "pretraining" else LookAroundViTForImageClassification
    cls(config).save_pretrained(tmp_path)
    pixels = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(8))
    for model in (cls(config), cls.from_pretrained(tmp_path)):
        model.train()
        if head == "pretraining":
            plan = make_plan("mlm", [5, 5], 5, num_condition_tokens=1, generator=torch.Generator().manual_seed(0))
            loss = model(pixel_values=pixels, group_ids=plan.group_ids, target_positions=plan.target_positions()).loss
        else:
            loss = model(pixel_values=pixels, labels=torch.tensor([0, 1])).loss
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not missing, f"{head}: parameters without a gradient: {missing}"


@torch.no_grad()
def test_masked_prefix_perplexity_through_the_masked_lm_is_the_two_stream_protocol(two_stream_checkpoint, tokenizer):
    """The `[MASK]` protocol run through AutoModelForMaskedLM of a two-stream checkpoint is its two-stream prefix
    protocol (BOS rank 0, prefix rank 1, target rank 2, as masked pretraining ranks): the same numbers."""
    from hf_lookaround.evaluation.perplexity import masked_perplexity

    pretraining = H.LookAroundForPreTraining.from_pretrained(two_stream_checkpoint).eval()
    masked = AutoModelForMaskedLM.from_pretrained(two_stream_checkpoint).eval()
    texts = random_texts(3, seed=9, lengths=(4, 12))
    want = masked_perplexity(pretraining, tokenizer, texts, max_length=16, stride=8, mode="two_stream_prefix")
    got = masked_perplexity(masked, tokenizer, texts, max_length=16, stride=8, mode="mask_token")
    assert got.num_tokens == want.num_tokens
    assert abs(got.perplexity - want.perplexity) <= 1e-6 * want.perplexity


@torch.no_grad()
def test_text_generation_pipeline_decodes_through_the_query_stream(two_stream_checkpoint, tokenizer):
    from transformers import pipeline

    causal = AutoModelForCausalLM.from_pretrained(two_stream_checkpoint).eval()
    pretraining = H.LookAroundForPreTraining.from_pretrained(two_stream_checkpoint).eval()
    generator = pipeline("text-generation", model=causal, tokenizer=tokenizer)
    text = generator("w1 w2 w3", max_new_tokens=5, do_sample=False, return_full_text=False)[0]["generated_text"]
    prompt = tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    want = query_stream_greedy(pretraining, prompt, 5)[0, prompt.shape[1]:]
    assert text.split() == tokenizer.convert_ids_to_tokens(want.tolist())


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_query_stream_heads_do_not_leak(impl, tiny_model, leak_audit):
    """Causal LM: logits[t] depend on tokens <= t only. Masked LM: a [MASK] position's logits depend on the
    unmasked tokens only (not on any masked input, its own or another)."""
    ids = torch.randint(4, VOCAB, (2, 9), generator=torch.Generator().manual_seed(10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    causal = tiny_model(H.LookAroundForCausalLM, impl, prediction_stream="query")
    embeds = causal.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = causal(inputs_embeds=embeds, attention_mask=mask).logits
    rows = [(b, t) for b in range(2) for t in range(int(mask[b].sum()))]
    may_read = torch.zeros(len(rows), *ids.shape, dtype=torch.bool)
    for i, (b, t) in enumerate(rows):
        may_read[i, b, : t + 1] = True
    reach = leak_audit.reach([logits[b, t].sum() for b, t in rows], embeds)
    leak_audit.assert_reads_only(reach, may_read, must_read="all", what="causal row")

    masked = tiny_model(H.LookAroundForMaskedLM, impl, prediction_stream="query")
    inputs = ids.clone()
    inputs[:, [2, 4]] = 3
    embeds = masked.get_input_embeddings()(inputs).detach().requires_grad_(True)
    real = mask.bool()
    # the mask positions come from input_ids; the gradient is taken through a forward on the same embeddings
    is_target = (inputs == 3) & real
    targets = is_target.nonzero()[:, 1].view(2, -1)
    out = masked.model(inputs_embeds=embeds, attention_mask=mask, group_ids=is_target.long(), target_positions=targets)
    slots = [(b, m) for b in range(2) for m in range(targets.shape[1])]
    may_read = torch.zeros(len(slots), *ids.shape, dtype=torch.bool)
    for i, (b, _) in enumerate(slots):
        may_read[i, b] = ~is_target[b] & real[b]
    reach = leak_audit.reach([out.query_hidden_state[b, m].sum() for b, m in slots], embeds)
    leak_audit.assert_reads_only(reach, may_read, must_read="all", what="[MASK] position")
    # and the head itself uses exactly these rows
    torch.testing.assert_close(masked(input_ids=inputs, attention_mask=mask).logits[is_target],
                               masked.lm_head(out.query_hidden_state).flatten(0, 1))
