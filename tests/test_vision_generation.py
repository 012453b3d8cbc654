"""Group-by-group image generation (GVP plan at inference), tested from the outside: given patches are kept,
the hidden truth is never read, seeds reproduce, one group equals one forward of the plan, the sample command."""

import numpy as np
import pytest
import torch
from PIL import Image

from hf_lookaround.models.lookaround.configuration_lookaround_vit import LookAroundViTConfig
from hf_lookaround.models.lookaround.modeling_lookaround_vit import LookAroundViTForPreTraining, LookAroundViTModel, patchify
from hf_lookaround.decoding.images import inference_ranks, sample_images, to_display_pixels
from hf_lookaround.cli.vision import sample_main
from test_vit_modes import PATCH, SIDE, images, make, visual_tokenizer  # make: the ViT-mode tests' tiny model fixture

N_PATCHES = (SIDE // PATCH) ** 2


def visible_mask(n, seed=0, count=6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, N_PATCHES, dtype=torch.bool)
    for b in range(n):
        mask[b, torch.randperm(N_PATCHES, generator=g)[:count]] = True
    return mask


CASES = [("p2p", {}), ("p2d", {}), ("d2d", {}), ("p2d", {"num_condition_tokens": 2, "num_condition_classes": 3})]


@pytest.mark.parametrize("mode,cond", CASES, ids=["p2p", "p2d", "d2d", "p2d-class"])
def test_given_patches_are_kept_and_the_hidden_truth_is_never_read(mode, cond, make):
    model = make(target_mode=mode, **cond)
    x, mask = images(3, seed=1), visible_mask(3)
    labels = torch.tensor([0, 1, 2]) if cond else None
    out = sample_images(model, class_labels=labels, visible_pixels=x, visible_mask=mask, num_groups=4, generator=0)
    assert out.shape == x.shape
    given, got = patchify(x, PATCH), patchify(out, PATCH)
    assert torch.equal(got[mask], given[mask]), "a given patch changed"
    assert not torch.equal(got[~mask], given[~mask])
    # other pixels where the patches are hidden: the generation must not notice
    noise = torch.where(mask.repeat_interleave(PATCH, 1).reshape(3, SIDE // PATCH, PATCH, SIDE // PATCH)
                        .any(2).repeat_interleave(PATCH, 1).repeat_interleave(PATCH, 2)[:, None], x, torch.rand_like(x))
    assert torch.equal(patchify(noise, PATCH)[mask], given[mask]) and not torch.equal(noise, x)
    again = sample_images(model, class_labels=labels, visible_pixels=noise, visible_mask=mask, num_groups=4,
                          generator=0)
    assert torch.equal(again, out), "the generated patches depend on the hidden pixels"


@pytest.mark.parametrize("mode", ["p2p", "p2d", "d2d"])
def test_a_seed_reproduces_the_images_and_another_seed_changes_them(mode, make):
    model = make(target_mode=mode)
    first = sample_images(model, num_images=3, num_groups=4, generator=torch.Generator().manual_seed(3))
    assert first.shape == (3, 1, SIDE, SIDE) and torch.isfinite(first).all()
    assert torch.equal(sample_images(model, num_images=3, num_groups=4, generator=3), first)
    assert not torch.equal(sample_images(model, num_images=3, num_groups=4, generator=4), first)
    # the batch size is a detail of computation, not of the result (up to float rounding of the batch's kernels)
    torch.testing.assert_close(sample_images(model, num_images=3, num_groups=4, generator=3, batch_size=2), first,
                               rtol=1e-4, atol=1e-5)


def test_one_group_is_one_forward_of_the_inference_plan(make):
    """K=1: every hidden patch is predicted at once from the prefix and the visible patches (rank 1 < rank 2)."""
    x, mask = images(2, seed=5), visible_mask(2, seed=5, count=7)
    prefix = 1
    group_ids = torch.cat([torch.zeros(2, prefix, dtype=torch.long), torch.where(mask, 1, 2)], 1)
    slots = torch.stack([(~m).nonzero().flatten() + prefix for m in mask])
    p2p = make(target_mode="p2p")
    want = p2p(pixel_values=x, group_ids=group_ids, target_positions=slots).logits
    got = sample_images(p2p, visible_pixels=x, visible_mask=mask, num_groups=1, generator=0)
    torch.testing.assert_close(patchify(got, PATCH)[~mask].reshape(want.shape), want, rtol=1e-5, atol=1e-6)
    p2d = make(target_mode="p2d")
    logits = p2d(pixel_values=x, group_ids=group_ids, target_positions=slots).logits
    want = visual_tokenizer()[1][logits.argmax(-1)]  # the pixel decoder's patch of the most likely token
    got = sample_images(p2d, visible_pixels=x, visible_mask=mask, num_groups=1, generator=0, temperature=0)
    assert torch.equal(patchify(got, PATCH)[~mask].reshape(want.shape), want)


def test_the_class_label_steers_the_samples(make):
    model = make(target_mode="p2d", num_condition_tokens=1, num_condition_classes=3)
    a = sample_images(model, num_images=2, class_labels=0, num_groups=4, generator=0, temperature=0)
    b = sample_images(model, num_images=2, class_labels=1, num_groups=4, generator=0, temperature=0)
    assert not torch.equal(a, b)


def test_inference_ranks_split_the_hidden_patches_into_equal_groups_in_a_random_order():
    mask = visible_mask(4, seed=2, count=5)
    ranks = inference_ranks(mask, 4, torch.Generator().manual_seed(0))
    assert torch.all(ranks[mask] == 1)
    for row, m in zip(ranks, mask):
        sizes = torch.bincount(row[~m] - 2, minlength=4)
        assert sizes.tolist() == [3, 3, 3, 2]  # 11 hidden patches in 4 groups
    assert torch.equal(inference_ranks(mask, 4, torch.Generator().manual_seed(0)), ranks)
    assert not torch.equal(inference_ranks(mask, 4, torch.Generator().manual_seed(1)), ranks)
    assert not torch.equal(ranks[0], ranks[1])  # each image draws its own order


def test_bad_generation_requests_raise_clear_errors(make):
    model = make(target_mode="p2d")
    x, mask = images(2), visible_mask(2, count=10)
    with pytest.raises(ValueError, match=r"num_groups=7 is larger than the number of patches to generate \(6"):
        sample_images(model, visible_pixels=x, visible_mask=mask, num_groups=7)
    with pytest.raises(ValueError, match="num_groups=17 is larger"):
        sample_images(model, num_images=1, num_groups=17)
    with pytest.raises(ValueError, match=r"visible_pixels must have shape \(num_images, 1, 28, 28\)"):
        sample_images(model, visible_pixels=torch.rand(2, 1, 30, 30), visible_mask=mask, num_groups=2)
    with pytest.raises(ValueError, match=r"visible_mask must have shape \(16,\) or \(2, 16\)"):
        sample_images(model, visible_pixels=x, visible_mask=mask[:, :15], num_groups=2)
    with pytest.raises(ValueError, match="visible_mask must be boolean"):
        sample_images(model, visible_pixels=x, visible_mask=mask.long(), num_groups=2)
    with pytest.raises(ValueError, match="pass visible_pixels and visible_mask together"):
        sample_images(model, visible_pixels=x, num_groups=2)
    with pytest.raises(ValueError, match="num_images=3 but visible_pixels holds 2"):
        sample_images(model, num_images=3, visible_pixels=x, visible_mask=mask, num_groups=2)
    with pytest.raises(ValueError, match="temperature"):
        sample_images(model, num_images=1, num_groups=2, temperature=-1)
    with pytest.raises(ValueError, match="pass class_labels"):
        sample_images(make(target_mode="p2d", num_condition_tokens=1, num_condition_classes=2), num_images=1,
                      num_groups=2)
    with pytest.raises(ValueError, match="norm_pix_loss"):
        sample_images(make(target_mode="p2p", norm_pix_loss=True), num_images=1, num_groups=2)
    no_decoder = make(target_mode="d2d", codebook=False)
    no_decoder.set_visual_codebook(visual_tokenizer()[0])
    with pytest.raises(ValueError, match="no pixel decoder"):
        sample_images(no_decoder, num_images=1, num_groups=2)
    with pytest.raises(ValueError, match="needs a LookAroundViTForPreTraining"):
        sample_images(make(LookAroundViTModel, target_mode="p2p"), num_images=1, num_groups=2)
    with pytest.raises(ValueError, match=r"patch_size \(6\) must divide image_size \(28\)"):
        LookAroundViTConfig(image_size=28, patch_size=6)


def test_the_sample_command_writes_a_reproducible_png_grid(tmp_path, make):
    model = make(impl="sdpa", target_mode="d2d", num_condition_tokens=1, num_condition_classes=3)
    with torch.no_grad():  # an untrained model's tokens are near uniform: sharpen them, to see --class_label work
        model.decoder.weight.mul_(100)
    model.save_pretrained(tmp_path / "ckpt")
    argv = ["--model", str(tmp_path / "ckpt"), "--num_images", "5", "--num_groups", "4", "--seed", "0"]
    assert sample_main(argv + ["--out", str(tmp_path / "a.png")]) == 0
    assert sample_main(argv + ["--out", str(tmp_path / "b.png")]) == 0
    assert sample_main(argv + ["--class_label", "2", "--out", str(tmp_path / "c.png")]) == 0
    grid = Image.open(tmp_path / "a.png")
    assert grid.mode == "L" and grid.size == (3 * (SIDE + 2) + 2, 2 * (SIDE + 2) + 2)  # 3 columns, 2 rows
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "c.png").read_bytes()
    # the grid holds the images sample_images draws for the same seed (classes i mod 3), at 8 bits
    want = sample_images(LookAroundViTForPreTraining.from_pretrained(tmp_path / "ckpt"), num_images=5,
                         class_labels=torch.arange(5) % 3, num_groups=4, generator=torch.Generator().manual_seed(0))
    pixels = torch.from_numpy(np.array(grid)).float() / 255
    first = pixels[2: 2 + SIDE, 2: 2 + SIDE]
    assert (first - want[0, 0].clamp(0, 1)).abs().max() <= 1 / 255 + 1e-6


def test_the_sample_command_undoes_the_image_processors_normalisation(tmp_path, make):
    from hf_lookaround.models.lookaround.image_processing_lookaround_vit import LookAroundViTImageProcessor

    model = make(impl="sdpa", target_mode="p2p")
    model.save_pretrained(tmp_path / "ckpt")
    generated = torch.randn(2, 1, SIDE, SIDE)
    assert torch.equal(to_display_pixels(generated, tmp_path / "ckpt"), generated)  # no processor: as they are
    LookAroundViTImageProcessor(num_channels=1, image_mean=[0.3], image_std=[0.4]).save_pretrained(tmp_path / "ckpt")
    torch.testing.assert_close(to_display_pixels(generated, tmp_path / "ckpt"), generated * 0.4 + 0.3)
    assert sample_main(["--model", str(tmp_path / "ckpt"), "--num_images", "1", "--num_groups", "2",
                        "--out", str(tmp_path / "g.png")]) == 0
    want = to_display_pixels(sample_images(LookAroundViTForPreTraining.from_pretrained(tmp_path / "ckpt"),
                                           num_images=1, num_groups=2, generator=torch.Generator().manual_seed(0)),
                             tmp_path / "ckpt")
    pixels = torch.from_numpy(np.array(Image.open(tmp_path / "g.png"))).float() / 255
    assert (pixels[2: 2 + SIDE, 2: 2 + SIDE] - want[0, 0].clamp(0, 1)).abs().max() <= 1 / 255 + 1e-6
