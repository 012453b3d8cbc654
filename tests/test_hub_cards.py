"""Model cards, result collection and remote-code checks of hf_lookaround.hub (no server, no model forward)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from hf_lookaround.hub import cards, remote_code
from hf_lookaround.hub.results import collect_results
from hf_lookaround.models.lookaround.configuration_lookaround import LookAroundConfig

MODEL_CARDS = Path(__file__).resolve().parents[1] / "model_cards"


def make_checkpoint(folder: Path, **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    LookAroundConfig.from_preset("tiny", vocab_size=100, **config).to_json_file(folder / "config.json")
    return folder


def test_collect_results_reads_every_file_and_tolerates_gaps(tmp_path):
    assert collect_results(tmp_path) == []
    (tmp_path / "all_results.json").write_text(json.dumps(
        {"eval_loss": 2.5, "eval_ar_perplexity": 12.25, "eval_runtime": 3.0, "epoch": 1.0, "train_loss": 3.0,
         "eval_accuracy": None}))
    (tmp_path / "probe_results.json").write_text(json.dumps(
        [{"task": "trec", "dataset": "trec", "metric": "accuracy", "test_accuracy": 0.75}, {"task": "sst2"}]))
    (tmp_path / "perplexity.json").write_text(json.dumps({"dataset": "brown", "bits_per_byte": 1.5}))
    results = collect_results(tmp_path, dataset="sotu")
    got = sorted((r.dataset_name, r.metric_type, r.metric_value, r.dataset_split) for r in results)
    assert got == [("brown", "bits_per_byte", 1.5, "test"), ("sotu", "loss", 2.5, "validation"),
                   ("sotu", "perplexity", 12.25, "validation"), ("trec", "accuracy", 0.75, "test")]
    (tmp_path / "perplexity.json").write_text("{not json")
    assert len(collect_results(tmp_path)) == 3  # a malformed file is skipped, not fatal


def test_masked_card_from_config_with_results(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", objective="vmlm", plan_params={})
    (folder / "perplexity.json").write_text(json.dumps(
        {"dataset": "sotu", "ar_perplexity": None, "masked_perplexity": 31.5, "bits_per_byte": 1.25}))
    path = cards.write_model_card(folder, dataset="sotu", dataset_description="State of the Union addresses.")
    card = ModelCard.load(path)
    assert card.data.pipeline_tag == "fill-mask" and card.data.library_name == "transformers"
    assert {"vmlm", "masked", "custom_code"} <= set(card.data.tags)
    assert sorted((r.metric_name, r.metric_value) for r in card.data.eval_results) == [
        ("bits per byte", 1.25), ("masked-prefix perplexity p(x_k | x_<k)", 31.5)]
    assert card.data.eval_results[0].task_type == "fill-mask"
    text = card.text
    assert "variable-length masked" in text and "| `mask_ratio_range` | `(0.15, 0.3)` | default |" in text
    assert "State of the Union addresses." in text and "Zhang, Qi and Du, Tianqi" in text
    # before a push the load snippets name the checkpoint's folder, which loads it (a push puts the repo id there)
    assert f'AutoModelForMaskedLM.from_pretrained("{folder}", trust_remote_code=True)' in text
    assert r"p(x_k \| x_<k)" in text  # escaped inside the results table
    # the arguments are kept in the metadata, so `push` can re-render the card with the repo id
    assert card.data.to_dict()["hf_lookaround"]["objective"] == "vmlm"


def test_family_and_template_choice(tmp_path):
    two_stream = cards.build_model_card(make_checkpoint(tmp_path / "a", objective="gvp",
                                                      plan_params={"num_groups": 4}), model_id="me/gvp")
    assert two_stream.data.pipeline_tag == "text-generation"
    assert "| `num_groups` | `4` |  |" in two_stream.text and "| `segmentation` | `mixed` | default |" in two_stream.text
    assert "num_condition_tokens=1, num_groups=4)" in two_stream.text
    assert two_stream.data.model_name is None  # no results, no model-index

    config = {"model_type": "lookaround", "patch_size": 16, "objective": "gvp"}
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "config.json").write_text(json.dumps(config))
    vision = cards.build_model_card(tmp_path / "v")
    assert "a two-stream ViT on the LookAround" in vision.text
    with pytest.raises(ValueError, match="unknown objective 'bert'"):
        cards.build_model_card(tmp_path / "v", objective="bert")
    with pytest.raises(ValueError, match="save the checkpoint"):
        cards.write_model_card(tmp_path / "missing")


def test_ensure_remote_code_adds_modules_and_completes_auto_map(tmp_path):
    folder = make_checkpoint(tmp_path / "bare")
    original = tmp_path / "original_config.json"
    original.write_text((folder / "config.json").read_text())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(original)  # as in push's staging folder

    written = remote_code.ensure_remote_code(folder)
    assert {"configuration_lookaround.py", "modeling_lookaround.py", "config.json"} <= set(written)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_lookaround.LookAroundConfig"
    assert auto_map["AutoModelForCausalLM"] == "modeling_lookaround.LookAroundForCausalLM"
    assert set(auto_map) == {"AutoConfig", *(auto for auto, _ in remote_code.HEADS.values())}
    assert "auto_map" not in json.loads(original.read_text()), "wrote through the symlink"
    assert remote_code.ensure_remote_code(folder) == []  # complete: nothing to do


@pytest.mark.parametrize("line, problem", [
    ("from hf_lookaround.plans import make_plan", "line 1 imports hf_lookaround"),
    ("from . import masks", "not followed by transformers"),
    ("from .masks import build_mask", "masks.py is missing"),
])
def test_remote_code_must_be_self_contained(tmp_path, monkeypatch, line, problem):
    package = tmp_path / "package"
    package.mkdir()
    for source in remote_code._package_module_files():
        (package / source.name).write_text(source.read_text())
    bad = package / "modeling_lookaround.py"
    bad.write_text(line + "\n" + bad.read_text())

    # a checkpoint whose own copy is broken gets the package's modules instead
    folder = make_checkpoint(tmp_path / "c")
    remote_code.ensure_remote_code(folder)
    (folder / "modeling_lookaround.py").write_text(bad.read_text())
    remote_code.ensure_remote_code(folder)
    assert line not in (folder / "modeling_lookaround.py").read_text()

    # if the package's own modules are not self-contained, push refuses and says why
    monkeypatch.setattr(remote_code, "_package_module_files", lambda model_module="modeling_lookaround": sorted(package.iterdir()))
    (folder / "modeling_lookaround.py").unlink()
    with pytest.raises(ValueError, match=problem):
        remote_code.ensure_remote_code(folder)


def test_ensure_remote_code_refuses_other_models(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not a LookAround checkpoint"):
        remote_code.ensure_remote_code(tmp_path)


def test_example_cards_are_valid():
    names = sorted(p.name for p in MODEL_CARDS.glob("*.md") if p.name != "README.md")
    assert names == ["masked.md", "two_stream.md", "vision.md"]
    for name in names:
        card = ModelCard.load(MODEL_CARDS / name)
        assert "hf_lookaround" in card.data.tags and card.data.library_name == "transformers"
    assert ModelCard.load(MODEL_CARDS / "two_stream.md").data.eval_results
