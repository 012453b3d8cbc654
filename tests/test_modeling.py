"""The LookAround model, tested from the outside: leaks, backends, heads, save/load, bad input."""

import textwrap

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
)

import hf_lookaround as H
from hf_lookaround import objectives
from hf_lookaround.leakcheck import audit_two_stream
from hf_lookaround.objectives import make_plan

VOCAB = 61  # tiny_config's vocabulary (tests/conftest.py)
CPU_BACKENDS_WITH_BACKWARD = ["eager", "sdpa"]




def random_plans(lengths, seq_len, seed):
    g = torch.Generator().manual_seed(seed)
    plans = {
        "ar": make_plan("ar", lengths, seq_len, generator=g),
        "dar": make_plan("dar", lengths, seq_len, t=[2, 3], generator=g),
        "mlm": make_plan("mlm", lengths, seq_len, mask_ratio=0.3, generator=g),
        "vmlm": make_plan("vmlm", lengths, seq_len, generator=g),
        "gvp": make_plan("gvp", lengths, seq_len, num_groups=4, segmentation="random", generator=g),
        "ar+prefix": make_plan("ar", lengths, seq_len, num_condition_tokens=1, generator=g),
    }
    # permuted groups with no condition rank: every token gets a distinct random rank >= 1, so the
    # lowest-ranked target sees nothing at all (the no-NaN case)
    ranks = torch.stack([torch.randperm(seq_len, generator=g) + 1 for _ in lengths])
    valid = torch.arange(seq_len)[None] < torch.as_tensor(lengths)[:, None]
    plans["permuted"] = H.Plan(torch.where(valid, ranks, 0), valid.clone())
    for name in objectives.names():  # every other objective of the table (span, mixture, ...), with its defaults
        if name not in plans:
            plans[name] = make_plan(name, lengths, seq_len, generator=g)
    return plans


