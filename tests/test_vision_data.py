"""Images from anywhere for the vision command: datasets Image columns, image folders, scikit-learn's digits;
the saved image processor, the image-classification pipeline, and clear errors for bad input.

Every image is made in the test (tmp_path) or comes with scikit-learn; nothing is read from outside."""

import json

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

import hf_lookaround  # noqa: F401  (registers the Auto classes)
from hf_lookaround.models.lookaround.configuration_lookaround_vit import LookAroundViTConfig
from hf_lookaround.models.lookaround.image_processing_lookaround_vit import LookAroundViTImageProcessor
from hf_lookaround.models.lookaround.modeling_lookaround_vit import LookAroundViTForImageClassification
from hf_lookaround.data.images import (
    ImageSource,
    fit_image_processor,
    load_digits_images,
    load_image_splits,
    pixel_values_of,
)
from hf_lookaround.cli.vision import main

# transformers 5.17 exposes `transformers.AutoImageProcessor` only with torchvision installed; the class
# itself (which the pipelines use) works with the PIL backend
from transformers.models.auto.image_processing_auto import AutoImageProcessor  # noqa: E402

CLASSES = ("circle", "square", "stripes")


def drawing(kind: str, seed: int, size: int = 12, mode: str = "L") -> Image.Image:
    """A small picture of ``kind`` with a little noise: three classes a probe can tell apart."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    if kind == "circle":
        img = ((yy - size / 2) ** 2 + (xx - size / 2) ** 2 < (size / 3) ** 2).astype(float)
    elif kind == "square":
        img = ((abs(yy - size / 2) < size / 4) & (abs(xx - size / 2) < size / 4)).astype(float)
    else:
        img = (xx % 4 < 2).astype(float)
    img = np.clip(img * 200 + rng.integers(0, 50, img.shape), 0, 255).astype(np.uint8)
    if mode == "RGB":
        return Image.fromarray(np.stack([img, img // 2, 255 - img], -1), "RGB")
    return Image.fromarray(img, "L")


def write_image_folder(root, per_class: int = 6, splits=("train", "test"), mode="L"):
    for split in splits:
        for c, kind in enumerate(CLASSES):
            folder = root / split / kind
            folder.mkdir(parents=True)
            for i in range(per_class):
                drawing(kind, seed=1000 * c + i + (500 if split == "test" else 0), mode=mode).save(folder / f"{i}.png")
    return root


def saved_dataset(path, n: int = 12, mode: str = "L", image_col: str = "picture", label_col: str = "kind",
                  class_label: bool = True):
    kinds = [CLASSES[i % 3] for i in range(n)]
    ds = datasets.Dataset.from_dict({"id": list(range(n)), image_col: [drawing(k, i, mode=mode) for i, k in
                                                                       enumerate(kinds)], label_col: kinds})
    ds = ds.cast_column(image_col, datasets.Image())
    if class_label:
        ds = ds.cast_column(label_col, datasets.ClassLabel(names=list(CLASSES)))
    ds.save_to_disk(str(path))
    return path


# ------------------------------------------------------------------------------------------ sources
def test_an_image_folder_gives_train_and_test_with_class_names(tmp_path):
    root = write_image_folder(tmp_path / "shapes")
    train, test = load_image_splits(str(root))
    assert (len(train), len(test)) == (18, 18)
    assert train.label_names == CLASSES  # imagefolder: one class per subfolder, sorted
    assert sorted(np.bincount(train.labels).tolist()) == [6, 6, 6]
    assert train.num_channels == 1 and train.image_size == 12
    # the labels follow the folders: every "stripes" image has the stripes' id
    stripes = CLASSES.index("stripes")
    x = np.stack([np.asarray(train.images[i], dtype=float) for i in range(len(train))])
    periodic = (x[:, :, 0::4].mean((1, 2)) - x[:, :, 2::4].mean((1, 2))) > 100
    assert np.array_equal(periodic, train.labels == stripes)


def test_a_saved_dataset_with_an_image_column_is_found_by_its_features(tmp_path):
    path = saved_dataset(tmp_path / "saved", mode="RGB")
    train, test = load_image_splits(str(path), test_fraction=0.25, seed=0)
    # no test split: a seeded quarter is held out, and the note says so
    assert (len(train), len(test)) == (9, 3)
    assert any("held out" in note or "no test split" in note for note in train.notes)
    assert train.label_names == CLASSES and train.num_channels == 3
    again_train, _ = load_image_splits(str(path), test_fraction=0.25, seed=0)
    assert np.array_equal(train.labels, again_train.labels)


def test_string_labels_and_named_columns(tmp_path):
    path = saved_dataset(tmp_path / "saved", n=9, image_col="img", label_col="y", class_label=False)
    train, test = load_image_splits(str(path), image_column="img", label_column="y", test_fraction=1 / 3)
    assert train.label_names == tuple(sorted(CLASSES))  # strings become ids in sorted order
    names = [train.label_names[i] for i in train.labels]
    assert all(n in CLASSES for n in names) and len(set(names)) >= 2


def test_digits_come_from_scikit_learn_with_a_fixed_split():
    train, test = load_digits_images()
    assert (len(train), len(test)) == (1438, 359)  # 20 % of 1,797, rounded
    assert train.images.shape[1:] == (8, 8, 1) and train.images.dtype == np.uint8
    assert train.images.max() == 255 and set(np.unique(train.labels)) == set(range(10))
    again, _ = load_digits_images()
    assert np.array_equal(train.labels, again.labels)
    assert train.num_channels == 1


# ------------------------------------------------------------------------------------------ processor
def test_the_processor_normalises_with_the_training_statistics_and_reloads(tmp_path):
    train, test = load_digits_images()
    processor, pixels = fit_image_processor(train, image_size=16)
    assert pixels.shape == (1438, 1, 16, 16)
    # normalised with the train images' own mean and std
    assert abs(float(pixels.mean())) < 1e-4 and abs(float(pixels.std(unbiased=False)) - 1) < 1e-4
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["size"] == {"height": 16, "width": 16} and saved["num_channels"] == 1
    loaded = AutoImageProcessor.from_pretrained(tmp_path)
    assert isinstance(loaded, LookAroundViTImageProcessor)
    # the reloaded processor gives the training pixel_values, from arrays and from PIL images alike
    torch.testing.assert_close(pixel_values_of(train.select(0, 50), loaded), pixels[:50], atol=1e-5, rtol=0)
    pil = [Image.fromarray(train.images[i, :, :, 0], "L") for i in range(50)]
    torch.testing.assert_close(torch.as_tensor(loaded(images=pil, return_tensors="pt")["pixel_values"]),
                               pixels[:50], atol=1e-5, rtol=0)


def test_a_grey_processor_turns_rgb_into_one_channel():
    processor = LookAroundViTImageProcessor(num_channels=1, size={"height": 12, "width": 12},
                                            image_mean=[0.5], image_std=[0.25])
    rgb = drawing("circle", 0, mode="RGB")
    out = processor(images=[rgb, rgb.convert("L"), np.asarray(rgb)], return_tensors="pt")["pixel_values"]
    assert out.shape == (3, 1, 12, 12)
    torch.testing.assert_close(out[0], out[1])  # PIL's own luma conversion
    torch.testing.assert_close(out[2], out[1], atol=1 / 255 / 0.25 + 1e-6, rtol=0)  # arrays: the same weights
    colour = LookAroundViTImageProcessor(num_channels=3, size={"height": 12, "width": 12})
    grey = colour(images=rgb.convert("L"), return_tensors="pt")["pixel_values"]
    assert grey.shape == (1, 3, 12, 12) and torch.equal(grey[0, 0], grey[0, 2])


# ------------------------------------------------------------------------------------------ pipeline
def save_tiny_classifier(tmp_path):
    """An untrained 3-class classifier of 12x12 grey images and its fitted processor, both saved in tmp_path/ckpt."""
    train, _ = load_image_splits(str(write_image_folder(tmp_path / "shapes", per_class=3)))
    processor, _ = fit_image_processor(train, image_size=12)
    torch.manual_seed(0)
    config = LookAroundViTConfig(image_size=12, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64, num_labels=3,
                                 id2label=dict(enumerate(CLASSES)))
    model = LookAroundViTForImageClassification(config).eval()
    model.save_pretrained(tmp_path / "ckpt")
    processor.save_pretrained(tmp_path / "ckpt")
    return model, processor


def test_the_image_classification_pipeline_uses_the_saved_processor_and_labels(tmp_path):
    from transformers import pipeline

    model, processor = save_tiny_classifier(tmp_path)

    classifier = pipeline("image-classification", model=str(tmp_path / "ckpt"))
    image = drawing("square", 7, mode="RGB")  # the pipeline opens every image as RGB; the processor makes it grey
    result = classifier(image, top_k=3)
    assert {r["label"] for r in result} == set(CLASSES)
    with torch.inference_mode():
        x = processor(images=image, return_tensors="pt")["pixel_values"]
        probs = model(pixel_values=x).logits.softmax(-1)[0]
    expected = {CLASSES[i]: float(p) for i, p in enumerate(probs)}
    for r in result:
        assert r["score"] == pytest.approx(expected[r["label"]], abs=1e-5)


def test_the_command_trains_on_an_image_folder_and_saves_a_pipeline_ready_classifier(tmp_path):
    from transformers import pipeline

    root = write_image_folder(tmp_path / "shapes", per_class=8)
    out = tmp_path / "run"
    argv = ["--dataset", str(root), "--output_dir", str(out), "--objective", "vmlm", "--patch_size", "4",
            "--hidden_size", "32", "--num_hidden_layers", "1", "--num_attention_heads", "2", "--intermediate_size",
            "64", "--max_steps", "2", "--batch_size", "8", "--num_probe_train", "12", "--finetune_steps", "2",
            "--no_generative"]
    assert main(argv) == 0
    results = json.loads((out / "vision_results.json").read_text())
    assert results["dataset"]["image_size"] == 12 and results["dataset"]["num_channels"] == 1
    assert results["num_pretrain_images"] == 12 and results["num_test_images"] == 24
    processor = AutoImageProcessor.from_pretrained(out)  # saved next to the pretrained checkpoint
    assert processor.size == {"height": 12, "width": 12}
    assert processor.image_mean == pytest.approx(results["dataset"]["image_mean"])
    top = pipeline("image-classification", model=str(out / "classifier"))(drawing("circle", 3), top_k=1)[0]
    assert top["label"] in CLASSES


# ------------------------------------------------------------------------------------------ errors
def tiny_argv(dataset, out, *extra):
    return ["--dataset", dataset, "--output_dir", str(out), "--hidden_size", "32", "--num_hidden_layers", "1",
            "--num_attention_heads", "2", "--intermediate_size", "64", "--max_steps", "1", "--batch_size", "4",
            "--num_probe_train", "6", *extra]


def cli_error(capsys, argv) -> str:
    from hf_lookaround.cli import main as cli_main

    assert cli_main(["vision", *argv]) == 2
    return capsys.readouterr().err


def test_a_patch_size_that_does_not_divide_the_image_is_a_clear_error(tmp_path, capsys):
    root = write_image_folder(tmp_path / "shapes", per_class=3)
    err = cli_error(capsys, tiny_argv(str(root), tmp_path / "out", "--patch_size", "5"))
    assert "--patch_size 5 does not divide the image size 12" in err and "[1, 2, 3, 4, 6, 12]" in err


def test_a_distributed_launch_is_refused_before_any_image_is_read(tmp_path, capsys, monkeypatch):
    """Under accelerate launch or torchrun every rank would pretrain, probe and write the same files."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = cli_error(capsys, tiny_argv(str(tmp_path / "no-such-folder"), tmp_path / "out"))
    assert "runs in one process" in err and "WORLD_SIZE=2" in err and not (tmp_path / "out").exists()


