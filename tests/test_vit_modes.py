"""Target modes (p2p, p2d, d2d), the visual codebook and condition tokens of the ViT, tested from the outside:
gradient leaks, losses against an outside computation, save/load of the codebook, clear errors."""

import textwrap

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModel, AutoModelForImageClassification, AutoModelForPreTraining

from hf_lookaround.models.lookaround.modeling_lookaround_vit import (
    LookAroundViTForImageClassification,
    LookAroundViTForPreTraining,
    LookAroundViTModel,
    normalise_patches,
    patchify,
)
from hf_lookaround.decoding.images import vit_plan
from hf_lookaround.data.visual_tokenizer import encode, encode_images, fit_codebook, fit_pixel_decoder

PATCH, SIDE, K = 7, 28, 16  # tiny_vit_config's 16 patches of 7x7 (tests/conftest.py), 16 visual tokens


@pytest.fixture
def codebook_config(tiny_vit_config):
    """The shared tiny ViT with a 16-token codebook."""
    return lambda **overrides: tiny_vit_config(**{"codebook_size": K, **overrides})


def images(n=2, seed=0):
    return torch.rand(n, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))


_TOKENIZER = {}


def visual_tokenizer():
    """(codebook, pixel decoder) fitted once on 32 random images."""
    if not _TOKENIZER:
        x = images(32, seed=100)
        codebook = fit_codebook(x, PATCH, K, seed=0)
        _TOKENIZER["t"] = codebook, fit_pixel_decoder(x, codebook, PATCH)
    return _TOKENIZER["t"]


@pytest.fixture
def make(tiny_model):
    """The shared tiny model with a 16-token codebook, fitted (``codebook=True``) when its mode uses one."""

    def build(cls=LookAroundViTForPreTraining, impl="eager", seed=0, codebook=True, **overrides):
        model = tiny_model(cls, impl, seed, **{"codebook_size": K, **overrides})
        if codebook and model.config.uses_codebook:
            model.set_visual_codebook(*visual_tokenizer())
        return model

    return build


def condition_kwargs(config, n, kind):
    if not config.num_condition_tokens:
        return {}
    if kind == "class":
        return {"class_labels": torch.arange(n) % config.num_condition_classes}
    return {"condition_embeds": torch.randn(n, config.num_condition_tokens, config.hidden_size,
                                            generator=torch.Generator().manual_seed(5))}


# ------------------------------------------------------------------------------------------ leaks
def target_losses(model, x, plan, condition):
    """Every target slot's loss, with the inputs it is differentiated by: ``(rows, ranks, losses, patches, cond)``.

    ``patches`` is the pixels (p2p, p2d) or the visual-token embeddings (d2d, caught with a forward hook);
    ``cond`` is ``condition_embeds``, or the class embedding's output, or None."""
    config = model.config
    leaves = {}

    def catch(name):
        def hook(module, args, output):
            leaves[name] = output.detach().requires_grad_(True)
            return leaves[name]
        return hook

    handles = []
    kwargs = dict(condition)
    if config.target_mode == "d2d":
        handles.append(model.vit.embeddings.visual_token_embeddings.register_forward_hook(catch("patches")))
        kwargs["input_ids"] = encode_images(x, model.vit.visual_codebook, PATCH)
    else:
        leaves["pixels"] = x.clone().requires_grad_(True)
        kwargs["pixel_values"] = leaves["pixels"]
    if "condition_embeds" in kwargs:
        kwargs["condition_embeds"] = leaves["condition"] = kwargs["condition_embeds"].clone().requires_grad_(True)
    elif "class_labels" in kwargs:
        handles.append(model.vit.embeddings.class_embeddings.register_forward_hook(catch("condition")))
    try:
        out = model(group_ids=plan.group_ids, target_positions=plan.target_positions(), **kwargs)
    finally:
        for h in handles:
            h.remove()
    prefix = config.num_prefix_tokens
    rows, ranks, losses = [], [], []
    for b in range(x.shape[0]):
        for m, t in enumerate(out.target_positions[b].tolist()):
            if t < 0:
                continue
            if config.uses_codebook:
                losses.append(F.cross_entropy(out.logits[b, m], out.target_ids[b, m]))
            else:
                losses.append(((out.logits[b, m] - patchify(x, PATCH)[b, t - prefix]) ** 2).mean())
            rows.append(b)
            ranks.append(int(plan.group_ids[b, t]))
    return rows, ranks, losses, leaves.get("patches", leaves.get("pixels")), leaves.get("condition")