def batch_inputs(seq_len=12, lengths=(12, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (len(lengths), seq_len), generator=g)
    mask = (torch.arange(seq_len)[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask, list(lengths)


# ------------------------------------------------------------------------------------------ leaks
@pytest.mark.parametrize("impl", CPU_BACKENDS_WITH_BACKWARD)
@pytest.mark.parametrize("plan_name", [*objectives.names(), "ar+prefix", "permuted"])
def test_two_stream_loss_sees_exactly_lower_ranks(impl, plan_name, tiny_model):
    model = tiny_model(H.LookAroundForPreTraining, impl)
    ids, mask, lengths = batch_inputs()
    plan = random_plans(lengths, ids.shape[1], seed=len(plan_name))[plan_name]
    report = audit_two_stream(model, ids, mask, plan.group_ids, plan.is_target)
    assert report.leaks == [], f"{plan_name}/{impl}: (row, target, positions it must not see) {report.leaks[:3]}"
    assert report.blind == [], f"{plan_name}/{impl}: targets that see none of their visible tokens"
    assert report.targets_checked == int(plan.is_target.sum()) and report.targets_seeing_something > 0


def test_the_audit_catches_a_leak(tiny_model):
    """The audit can fail: a model whose query stream also sees its own rank is caught."""
    import hf_lookaround.models.lookaround.masking_lookaround as modeling  # the mask rule lives here

    model = tiny_model(H.LookAroundForPreTraining)
    ids, mask, lengths = batch_inputs()
    plan = random_plans(lengths, ids.shape[1], seed=0)["dar"]
    rule = modeling.may_attend
    try:
        modeling.may_attend = lambda q, k, strict, valid: valid & (k <= q)  # a content-stream rule everywhere
        report = audit_two_stream(model, ids, mask, plan.group_ids, plan.is_target)
    finally:
        modeling.may_attend = rule
    assert report.leaks, "the audit missed a query stream that sees its own token"


def test_the_shared_leak_audit_catches_a_leak(leak_audit):
    """tests/conftest.py's audit can fail: a read outside the allowed units, and a missing read under "all"."""
    x = torch.randn(2, 3, 4, requires_grad=True)
    reach = leak_audit.reach([x[0, :2].sum(), x[1].sum()], x)  # output 0 reads tokens 0-1 of row 0; output 1 row 1
    may_read = torch.zeros(2, 2, 3, dtype=torch.bool)
    may_read[0, 0, 0] = may_read[1, 1] = True
    with pytest.raises(AssertionError, match=r"output 0 reads units it must not see: \[\[0, 1\]\]"):
        leak_audit.assert_reads_only(reach, may_read)
    may_read[0, 0, :] = True
    leak_audit.assert_reads_only(reach, may_read, must_read="some")
    with pytest.raises(AssertionError, match="output 0 does not read every unit"):
        leak_audit.assert_reads_only(reach, may_read, must_read="all")


@pytest.mark.parametrize("impl", CPU_BACKENDS_WITH_BACKWARD)
def test_single_stream_causal_and_masked_heads_do_not_leak(impl, tiny_model, leak_audit):
    """Causal: position t reads tokens <= t of its own row (some of them). Masked: every real token reads
    every real token of its row and no padding."""
    ids, mask, _ = batch_inputs()
    B, T = ids.shape
    causal = tiny_model(H.LookAroundForCausalLM, impl)
    embeds = causal.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = causal(inputs_embeds=embeds, attention_mask=mask).logits
    rows = [(b, t) for b in range(B) for t in range(int(mask[b].sum()))]
    may_read = torch.zeros(len(rows), B, T, dtype=torch.bool)
    for i, (b, t) in enumerate(rows):
        may_read[i, b, : t + 1] = True
    reach = leak_audit.reach([logits[b, t, ids[b, t]] for b, t in rows], embeds)
    leak_audit.assert_reads_only(reach, may_read, must_read="some", what="causal position")

    masked = tiny_model(H.LookAroundForMaskedLM, impl)
    embeds = masked.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = masked(inputs_embeds=embeds, attention_mask=mask).logits
    b, real = 1, int(mask[1].sum())
    may_read = torch.zeros(real, B, T, dtype=torch.bool)
    may_read[:, b, :real] = True
    reach = leak_audit.reach([logits[b, t, ids[b, t]] for t in range(real)], embeds)
    leak_audit.assert_reads_only(reach, may_read, must_read="all", what="masked-LM token")


def test_a_new_attention_kernel_is_one_registration(tiny_model):
    """Issue 38: a kernel joins the models in one call (its attention function and its plan mask, here SDPA's): the
    pretraining head then runs with it and gives SDPA's loss. A kernel with no plan mask is a one-line error that
    names the registered ones."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface

    from hf_lookaround.models.lookaround.masking_lookaround import PlanMaskInterface, register_attention_kernel

    calls = []

    def counted_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    ids, mask, lengths = batch_inputs()
    plan = random_plans(lengths, ids.shape[1], seed=5)["dar"]
    labels = torch.where(plan.is_target, ids, -100)
    try:
        register_attention_kernel("test_sdpa_alias", counted_sdpa, "sdpa")
        AttentionInterface.register("test_kernel_without_mask", sdpa_attention_forward)
        losses = {}
        for impl in ("sdpa", "test_sdpa_alias"):
            model = tiny_model(H.LookAroundForPreTraining, impl)
            losses[impl] = model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids, labels=labels).loss
        assert len(calls) == model.config.num_hidden_layers, "the registered kernel did not run in every layer"
        torch.testing.assert_close(losses["test_sdpa_alias"], losses["sdpa"], rtol=0, atol=0)
        unmasked = tiny_model(H.LookAroundForPreTraining, "test_kernel_without_mask")
        registered = r"registered: eager, flex_attention, lookaround_auto, sdpa, test_sdpa_alias\. Register"
        with pytest.raises(ValueError, match=r"'test_kernel_without_mask' has no plan mask; " + registered) as error:
            unmasked(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids, labels=labels)
        assert "\n" not in str(error.value)
    finally:
        for name in ("test_sdpa_alias", "test_kernel_without_mask"):
            AttentionInterface._global_mapping.pop(name, None)
            PlanMaskInterface._global_mapping.pop(name, None)


@torch.no_grad()
def test_flex_forward_ignores_tokens_it_must_not_see(static_flex_shapes, tiny_model):
    """FlexAttention has no CPU backward: check the same rule by perturbing invisible tokens."""
    model = tiny_model(H.LookAroundForPreTraining, "flex_attention")
    ids, mask, lengths = batch_inputs()
    plan = random_plans(lengths, ids.shape[1], seed=3)["dar"]
    base = model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids).logits
    for b in range(ids.shape[0]):
        target = int(plan.is_target[b].nonzero()[len(plan.is_target[b].nonzero()) // 2])
        changed = ids.clone()
        invisible = (plan.group_ids[b] >= plan.group_ids[b, target]) | (mask[b] == 0)
        changed[b, invisible] = (changed[b, invisible] + 7) % (VOCAB - 4) + 4
        out = model(input_ids=changed, attention_mask=mask, group_ids=plan.group_ids).logits
        torch.testing.assert_close(out[b, target], base[b, target], rtol=0, atol=1e-6)
        visible = (~invisible).nonzero().flatten()
        changed[b, visible] = (changed[b, visible] + 3) % (VOCAB - 4) + 4
        out = model(input_ids=changed, attention_mask=mask, group_ids=plan.group_ids).logits
        assert (out[b, target] - base[b, target]).abs().max() > 1e-4


# ------------------------------------------------------------------------------------------ backends
@pytest.mark.parametrize("overrides", [{}, dict(position_embedding_type="absolute", norm_type="layernorm",
                                                 hidden_act="gelu", norm_position="post")])
def test_backends_agree(overrides, static_flex_shapes, tiny_model):
    ids, mask, lengths = batch_inputs()
    plan = random_plans(lengths, ids.shape[1], seed=1)["vmlm"]
    results = {}
    for impl in ["eager", "sdpa", "flex_attention"]:
        model = tiny_model(H.LookAroundForPreTraining, impl, **overrides)
        with torch.no_grad():
            two = model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids).logits
            single = model.model(input_ids=ids, attention_mask=mask, attention_pattern="causal").last_hidden_state
        results[impl] = (two, single)
    for impl in ["sdpa", "flex_attention"]:
        for got, want in zip(results[impl], results["eager"]):
            real = mask.bool()[..., None] if got.shape[1] == ids.shape[1] else torch.ones_like(got, dtype=torch.bool)
            torch.testing.assert_close(got * real, want * real, rtol=1e-5, atol=1e-5)


def test_causal_plan_matches_single_stream_causal_and_no_nan(tiny_model):
    """The AR plan's content stream is exactly the causal single stream (one mask rule)."""
    model = tiny_model(H.LookAroundForPreTraining)
    ids, mask, lengths = batch_inputs()
    plan = make_plan("ar", lengths, ids.shape[1])
    out = model.model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids)
    causal = model.model(input_ids=ids, attention_mask=mask, attention_pattern="causal")
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], causal.last_hidden_state[real])
    assert torch.isfinite(out.query_hidden_state).all()


