"""The two-stream ViT, tested from the outside: pixel-level leaks, backends, save/load, remote code, training."""

import textwrap
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForImageClassification,
    AutoModelForPreTraining,
)

from hf_lookaround.models.lookaround.modeling_lookaround_vit import (
    LookAroundViTForImageClassification,
    LookAroundViTForPreTraining,
    LookAroundViTModel,
    patchify,
    unpatchify,
)
from hf_lookaround.data.image_collator import image_plan, make_image_collator
from hf_lookaround.data.images import load_fashion_mnist
from hf_lookaround.evaluation.reconstruction import reconstruction_l2

PATCH, SIDE = 7, 28  # tiny_vit_config's 16 patches (tests/conftest.py)
HEADS = {
    "AutoModel": (AutoModel, LookAroundViTModel),
    "AutoModelForPreTraining": (AutoModelForPreTraining, LookAroundViTForPreTraining),
    "AutoModelForImageClassification": (AutoModelForImageClassification, LookAroundViTForImageClassification),
}





def images(n=2, seed=0, channels=1):
    return torch.rand(n, channels, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))


def plan_for(objective, n=2, seed=0, **params):
    defaults = {"gvp": dict(num_groups=4, segmentation="random"), "vmlm": dict(mask_ratio_range=(0.5, 0.75))}
    return image_plan(objective, n, (SIDE // PATCH) ** 2, generator=torch.Generator().manual_seed(seed),
                      **{**defaults.get(objective, {}), **params})


# ------------------------------------------------------------------------------------------ leaks
def per_patch(pixel_grads):
    """(outputs, B, C, H, W) -> (outputs, B, patches): the gradient summed over each patch's pixels."""
    return patchify(pixel_grads.flatten(0, 1), PATCH).sum(-1).unflatten(0, pixel_grads.shape[:2])


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("objective", ["vmlm", "gvp"])
@pytest.mark.parametrize("position_embedding_type", ["absolute", "rope"])
def test_reconstruction_loss_sees_exactly_the_pixels_of_lower_ranks(impl, objective, position_embedding_type, tiny_model, leak_audit):
    """d loss(target patch) / d pixel is exactly 0 for every pixel of a patch of rank >= the target's rank
    (its own patch included; the regression target is data, so it is detached) and of other images."""
    model = tiny_model(LookAroundViTForPreTraining, impl, position_embedding_type=position_embedding_type)
    plan = plan_for(objective, seed=len(objective))
    slots = plan.target_positions()
    pixels = images().requires_grad_(True)
    out = model(pixel_values=pixels, group_ids=plan.group_ids, target_positions=slots)
    truth = model.target_patches(pixels.detach())
    targets = [(b, m, t) for b in range(pixels.shape[0]) for m, t in enumerate(slots[b].tolist()) if t >= 0]
    rank = plan.group_ids[:, 1:]
    may_read = torch.zeros(len(targets), *rank.shape, dtype=torch.bool)
    for i, (b, _, t) in enumerate(targets):
        may_read[i, b] = rank[b] < plan.group_ids[b, t]
    losses = [((out.logits[b, m] - truth[b, t - 1]) ** 2).mean() for b, m, t in targets]
    reach = leak_audit.reach(losses, pixels, per_unit=per_patch)
    leak_audit.assert_reads_only(reach, may_read, must_read="some", what=f"{objective}/{impl} target patch")
    assert len(targets) == int(plan.is_target.sum()) > 0


@torch.no_grad()
def test_flex_attention_agrees_with_eager(static_flex_shapes, tiny_model):
    eager = tiny_model(LookAroundViTForPreTraining, "eager")
    flex = tiny_model(LookAroundViTForPreTraining, "flex_attention")
    plan = plan_for("gvp", seed=3)
    x = images(seed=3)
    kw = dict(group_ids=plan.group_ids, target_positions=plan.target_positions())
    want, got = eager(pixel_values=x, **kw), flex(pixel_values=x, **kw)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(flex.vit(x).pooler_output, eager.vit(x).pooler_output, rtol=1e-4, atol=1e-5)


def test_loss_is_mse_over_target_patches_only(tiny_model):
    model = tiny_model(LookAroundViTForPreTraining)
    plan = plan_for("vmlm", n=3, seed=1)
    slots = plan.target_positions()
    x = images(3, seed=1)
    out = model(pixel_values=x, group_ids=plan.group_ids, target_positions=slots)
    truth = patchify(x, PATCH)
    expected = torch.stack([((out.logits[b, m] - truth[b, t - 1]) ** 2).mean()
                            for b in range(3) for m, t in enumerate(slots[b].tolist()) if t >= 1]).mean()
    torch.testing.assert_close(out.loss, expected)
    # changing the pixels of a non-target patch changes no target's error term through the target side
    assert torch.equal(unpatchify(truth, PATCH, 1), x)


def test_norm_pix_loss_regresses_normalised_patches(tiny_model):
    model = tiny_model(LookAroundViTForPreTraining, norm_pix_loss=True)
    target = model.target_patches(images())
    torch.testing.assert_close(target.mean(-1), torch.zeros(target.shape[:2]), atol=1e-5, rtol=0)
    torch.testing.assert_close(target.std(-1, unbiased=False), torch.ones(target.shape[:2]), atol=1e-3, rtol=0)


# ------------------------------------------------------------------------------------------ heads, save/load
def head_output(model, x, plan):
    if isinstance(model, LookAroundViTForPreTraining):
        return model(pixel_values=x, group_ids=plan.group_ids, target_positions=plan.target_positions()).logits
    out = model(pixel_values=x)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def test_save_and_load_through_the_auto_classes_is_bit_identical(tmp_path, tiny_model):
    x, plan = images(), plan_for("gvp")
    assert AutoConfig.for_model("lookaround_vit", image_size=28, patch_size=7).num_patches == 16
    for name, (auto, cls) in HEADS.items():
        model = tiny_model(cls, "sdpa", num_labels=3)
        model.save_pretrained(tmp_path / name)
        want = head_output(model, x, plan)
        for loader in (cls, auto):
            loaded = loader.from_pretrained(tmp_path / name).eval()
            assert type(loaded) is cls
            assert torch.equal(head_output(loaded, x, plan), want), f"{name} via {loader.__name__}"


def test_a_pretraining_checkpoint_loads_into_the_classifier(tmp_path, tiny_model):
    model = tiny_model(LookAroundViTForPreTraining)
    model.save_pretrained(tmp_path)
    clf = AutoModelForImageClassification.from_pretrained(tmp_path, num_labels=10)
    assert torch.equal(clf.vit.embeddings.cls_token, model.vit.embeddings.cls_token)
    assert torch.equal(clf.vit.encoder.layers[0].self_attn.q_proj.weight,
                       model.vit.encoder.layers[0].self_attn.q_proj.weight)
    out = clf(pixel_values=images(), labels=torch.tensor([3, 9]))
    assert out.logits.shape == (2, 10) and torch.isfinite(out.loss)


def test_remote_code_loads_in_a_fresh_process_without_the_package(tmp_path, run_without_package, tiny_model):
    x, plan = images(), plan_for("vmlm")
    expected = {}
    for name, (_, cls) in HEADS.items():
        model = tiny_model(cls, "sdpa", num_labels=3)
        model.save_pretrained(tmp_path / name)
        assert (tmp_path / name / "modeling_lookaround_vit.py").exists()
        expected[name] = head_output(model, x, plan)
    torch.save({"x": x, "group_ids": plan.group_ids, "slots": plan.target_positions(), "expected": expected},
               tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import sys, torch, transformers
        io = torch.load({str(tmp_path / "io.pt")!r})
        for name, want in io["expected"].items():
            model = getattr(transformers, name).from_pretrained(
                {str(tmp_path)!r} + "/" + name, trust_remote_code=True).eval()
            kw = dict(pixel_values=io["x"])
            if name == "AutoModelForPreTraining":
                kw.update(group_ids=io["group_ids"], target_positions=io["slots"])
            out = model(**kw)
            got = out.logits if hasattr(out, "logits") else out.last_hidden_state
            assert torch.equal(got, want), name
            assert not type(model).__module__.startswith("hf_lookaround"), type(model).__module__
        assert not any(m.startswith("hf_lookaround") for m in sys.modules)
        print("REMOTE-OK")
    """)
    result = run_without_package(script)
    assert "REMOTE-OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("problem_type,num_labels,labels", [
    ("single_label_classification", 4, torch.tensor([0, 3])),
    ("regression", 1, torch.tensor([0.5, -1.0])),
    ("multi_label_classification", 3, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])),
])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_image_classification(problem_type, num_labels, labels, pooling, tiny_model):
    model = tiny_model(LookAroundViTForImageClassification, num_labels=num_labels, problem_type=problem_type,
                 classifier_pooling=pooling)
    out = model(pixel_values=images(), labels=labels)
    assert out.logits.shape == (2, num_labels) and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.vit.embeddings.patch_embeddings.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ output flags
def head_call(model, x, plan, **flags):
    if isinstance(model, LookAroundViTForPreTraining):
        return model(pixel_values=x, group_ids=plan.group_ids, target_positions=plan.target_positions(), **flags)
    return model(pixel_values=x, **flags)


@pytest.mark.parametrize("name", HEADS)
def test_output_flags_and_return_dict_follow_transformers_kwargs(name, tiny_model, tiny_vit_config):
    """The ViT heads take transformers' output flags through **kwargs (as the text model does, issue 38): no head
    names them, yet every head returns the hidden states and attention weights of each layer, and a tuple with
    return_dict=False."""
    import inspect

    cls = HEADS[name][1]
    assert not {"output_hidden_states", "output_attentions", "return_dict"} & set(
        inspect.signature(cls.forward).parameters), f"{cls.__name__}.forward names an output flag"
    model, x, plan = tiny_model(cls, "eager", num_labels=3), images(), plan_for("gvp")
    config = tiny_vit_config()
    plain = head_call(model, x, plan)
    assert plain.hidden_states is None and plain.attentions is None
    out = head_call(model, x, plan, output_hidden_states=True, output_attentions=True)
    layers, width, rows = config.num_hidden_layers, config.sequence_length, config.sequence_length
    if cls is LookAroundViTForPreTraining:  # the query stream's rows (one per target slot) attend too
        rows += plan.target_positions().shape[1]
    assert len(out.hidden_states) == layers + 1 and len(out.attentions) == layers
    assert all(h.shape == (2, width, config.hidden_size) for h in out.hidden_states)
    assert all(a.shape == (2, config.num_attention_heads, rows, width) for a in out.attentions)
    first = plain.logits if hasattr(plain, "logits") else plain.last_hidden_state
    as_tuple = head_call(model, x, plan, return_dict=False)
    assert isinstance(as_tuple, tuple)
    # (loss, logits, ...) with a loss, (logits, ...) or (last_hidden_state, ...) without: None fields are dropped
    torch.testing.assert_close(as_tuple[1 if cls is LookAroundViTForPreTraining else 0], first, rtol=0, atol=0)


def test_the_classifier_refuses_a_plan_it_would_ignore_and_labels_out_of_range(tiny_model):
    model, plan = tiny_model(LookAroundViTForImageClassification, num_labels=3), plan_for("gvp")
    with pytest.raises(ValueError, match="LookAroundViTForImageClassification takes no group_ids"):
        model(pixel_values=images(), group_ids=plan.group_ids)
    with pytest.raises(ValueError, match=r"class labels must lie in \[0, 3\), got \[0, 3\]"):
        model(pixel_values=images(), labels=torch.tensor([0, 3]))
    assert torch.isfinite(model(pixel_values=images(), labels=torch.tensor([0, 2])).loss)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_clear_errors(tiny_model, tiny_vit_config):
    model = tiny_model(LookAroundViTForPreTraining)
    plan = plan_for("gvp")
    kw = dict(group_ids=plan.group_ids, target_positions=plan.target_positions())
    with pytest.raises(ValueError, match=r"pixel_values must have shape \(batch, 1, 28, 28\)"):
        model(pixel_values=torch.rand(2, 1, 32, 32), **kw)
    with pytest.raises(ValueError, match=r"pixel_values must have shape \(batch, 1, 28, 28\)"):
        model(pixel_values=images(channels=3), **kw)
    with pytest.raises(ValueError, match="needs group_ids and target_positions"):
        model(pixel_values=images())
    with pytest.raises(ValueError, match="group_ids must cover"):
        model(pixel_values=images(), group_ids=plan.group_ids[:, 1:], target_positions=kw["target_positions"])
    with pytest.raises(ValueError, match="cannot be a target"):
        model(pixel_values=images(), group_ids=plan.group_ids, target_positions=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="CLS token .* lowest rank"):
        model(pixel_values=images(), group_ids=torch.cat([plan.group_ids[:, :1] + 9, plan.group_ids[:, 1:]], 1),
              target_positions=kw["target_positions"])
    with pytest.raises(ValueError, match="patch_size .* must divide image_size"):
        tiny_vit_config(patch_size=5)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        tiny_vit_config(max_position_embeddings=8)
    with pytest.raises(ValueError, match="classifier_pooling"):
        tiny_vit_config(classifier_pooling="last")
    with pytest.raises(ValueError, match="image objectives"):
        make_image_collator("ar", 16)


# ------------------------------------------------------------------------------------------ evaluation
def test_reconstruction_l2_per_group_and_modes(tiny_model):
    """Group 1 is predicted from the true G0 in both modes; later groups differ once predictions are fed back.
    A perfect predictor scores 0."""
    model = tiny_model(LookAroundViTForPreTraining)
    x = images(6, seed=5)
    tf = reconstruction_l2(model, x, objective="gvp", plan_params={"num_groups": 4}, seed=1)
    gen = reconstruction_l2(model, x, objective="gvp", plan_params={"num_groups": 4}, mode="generative", seed=1)
    assert list(tf["l2_per_group"]) == ["1", "2", "3", "4"] and tf["patches_per_group"] == gen["patches_per_group"]
    same_plan = plan_for("gvp", 6, seed=1, segmentation="mixed")
    assert sum(tf["patches_per_group"].values()) == int(same_plan.is_target.sum())
    assert tf["l2_per_group"]["1"] == pytest.approx(gen["l2_per_group"]["1"], rel=1e-6)
    assert tf["l2_per_group"]["4"] != gen["l2_per_group"]["4"]
    masked = reconstruction_l2(model, x, objective="vmlm")
    assert list(masked["l2_per_group"]) == ["1"]

    class Oracle(torch.nn.Module):  # predicts the true patch: a leak on purpose, to pin the metric at 0
        def __init__(self):
            super().__init__()
            self.config, self.target_patches, self.w = model.config, model.target_patches, torch.nn.Parameter(
                torch.zeros(()))

        def forward(self, pixel_values, group_ids, target_positions):
            idx = (target_positions - 1).clamp(min=0)[..., None].expand(-1, -1, PATCH * PATCH)
            return type("Out", (), {"logits": patchify(pixel_values, PATCH).gather(1, idx)})

    assert reconstruction_l2(Oracle(), x, objective="gvp", plan_params={"num_groups": 4})["l2"] == 0.0


def test_a_few_steps_on_idx_images_lower_the_masked_patch_mse(digits_idx_dir, tiny_model):
    # scikit-learn's digits in the Fashion-MNIST file layout (tests/conftest.py)
    x, y = load_fashion_mnist(digits_idx_dir, "train", limit=512)
    assert x.shape == (512, 1, 28, 28) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert set(y.tolist()) == set(range(10))
    model = tiny_model(LookAroundViTForPreTraining, "sdpa").train()
    collator = make_image_collator("vmlm", model.config.num_patches, seed=0)
    held_out = x[-128:]

    def eval_mse():
        return reconstruction_l2(model, held_out, objective="vmlm", seed=7)["l2"]

    before = eval_mse()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(40):
        rows = torch.randint(0, 384, (32,))
        batch = collator([{"pixel_values": x[i]} for i in rows.tolist()])
        model.train()
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = eval_mse()
    assert after < 0.6 * before, (before, after)


def test_image_collator_draws_reproducible_plans_with_cls_as_condition():
    x = images(8, seed=2)
    features = [{"pixel_values": img} for img in x]
    collator = make_image_collator("vmlm", 16, seed=3)
    batch = collator(features)
    assert batch["pixel_values"].shape == (8, 1, 28, 28) and batch["group_ids"].shape == (8, 17)
    assert torch.all(batch["group_ids"][:, 0] == 0) and torch.all(batch["target_positions"] != 0)
    counts = (batch["target_positions"] >= 1).sum(-1)
    assert counts.min() >= round(0.5 * 16) and counts.max() <= round(0.75 * 16)  # images: ratio in U[0.5, 0.75]
    again = make_image_collator("vmlm", 16, seed=3)(features)
    assert all(torch.equal(batch[k], again[k]) for k in batch), "the same batch and seed give the same plan"
    collator.set_epoch(1)
    assert not torch.equal(collator(features)["group_ids"], batch["group_ids"]), "a new epoch draws a new plan"
    gvp = make_image_collator("gvp", 16, num_groups=5)(features)
    assert torch.all(gvp["group_ids"][:, 1:].amax(-1) == 6)  # G0 has rank 1, G5 rank 6


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    plan, x = plan_for("gvp"), images()
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(LookAroundViTForPreTraining).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(pixel_values=x, group_ids=plan.group_ids, target_positions=plan.target_positions()).loss.backward()
        grads.append(model.vit.embeddings.patch_embeddings.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_the_vision_command_end_to_end(tmp_path, digits_idx_dir):
    import json

    from hf_lookaround.cli.vision import main

    argv = ["--data", str(digits_idx_dir), "--output_dir", str(tmp_path), "--objective", "gvp", "--num_groups", "4",
            "--patch_size", "7", "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2",
            "--intermediate_size", "64", "--num_train", "64", "--max_steps", "2", "--batch_size", "16",
            "--num_probe_train", "100", "--num_test", "50", "--finetune_steps", "2"]
    assert main(argv) == 0
    results = json.loads((tmp_path / "vision_results.json").read_text())
    assert set(results["linear_probe"]) == {"pretrained", "random_init", "raw_pixels"}
    assert all(0.0 <= v <= 1.0 for v in results["linear_probe"].values())
    recon = results["reconstruction_l2"]
    assert list(recon["teacher_forced"]["l2_per_group"]) == ["1", "2", "3", "4"]
    assert set(recon) == {"teacher_forced", "generative", "mean_image_baseline"}
    assert set(results["finetune_test_accuracy"]) == {"pretrained", "from_scratch"}
    loaded = AutoModelForPreTraining.from_pretrained(tmp_path)
    assert isinstance(loaded, LookAroundViTForPreTraining) and loaded.config.objective == "gvp"


def test_training_step_has_no_graph_breaks(tiny_model):
    """`_can_compile_fullgraph`: the pretraining loss traces as one graph (value checks skip while compiling)."""
    model = tiny_model(LookAroundViTForPreTraining, "sdpa").train()
    plan, x = plan_for("vmlm"), images()
    slots = plan.target_positions(pad_to=12)  # a static M: ceil(0.75 * 16)

    def loss_fn(x, group_ids, slots):
        return model(pixel_values=x, group_ids=group_ids, target_positions=slots).loss

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(loss_fn)(x, plan.group_ids, slots)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