def test_an_empty_dataset_is_a_clear_error(tmp_path, capsys):
    empty = datasets.Dataset.from_dict({"image": [], "label": []},
                                       features=datasets.Features({"image": datasets.Image(),
                                                                   "label": datasets.ClassLabel(names=["a", "b"])}))
    empty.save_to_disk(str(tmp_path / "empty"))
    assert "is empty" in cli_error(capsys, tiny_argv(str(tmp_path / "empty"), tmp_path / "out"))


def test_a_missing_image_column_is_a_clear_error(tmp_path, capsys):
    datasets.Dataset.from_dict({"text": ["a", "b", "c", "d"], "label": [0, 1, 0, 1]}).save_to_disk(
        str(tmp_path / "texts"))
    err = cli_error(capsys, tiny_argv(str(tmp_path / "texts"), tmp_path / "out"))
    assert "no image column" in err and "--image_column" in err and "'text'" in err
    path = saved_dataset(tmp_path / "saved")
    err = cli_error(capsys, tiny_argv(str(path), tmp_path / "out", "--image_column", "photo"))
    assert "'photo'" in err and "picture" in err  # names the columns there are
    unlabelled = datasets.load_from_disk(str(path)).remove_columns("kind")
    unlabelled.save_to_disk(str(tmp_path / "unlabelled"))
    assert "no label column" in cli_error(capsys, tiny_argv(str(tmp_path / "unlabelled"), tmp_path / "out"))