# ------------------------------------------------------------------------------------------ heads
def test_generate_with_and_without_cache_gives_same_tokens(tiny_model):
    model = tiny_model(H.LookAroundForCausalLM, "sdpa")
    ids, mask, _ = batch_inputs(seq_len=6, lengths=(6, 6))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with_cache = model.generate(ids, attention_mask=mask, use_cache=True, **kwargs)
    without = model.generate(ids, attention_mask=mask, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 18)
    assert torch.equal(with_cache, without)
    # and both equal a greedy loop over full forwards
    seq = ids
    for _ in range(12):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(seq, with_cache)


def test_left_padded_generation_matches_unpadded(tiny_model):
    model = tiny_model(H.LookAroundForCausalLM, "eager")
    prompt = torch.randint(4, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    alone = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    out = model.generate(padded, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[:, 3:], alone)


def test_fill_mask_pipeline(tmp_path, tiny_model, word_tokenizer):
    from transformers import pipeline

    tokenizer = word_tokenizer
    model = tiny_model(H.LookAroundForMaskedLM)
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer, top_k=3)
    preds = fill("w1 w2 [MASK] w4")
    assert len(preds) == 3 and all("token_str" in p for p in preds)
    logits = model(input_ids=tokenizer("w1 w2 [MASK] w4", return_tensors="pt").input_ids).logits[0, 2]
    assert preds[0]["token"] == int(logits.softmax(-1).argmax())


@pytest.mark.parametrize("problem_type,num_labels,labels", [
    ("single_label_classification", 3, torch.tensor([0, 2])),
    ("multi_label_classification", 3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),
    ("regression", 1, torch.tensor([0.5, -1.0])),
])
@pytest.mark.parametrize("pooling", ["cls", "mean", "last"])
def test_sequence_classification(problem_type, num_labels, labels, pooling, tiny_model):
    model = tiny_model(H.LookAroundForSequenceClassification, num_labels=num_labels, problem_type=problem_type,
                 classifier_pooling=pooling)
    ids, mask, _ = batch_inputs()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == (2, num_labels) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.score.weight.grad.abs().sum() > 0
    # padding does not change the pooled features of the real tokens
    extended = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1)
    ext_mask = torch.cat([mask, torch.zeros(2, 3, dtype=torch.long)], 1)
    torch.testing.assert_close(model(input_ids=extended, attention_mask=ext_mask).logits, out.logits)