def per_patch(pixel_grads):
    """(outputs, B, C, H, W) -> (outputs, B, patches): the gradient summed over each patch's pixels."""
    return patchify(pixel_grads.flatten(0, 1), PATCH).sum(-1).unflatten(0, pixel_grads.shape[:2])


LEAK_CASES = [("gvp", mode, condition) for mode in ("p2d", "d2d", "p2p") for condition in (None, "embeds", "class")]
LEAK_CASES += [("vmlm", mode, "class") for mode in ("p2d", "d2d", "p2p")]  # one target group: a masked plan


@pytest.mark.parametrize("objective,mode,condition", LEAK_CASES)
def test_a_target_sees_exactly_the_lower_ranks_and_every_condition_token(mode, condition, objective, make, leak_audit):
    """Zero gradient from every patch (pixels or visual token) of rank >= the target's, and from other images;
    non-zero from some patch it may see; condition tokens reach every target of their own image only."""
    cond = {} if condition is None else dict(num_condition_tokens=2, num_condition_classes=3)
    model = make(target_mode=mode, **cond)
    n = 2
    plan = vit_plan(model.config, objective, n, generator=torch.Generator().manual_seed(7),
                    **({"num_groups": 4, "segmentation": "random"} if objective == "gvp" else {}))
    assert torch.all(plan.group_ids[:, : model.config.num_prefix_tokens] == 0)
    x = images(n, seed=3)
    prefix = model.config.num_prefix_tokens
    rows, ranks, losses, patches, cond = target_losses(model, x, plan, condition_kwargs(model.config, n, condition))
    may_read = torch.zeros(len(rows), n, plan.group_ids.shape[1] - prefix, dtype=torch.bool)
    for i, (b, rank) in enumerate(zip(rows, ranks)):
        may_read[i, b] = plan.group_ids[b, prefix:] < rank
    reach = leak_audit.reach(losses, patches, per_unit=per_patch if patches.dim() == 4 else None)
    leak_audit.assert_reads_only(reach, may_read, must_read="some", what=f"{mode}: target")
    if cond is not None:  # every target reads its own image's condition tokens, and no other image's
        cond_reach = leak_audit.reach(losses, cond, per_unit=lambda g: g.flatten(2).sum(-1))
        leak_audit.assert_reads_only(cond_reach, torch.nn.functional.one_hot(torch.tensor(rows), n).bool(),
                                     must_read="all", what=f"{mode}: target (condition tokens)")
    checked = len(rows)
    assert checked == int(plan.is_target.sum()) > 0


# ------------------------------------------------------------------------------------------ the tokenizer
def test_fit_codebook_is_deterministic_for_a_seed_and_the_pixel_decoder_is_the_mean_member_patch():
    x = images(32, seed=100)
    codebook, decoder = visual_tokenizer()
    assert codebook.shape == (K, PATCH * PATCH) and torch.unique(codebook, dim=0).shape[0] == K
    assert torch.equal(fit_codebook(x, PATCH, K, seed=0), codebook)
    assert not torch.equal(fit_codebook(x, PATCH, K, seed=1), codebook)
    raw = patchify(x, PATCH).flatten(0, 1)
    ids = encode(normalise_patches(raw), codebook)
    for k in ids.unique().tolist():
        torch.testing.assert_close(decoder[k], raw[ids == k].mean(0))
    # more patches than max_patches: a seeded sample, still K distinct centroids
    assert fit_codebook(x, PATCH, K, seed=0, max_patches=100).shape == (K, PATCH * PATCH)


# ------------------------------------------------------------------------------------------ losses
def test_p2d_loss_is_cross_entropy_of_the_nearest_centroid_ids_of_the_target_patches(make):
    model = make(target_mode="p2d")
    codebook, _ = visual_tokenizer()
    plan = vit_plan(model.config, "vmlm", 3, generator=torch.Generator().manual_seed(1), mask_ratio_range=(0.5, 0.75))
    x = images(3, seed=1)
    slots = plan.target_positions()
    out = model(pixel_values=x, group_ids=plan.group_ids, target_positions=slots)
    assert out.logits.shape == (3, slots.shape[1], K)
    # the ids from the outside: nearest centroid by brute force
    patches = normalise_patches(patchify(x, PATCH))
    ids = torch.cdist(patches, codebook[None].expand(3, -1, -1)).argmin(-1)
    assert torch.equal(ids, encode(patches, codebook))
    terms = [F.cross_entropy(out.logits[b, m], ids[b, t - 1]) for b in range(3)
             for m, t in enumerate(slots[b].tolist()) if t >= 1]
    torch.testing.assert_close(out.loss, torch.stack(terms).mean())
    assert torch.equal(out.target_ids[slots >= 0], torch.stack([ids[b, t - 1] for b in range(3)
                                                                for t in slots[b].tolist() if t >= 1]))
    assert torch.all(out.target_ids[slots < 0] == -100)