def test_fashion_mnist_without_its_files_and_unknown_names_are_clear_errors(tmp_path, capsys, monkeypatch):
    assert "--data" in cli_error(capsys, tiny_argv("fashion_mnist", tmp_path / "out"))
    err = cli_error(capsys, tiny_argv("fashion_mnist", tmp_path / "out", "--data", str(tmp_path)))
    assert "train-images-idx3-ubyte.gz" in err
    assert "does not exist" in cli_error(capsys, tiny_argv("./no/such/folder", tmp_path / "out"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a Hub name is tried with `datasets`, and its failure explained
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    err = cli_error(capsys, tiny_argv("no-such-owner/no-such-images", tmp_path / "out"))
    assert "could not load --dataset 'no-such-owner/no-such-images'" in err and "image folder" in err


def test_too_few_training_images_for_the_probe_is_a_clear_error(tmp_path, capsys):
    root = write_image_folder(tmp_path / "shapes", per_class=2)
    err = cli_error(capsys, tiny_argv(str(root), tmp_path / "out", "--num_probe_train", "10"))
    assert "has 6 images" in err and "--num_probe_train" in err


def test_sources_keep_their_split_names():
    source = ImageSource(np.zeros((3, 4, 4, 1), np.uint8), np.array([0, 1, 0]), ("a", "b"), "toy", "train")
    part = source.select(1, 3)
    assert len(part) == 2 and part.labels.tolist() == [1, 0] and part.split == "train"


# ------------------------------------------------------------------------------------------ probes, modes
def test_the_torch_and_warm_started_probes_solve_the_same_logistic_regression_as_scikit_learn():
    from hf_lookaround.evaluation.probing import linear_probe
    from hf_lookaround.evaluation.image_probing import torch_logistic_probe, warm_path_probe

    train, test = load_digits_images()
    x = train.images.reshape(len(train), -1).astype(np.float64) / 255
    xt = test.images.reshape(len(test), -1).astype(np.float64) / 255
    split = (x[:300], train.labels[:300], x[300:500], train.labels[300:500], xt, test.labels)
    reference = linear_probe(*split)
    for ours in (torch_logistic_probe(*split, device="cpu"), warm_path_probe(*split)):
        assert ours["C"] == reference["C"]
        assert ours["validation_accuracy"] == pytest.approx(reference["validation_accuracy"], abs=0.011)
        assert ours["test_accuracy"] == pytest.approx(reference["test_accuracy"], abs=0.011)


def test_a_codebook_oracle_scores_the_codebook_floor(tmp_path):
    """A model that predicts every true visual token reaches exactly the nearest-centroid error, with token
    accuracy 1; the class condition token shifts the patches by one position."""
    from hf_lookaround.models.lookaround.modeling_lookaround_vit import LookAroundViTForPreTraining
    from hf_lookaround.evaluation.reconstruction import reconstruction_l2
    from hf_lookaround.data.visual_tokenizer import fit_codebook

    train, _ = load_digits_images()
    _, pixels = fit_image_processor(train.select(0, 200), image_size=16)
    torch.manual_seed(0)
    config = LookAroundViTConfig(image_size=16, patch_size=4, num_channels=1, hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=64, target_mode="p2d", codebook_size=8,
                                 num_condition_tokens=1, num_condition_classes=10)
    model = LookAroundViTForPreTraining(config).eval()
    model.set_visual_codebook(fit_codebook(pixels, 4, 8, seed=0))

    class Oracle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.vit = model.config, model.vit

        def forward(self, pixel_values, group_ids, target_positions, class_labels=None):
            ids = self.vit.visual_token_ids(pixel_values)
            slots = (target_positions - config.num_prefix_tokens).clamp(min=0)
            one_hot = torch.nn.functional.one_hot(ids.gather(1, slots), 8).float()
            return type("Out", (), {"logits": 50 * one_hot})  # certain of the true token

    params = {"num_groups": 4, "segmentation": "mixed"}
    perfect = reconstruction_l2(Oracle(), pixels[:40], objective="gvp", plan_params=params)
    assert perfect["token_accuracy"] == 1.0 and perfect["l2"] == pytest.approx(perfect["codebook_l2"], rel=1e-6)
    assert perfect["expected_centroid_l2"] == pytest.approx(perfect["codebook_l2"], rel=1e-4)
    assert perfect["space"] == "per-patch normalised patches"
    untrained = reconstruction_l2(model, pixels[:40], objective="gvp", plan_params=params)
    assert untrained["codebook_l2"] == pytest.approx(perfect["codebook_l2"], rel=1e-6)  # the same plan and targets
    assert untrained["l2"] >= untrained["codebook_l2"]  # no id beats the nearest centroid
    assert list(untrained["l2_per_group"]) == ["1", "2", "3", "4"]


def test_the_class_conditional_collator_passes_classes_behind_the_prefix():
    from hf_lookaround.data.image_collator import make_image_collator

    features = [{"pixel_values": torch.zeros(1, 8, 8), "labels": torch.tensor(i % 3)} for i in range(400)]
    collator = make_image_collator("gvp", 16, seed=0, num_prefix_tokens=2, class_conditional=True,
                                   class_dropout=0.25, num_groups=4)
    batch = collator(features)
    assert batch["group_ids"].shape == (400, 18) and torch.all(batch["group_ids"][:, :2] == 0)
    assert torch.all(batch["target_positions"][batch["target_positions"] >= 0] >= 2)
    kept = batch["class_labels"] >= 0
    assert torch.equal(batch["class_labels"][kept], torch.arange(400)[kept] % 3)
    assert 0.15 < float((~kept).float().mean()) < 0.35  # about class_dropout of them carry no class
    with pytest.raises(ValueError, match="labels"):
        collator([{"pixel_values": torch.zeros(1, 8, 8)}])


@pytest.mark.parametrize("mode", ["p2d", "d2d"])
def test_the_command_fits_a_codebook_for_visual_token_modes_on_digits(tmp_path, mode):
    from transformers import AutoModelForPreTraining

    out = tmp_path / mode
    argv = ["--dataset", "digits", "--output_dir", str(out), "--objective", "gvp", "--num_groups", "4",
            "--image_size", "8", "--patch_size", "2", "--target_mode", mode, "--codebook_size", "8",
            "--codebook_images", "64", "--class_conditional", "--hidden_size", "32", "--num_hidden_layers", "1",
            "--num_attention_heads", "2", "--intermediate_size", "64", "--num_train", "128", "--num_probe_train", "100",
            "--num_test", "60", "--max_steps", "2", "--batch_size", "16", "--finetune_steps", "1", "--no_baselines",
            "--probe_backend", "sklearn_path"]
    assert main(argv) == 0
    results = json.loads((out / "vision_results.json").read_text())
    recon = results["reconstruction_l2"]["teacher_forced"]
    assert recon["l2"] >= recon["codebook_l2"] > 0 and 0 <= recon["token_accuracy"] <= 1
    assert set(results["linear_probe"]) == {"pretrained"} and results["codebook"]["codebook_size"] == 8
    loaded = AutoModelForPreTraining.from_pretrained(out)
    assert loaded.config.target_mode == mode and loaded.has_visual_codebook
    assert loaded.config.num_condition_classes == 10 and loaded.config.id2label[3] == "3"
    # the fine-tuned classifier of a class-conditional pretraining works in the pipeline (no class given: -1)
    from transformers import pipeline

    top = pipeline("image-classification", model=str(out / "classifier"))(Image.fromarray(
        np.kron(load_digits_images()[1].images[0, :, :, 0], np.ones((4, 4), np.uint8)), "L"), top_k=2)
    assert len(top) == 2 and all(r["label"] in [str(d) for d in range(10)] for r in top)
    # `hf-lookaround vision sample` dispatches to vision_generation.sample_main
    from hf_lookaround.cli import main as cli_main

    assert cli_main(["vision", "sample", "--model", str(out), "--out", str(out / "grid.png"), "--num_images", "4",
                     "--num_groups", "4"]) == 0
    with Image.open(out / "grid.png") as grid:
        assert grid.mode == "L" and grid.size[0] > 2 * 8


def test_without_the_package_the_pipeline_loads_the_processor_and_model_as_remote_code(tmp_path, run_without_package):
    """save_pretrained copies the processor's module next to the checkpoint (auto_map): a process that cannot
    import hf_lookaround still runs the pipeline with trust_remote_code and gets the same scores."""
    import textwrap

    from transformers import pipeline

    save_tiny_classifier(tmp_path)
    assert (tmp_path / "ckpt" / "image_processing_lookaround_vit.py").exists()
    image_path = tmp_path / "stripes.png"
    drawing("stripes", 5, mode="RGB").save(image_path)
    done = run_without_package(textwrap.dedent(f'''
        import json, sys
        sys.modules["hf_lookaround"] = None  # any import of the package fails
        from transformers import pipeline
        classifier = pipeline("image-classification", model={str(tmp_path / "ckpt")!r}, trust_remote_code=True)
        print(json.dumps({{"processor": type(classifier.image_processor).__module__,
                          "result": classifier({str(image_path)!r}, top_k=3)}}))
    '''))
    assert done.returncode == 0, done.stderr[-2000:]
    remote = json.loads(done.stdout.strip().splitlines()[-1])
    assert not remote["processor"].startswith("hf_lookaround")  # the copied module, loaded as remote code
    local = pipeline("image-classification", model=str(tmp_path / "ckpt"))(str(image_path), top_k=3)
    assert [r["label"] for r in remote["result"]] == [r["label"] for r in local]
    assert [r["score"] for r in remote["result"]] == pytest.approx([r["score"] for r in local], abs=1e-5)


def test_the_plan_flags_are_the_image_objectives_params(tmp_path, capsys):
    """The vision command's plan flags are built from each image objective's Params, with its image defaults, so an
    image objective brings its flags; Params checks them before any data is read."""
    from hf_lookaround import objectives
    from hf_lookaround.cli.vision import _parser

    parser = _parser()
    args = parser.parse_args(["--output_dir", str(tmp_path)])
    for name in objectives.names(images=True):
        entry = objectives.get(name)
        for flag, default in entry.image_defaults.items():
            assert getattr(args, flag) == default, (name, flag)
            action = next(a for a in parser._actions if a.dest == flag)
            assert action.help.startswith(entry.Params.__dataclass_fields__[flag].metadata["help"])
    assert parser.parse_args(["--output_dir", "x", "--mask_ratio_range", "0.2", "0.4"]).mask_ratio_range == [0.2, 0.4]
    err = cli_error(capsys, tiny_argv("digits", tmp_path / "out", "--segmentation", "spiral"))
    assert err.strip().splitlines() == ["hf-lookaround vision: error: --segmentation must be one of ('fixed', 'random', "
                                        "'mixed'), got 'spiral'"]