# ------------------------------------------------------------------------------------------ save / load
HEADS = {
    "AutoModel": (AutoModel, H.LookAroundModel),
    "AutoModelForPreTraining": (AutoModelForPreTraining, H.LookAroundForPreTraining),
    "AutoModelForMaskedLM": (AutoModelForMaskedLM, H.LookAroundForMaskedLM),
    "AutoModelForCausalLM": (AutoModelForCausalLM, H.LookAroundForCausalLM),
    "AutoModelForSequenceClassification": (AutoModelForSequenceClassification, H.LookAroundForSequenceClassification),
}


def head_output(model, ids, mask, group_ids):
    if isinstance(model, H.LookAroundForPreTraining):
        return model(input_ids=ids, attention_mask=mask, group_ids=group_ids).logits
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_save_and_load_through_every_auto_class_is_bit_identical(tmp_path, tiny_model):
    ids, mask, lengths = batch_inputs()
    plan = make_plan("dar", lengths, ids.shape[1], generator=torch.Generator().manual_seed(0))
    assert AutoConfig.for_model("lookaround", vocab_size=VOCAB).model_type == "lookaround"
    for name, (auto, cls) in HEADS.items():
        model = tiny_model(cls, "sdpa", num_labels=3)  # sdpa: the backend from_pretrained picks by default
        path = tmp_path / name
        model.save_pretrained(path)
        assert (path / "model.safetensors").exists() and not (path / "pytorch_model.bin").exists()
        want = head_output(model, ids, mask, plan.group_ids)
        for loader in (cls, auto):
            loaded = loader.from_pretrained(path).eval()
            assert type(loaded) is cls
            assert torch.equal(head_output(loaded, ids, mask, plan.group_ids), want), f"{name} via {loader}"


def test_a_pretraining_checkpoint_loads_into_every_head(tmp_path, tiny_model):
    model = tiny_model(H.LookAroundForPreTraining)
    model.save_pretrained(tmp_path)
    ids, mask, _ = batch_inputs()
    for _, (auto, cls) in HEADS.items():
        loaded = auto.from_pretrained(tmp_path, num_labels=2) if cls is H.LookAroundForSequenceClassification \
            else auto.from_pretrained(tmp_path)
        backbone = loaded.model if hasattr(loaded, "model") else loaded
        assert torch.equal(backbone.embed_tokens.weight, model.model.embed_tokens.weight)
        assert torch.equal(backbone.query_embedding, model.model.query_embedding)
        if hasattr(loaded, "lm_head"):
            assert loaded.lm_head.weight.data_ptr() == backbone.embed_tokens.weight.data_ptr(), "LM head is tied"
        assert torch.isfinite(head_output(loaded.eval(), ids, mask, torch.zeros_like(ids))).all()