def test_d2d_reads_visual_tokens_and_pixels_are_tokenised_the_same_way(make):
    model = make(target_mode="d2d")
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(2), num_groups=4)
    x = images(2, seed=2)
    kw = dict(group_ids=plan.group_ids, target_positions=plan.target_positions())
    from_pixels = model(pixel_values=x, **kw)
    ids = encode_images(x, model.vit.visual_codebook, PATCH)
    from_ids = model(input_ids=ids, **kw)
    assert torch.equal(from_pixels.logits, from_ids.logits) and torch.equal(from_pixels.loss, from_ids.loss)
    other = (ids + 1) % K
    assert not torch.equal(model(input_ids=other, **kw).logits, from_ids.logits)
    assert isinstance(model.get_input_embeddings(), torch.nn.Embedding)


def test_class_labels_change_the_prediction_and_minus_one_means_no_class(make):
    model = make(target_mode="p2d", num_condition_tokens=1, num_condition_classes=3)
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(0), num_groups=3)
    kw = dict(pixel_values=images(1).expand(2, -1, -1, -1).contiguous(), group_ids=plan.group_ids[:1].expand(2, -1),
              target_positions=plan.target_positions()[:1].expand(2, -1))
    logits = model(class_labels=torch.tensor([0, 1]), **kw).logits
    assert not torch.allclose(logits[0], logits[1])
    none = model(class_labels=torch.tensor([-1, -1]), **kw).logits
    slot_only = model(condition_embeds=model.vit.embeddings.condition_tokens.expand(2, -1, -1), **kw).logits
    torch.testing.assert_close(none, slot_only)


def test_a_few_steps_lower_the_p2d_and_d2d_cross_entropy(make):
    for mode in ("p2d", "d2d"):
        model = make(target_mode=mode, num_condition_tokens=1, num_condition_classes=2).train()
        x = images(8, seed=9)
        labels = torch.arange(8) % 2
        plan = vit_plan(model.config, "gvp", 8, generator=torch.Generator().manual_seed(3), num_groups=4)
        kw = dict(pixel_values=x, group_ids=plan.group_ids, target_positions=plan.target_positions(),
                  class_labels=labels)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        before = float(model(**kw).loss.detach())
        for _ in range(30):
            loss = model(**kw).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert float(model(**kw).loss.detach()) < 0.75 * before, mode


def test_features_of_a_class_conditional_model_default_to_no_class(make):
    """Probing, classification and the pipeline pass pixels only: the condition tokens carry no class (-1), so a
    label is never read by accident. Pretraining with a plan needs an explicit choice."""
    clf = make(LookAroundViTForImageClassification, target_mode="p2d", num_condition_tokens=1,
               num_condition_classes=3, num_labels=3)
    x = images()
    torch.testing.assert_close(clf(pixel_values=x).logits, clf(pixel_values=x, class_labels=torch.tensor([-1, -1])).logits)
    assert not torch.allclose(clf(pixel_values=x).logits, clf(pixel_values=x, class_labels=torch.tensor([0, 0])).logits)
    model = make(target_mode="p2d", num_condition_tokens=1, num_condition_classes=3)
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(0), num_groups=3)
    with pytest.raises(ValueError, match="pass class_labels"):
        model(pixel_values=x, group_ids=plan.group_ids, target_positions=plan.target_positions())


def test_mean_pooling_averages_the_patches_only(make):
    model = make(LookAroundViTModel, target_mode="p2p", num_condition_tokens=2, num_condition_classes=2)
    out = model(pixel_values=images(), class_labels=torch.tensor([0, 1]))
    assert out.last_hidden_state.shape == (2, 1 + 2 + 16, 32)
    torch.testing.assert_close(out.pooler_output, out.last_hidden_state[:, 3:].mean(1))


def test_p2d_training_step_has_no_graph_breaks(make):
    model = make(target_mode="p2d", impl="sdpa", num_condition_tokens=1, num_condition_classes=2).train()
    plan = vit_plan(model.config, "vmlm", 2, generator=torch.Generator().manual_seed(0), mask_ratio_range=(0.5, 0.75))
    slots = plan.target_positions(pad_to=12)

    def loss_fn(x, group_ids, slots, labels):
        return model(pixel_values=x, group_ids=group_ids, target_positions=slots, class_labels=labels).loss

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss_fn)(images(), plan.group_ids, slots, torch.tensor([0, 1]))
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons


# ------------------------------------------------------------------------------------------ save / load
def outputs_of(model, x, plan, cond):
    if isinstance(model, LookAroundViTForPreTraining):
        return model(pixel_values=x, group_ids=plan.group_ids, target_positions=plan.target_positions(), **cond).logits
    out = model(pixel_values=x, **cond)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("mode", ["p2d", "d2d"])
def test_the_codebook_is_saved_and_loaded_by_from_pretrained_and_the_auto_classes(tmp_path, mode, make):
    model = make(impl="sdpa", target_mode=mode, num_condition_tokens=1, num_condition_classes=3)
    codebook, decoder = visual_tokenizer()
    model.save_pretrained(tmp_path)
    x = images()
    cond = {"class_labels": torch.tensor([2, 0])}
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(4), num_groups=4)
    want = outputs_of(model, x, plan, cond)
    for loader in (LookAroundViTForPreTraining, AutoModelForPreTraining):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert torch.equal(loaded.vit.visual_codebook, codebook)
        assert torch.equal(loaded.vit.visual_codebook_pixels, decoder)
        assert torch.equal(outputs_of(loaded, x, plan, cond), want)
    base = AutoModel.from_pretrained(tmp_path)
    assert isinstance(base, LookAroundViTModel) and torch.equal(base.visual_codebook, codebook)
    half = AutoModelForPreTraining.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.decoder.weight.dtype == torch.bfloat16  # the weights are bf16, the tokenizer's tables are not
    assert torch.equal(half.vit.visual_codebook, codebook) and torch.equal(half.vit.visual_codebook_pixels, decoder)
    clf = AutoModelForImageClassification.from_pretrained(tmp_path, num_labels=4)
    assert torch.equal(clf.vit.visual_codebook, codebook) and clf.has_visual_codebook
    assert clf(pixel_values=x, class_labels=torch.tensor([-1, -1])).logits.shape == (2, 4)