def test_remote_code_loads_in_a_fresh_process_without_the_package(tmp_path, run_without_package, tiny_model):
    ids, mask, lengths = batch_inputs()
    plan = make_plan("mlm", lengths, ids.shape[1], generator=torch.Generator().manual_seed(0))
    expected = {}
    for name, (_, cls) in HEADS.items():
        model = tiny_model(cls, "sdpa", num_labels=3)
        model.save_pretrained(tmp_path / name)
        assert (tmp_path / name / "modeling_lookaround.py").exists()
        expected[name] = head_output(model, ids, mask, plan.group_ids)
    torch.save({"ids": ids, "mask": mask, "group_ids": plan.group_ids, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch, transformers
        assert not any(m.startswith("hf_lookaround") for m in sys.modules)
        io = torch.load({str(tmp_path / "io.pt")!r})
        for name, want in io["expected"].items():
            auto = getattr(transformers, name)
            model = auto.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True).eval()
            kw = dict(input_ids=io["ids"], attention_mask=io["mask"])
            if name == "AutoModelForPreTraining":
                kw["group_ids"] = io["group_ids"]
            out = model(**kw)
            got = out.logits if hasattr(out, "logits") else out.last_hidden_state
            assert torch.equal(got, want), name
            assert not type(model).__module__.startswith("hf_lookaround"), type(model).__module__
        assert not any(m.startswith("hf_lookaround") for m in sys.modules)
        print("REMOTE-OK")
    """)
    result = run_without_package(script)
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------ training
def test_loss_honours_num_items_in_batch(tiny_model):
    """Trainer passes the target count of the whole accumulated step; the loss is then sum / count."""
    ids, mask, lengths = batch_inputs()
    plan = make_plan("mlm", lengths, ids.shape[1], mask_ratio=0.3, generator=torch.Generator().manual_seed(0))
    labels = torch.where(plan.is_target, ids, -100)
    model = tiny_model(H.LookAroundForPreTraining)
    mean = model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids, labels=labels).loss
    count = int(plan.is_target.sum())
    summed = model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids, labels=labels,
                   num_items_in_batch=torch.tensor(2 * count)).loss
    torch.testing.assert_close(summed, mean / 2)
    causal = tiny_model(H.LookAroundForCausalLM)
    mean = causal(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(causal(input_ids=ids, labels=ids, num_items_in_batch=ids[:, 1:].numel()).loss, mean)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    ids, mask, lengths = batch_inputs()
    plan = make_plan("vmlm", lengths, ids.shape[1], generator=torch.Generator().manual_seed(0))
    labels = torch.where(plan.is_target, ids, -100)
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(H.LookAroundForPreTraining, "sdpa").train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask, group_ids=plan.group_ids, labels=labels).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_compiled_training_step_has_no_graph_breaks(tiny_model):
    ids, mask, lengths = batch_inputs()
    plan = make_plan("dar", lengths, ids.shape[1], generator=torch.Generator().manual_seed(0))
    labels = torch.where(plan.is_target, ids, -100)
    targets = plan.target_positions(pad_to=ids.shape[1])
    model = tiny_model(H.LookAroundForPreTraining, "sdpa").train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_fn(ids, mask, group_ids, labels, targets):
        return model(input_ids=ids, attention_mask=mask, group_ids=group_ids, labels=labels,
                     target_positions=targets).loss

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss_fn)(ids, mask, plan.group_ids, labels, targets)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    # fullgraph=True raises on any graph break; the backward graph is compiled by AOTAutograd
    compiled = torch.compile(loss_fn, fullgraph=True)
    eager_loss = loss_fn(ids, mask, plan.group_ids, labels, targets)
    eager_loss.backward()
    eager_grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
    optimizer.zero_grad()
    compiled_loss = compiled(ids, mask, plan.group_ids, labels, targets)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss.detach(), eager_loss.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight.grad, eager_grad, rtol=1e-4, atol=1e-5)
    optimizer.step()


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_clear_errors(tiny_model, tiny_config):
    model = tiny_model(H.LookAroundForPreTraining)
    ids, mask, lengths = batch_inputs()
    plan = make_plan("ar", lengths, ids.shape[1])
    with pytest.raises(ValueError, match="group_ids must have the shape"):
        model(input_ids=ids, group_ids=plan.group_ids[:, :-1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        long = torch.randint(4, VOCAB, (1, 65))
        model(input_ids=long, group_ids=torch.zeros_like(long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_model(H.LookAroundForCausalLM)(input_ids=torch.randint(4, VOCAB, (1, 65)))
    with pytest.raises(ValueError, match="labels must be token ids"):
        model(input_ids=ids, group_ids=plan.group_ids, labels=torch.full_like(ids, VOCAB))
    with pytest.raises(ValueError, match="labels must be token ids"):
        tiny_model(H.LookAroundForMaskedLM)(input_ids=ids, labels=torch.full_like(ids, -5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model(input_ids=torch.full_like(ids, VOCAB + 3), group_ids=plan.group_ids)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(input_ids=ids, attention_mask=mask[:, :5], group_ids=plan.group_ids)
    with pytest.raises(ValueError, match="needs group_ids"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match="divisible by num_attention_heads"):
        tiny_config(hidden_size=30, num_attention_heads=4)
    with pytest.raises(ValueError, match="norm_type must be one of"):
        tiny_config(norm_type="batchnorm")
    with pytest.raises(ValueError, match="unknown preset"):
        H.LookAroundConfig.from_preset("huge")