def test_the_codebook_travels_with_remote_code_in_a_fresh_process(tmp_path, run_without_package, make):
    model = make(impl="sdpa", target_mode="d2d", num_condition_tokens=1, num_condition_classes=3)
    model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "modeling_lookaround_vit.py").exists()
    x = images()
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(4), num_groups=4)
    cond = {"class_labels": torch.tensor([1, 2])}
    torch.save({"x": x, "group_ids": plan.group_ids, "slots": plan.target_positions(),
                "want": outputs_of(model, x, plan, cond), "codebook": model.vit.visual_codebook},
               tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch, transformers
        io = torch.load({str(tmp_path / "io.pt")!r})
        model = transformers.AutoModelForPreTraining.from_pretrained({str(tmp_path / "ckpt")!r},
                                                                     trust_remote_code=True).eval()
        assert torch.equal(model.vit.visual_codebook, io["codebook"])
        got = model(pixel_values=io["x"], group_ids=io["group_ids"], target_positions=io["slots"],
                    class_labels=torch.tensor([1, 2])).logits
        assert torch.equal(got, io["want"])
        assert not any(m.startswith("hf_lookaround") for m in sys.modules)
        print("REMOTE-OK")
    """)
    result = run_without_package(script)
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------ bad input
def test_bad_configs_raise_clear_errors(codebook_config):
    with pytest.raises(ValueError, match="target_mode must be one of"):
        codebook_config(target_mode="p2x")
    for mode in ("p2d", "d2d"):
        with pytest.raises(ValueError, match="codebook_size must be an integer >= 2"):
            codebook_config(target_mode=mode, codebook_size=1)
    codebook_config(target_mode="p2p", codebook_size=1)  # p2p has no codebook: its size is not used
    with pytest.raises(ValueError, match="norm_pix_loss applies to pixel regression"):
        codebook_config(target_mode="p2d", norm_pix_loss=True)
    with pytest.raises(ValueError, match="num_condition_classes=3 needs num_condition_tokens >= 1"):
        codebook_config(num_condition_classes=3)
    with pytest.raises(ValueError, match="num_condition_tokens must be an integer >= 0"):
        codebook_config(num_condition_tokens=-1)
    with pytest.raises(ValueError, match=r"patch_size \(5\) must divide image_size \(28\)"):
        codebook_config(patch_size=5)
    assert codebook_config(num_condition_tokens=2).max_position_embeddings == 16 + 3
    with pytest.raises(ValueError, match="max_position_embeddings"):
        codebook_config(num_condition_tokens=2, max_position_embeddings=17)


def test_bad_codebooks_and_inputs_raise_clear_errors(make):
    codebook, decoder = visual_tokenizer()
    with pytest.raises(ValueError, match="has no codebook"):
        make(target_mode="p2p").set_visual_codebook(codebook)
    model = make(target_mode="p2d", codebook=False)
    with pytest.raises(ValueError, match=r"codebook has shape \(16, 49\) but this model takes \(8, 49\)"):
        make(target_mode="p2d", codebook_size=8, codebook=False).set_visual_codebook(codebook)
    with pytest.raises(ValueError, match=r"takes \(16, 16\)"):
        make(target_mode="p2d", patch_size=4, codebook=False).set_visual_codebook(codebook)
    with pytest.raises(ValueError, match=r"pixel_decoder has shape \(16, 48\)"):
        model.set_visual_codebook(codebook, decoder[:, :48])
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(0), num_groups=4)
    kw = dict(group_ids=plan.group_ids, target_positions=plan.target_positions())
    with pytest.raises(ValueError, match="needs a visual codebook and none is set: fit one"):
        model(pixel_values=images(), **kw)
    model.set_visual_codebook(codebook)
    assert model.has_visual_codebook and torch.isfinite(model(pixel_values=images(), **kw).loss)
    with pytest.raises(ValueError, match="codebook but no pixel decoder"):
        model.vit.decode_visual_tokens(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="reads pixels: pass pixel_values, not input_ids"):
        model(input_ids=torch.zeros(2, 16, dtype=torch.long), **kw)
    d2d = make(target_mode="d2d")
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        d2d(pixel_values=images(), input_ids=torch.zeros(2, 16, dtype=torch.long), **kw)
    with pytest.raises(ValueError, match=r"must lie in \[0, 16\)"):
        d2d(input_ids=torch.full((2, 16), 16), **kw)
    with pytest.raises(ValueError, match=r"shape \(batch, 16\)"):
        d2d(input_ids=torch.zeros(2, 15, dtype=torch.long), **kw)
    with pytest.raises(ValueError, match="larger than the .* distinct normalised patches"):
        fit_codebook(torch.zeros(4, 1, SIDE, SIDE), PATCH, 4)  # flat images: a single distinct patch
    with pytest.raises(ValueError, match="image size 28x28 is not divisible by patch_size 5"):
        fit_codebook(images(), 5, 4)


def test_condition_tokens_raise_clear_errors(make):
    model = make(target_mode="p2p", num_condition_tokens=2, num_condition_classes=3)
    plan = vit_plan(model.config, "gvp", 2, generator=torch.Generator().manual_seed(0), num_groups=4)
    kw = dict(pixel_values=images(), group_ids=plan.group_ids, target_positions=plan.target_positions())
    with pytest.raises(ValueError, match="pass class_labels .* or condition_embeds"):
        model(**kw)
    with pytest.raises(ValueError, match="not both"):
        model(class_labels=torch.tensor([0, 1]), condition_embeds=torch.zeros(2, 2, 32), **kw)
    with pytest.raises(ValueError, match=r"class_labels must lie in \[0, 3\)"):
        model(class_labels=torch.tensor([0, 3]), **kw)
    with pytest.raises(ValueError, match=r"condition_embeds must have shape \(2, 2, 32\)"):
        model(condition_embeds=torch.zeros(2, 1, 32), **kw)
    with pytest.raises(ValueError, match="group_ids must cover"):
        model(class_labels=torch.tensor([0, 1]), **{**kw, "group_ids": plan.group_ids[:, 2:]})
    with pytest.raises(ValueError, match="a prefix position cannot be a target"):
        model(class_labels=torch.tensor([0, 1]), **{**kw, "target_positions": torch.tensor([[2], [1]])})
    low = plan.group_ids.clone()
    low[:, 1] = 9
    with pytest.raises(ValueError, match="CLS token and the condition tokens .* lowest"):
        model(class_labels=torch.tensor([0, 1]), **{**kw, "group_ids": low})
    embeds_only = make(LookAroundViTModel, target_mode="p2p", num_condition_tokens=1)
    with pytest.raises(ValueError, match="num_condition_classes=0; pass condition_embeds"):
        embeds_only(pixel_values=images(), class_labels=torch.tensor([0, 1]))
    assert embeds_only(pixel_values=images(), condition_embeds=torch.zeros(2, 1, 32)).pooler_output.shape == (2, 32)
    with pytest.raises(ValueError, match="need condition tokens"):
        make(target_mode="p2p")(pixel_values=images(), group_ids=plan.group_ids[:, 2:],
                                target_positions=plan.target_positions() - 2, class_labels=torch.tensor([0, 1]))
