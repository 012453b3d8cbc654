"""The model cards of real checkpoints and `push` (hub/cards.py, hub/push.py) tell the truth (issue 23, item 14): no
placeholder repo id, no license or language nobody chose, results named with the data they were measured on, a card
for GLUE outputs, a dry run of `push`, and no push of files that only link out of the checkpoint folder."""

import json
import os

import pytest
import torch
from huggingface_hub import ModelCard

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, cli
from hf_lookaround.hub import cards
from hf_lookaround.training.pretraining import DataArguments, eval_data_name

FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def checkpoint(tmp_path):
    from hf_lookaround.data.tokenization import train_tokenizer

    lines = [json.loads(line)["sentence"] for line in open(FIXTURES / "reviews" / "train.jsonl")]
    tok = train_tokenizer(lines, vocab_size=300, min_frequency=1)
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset("tiny", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id, objective="dar", plan_params={"t": 2})
    folder = tmp_path / "ckpt"
    LookAroundForPreTraining(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_a_local_card_names_its_folder_and_claims_no_license_or_language(checkpoint):
    card = ModelCard.load(cards.write_model_card(checkpoint, dataset="corpus.jsonl"))
    assert "<namespace>" not in card.text and f'from_pretrained("{checkpoint}"' in card.text
    data = card.data.to_dict()
    assert "license" not in data and "language" not in data
    card = ModelCard.load(cards.write_model_card(checkpoint, license="mit", language=["fr"]))
    assert card.data.license == "mit" and card.data.language == ["fr"]


def test_eval_results_name_the_validation_data_not_the_training_file(checkpoint):
    (checkpoint / "all_results.json").write_text(json.dumps({"eval_loss": 2.0, "eval_ar_perplexity": 7.5}))
    held_out = eval_data_name(DataArguments(train_files=["train.jsonl"], validation_split_percentage=5))
    assert "train.jsonl" in held_out and "held out" in held_out
    assert eval_data_name(DataArguments(train_files=["train.jsonl"], validation_files=["val.jsonl"])) == "val.jsonl"
    card = ModelCard.load(cards.write_model_card(checkpoint, dataset="train.jsonl", eval_dataset="val.jsonl"))
    assert {r.dataset_name for r in card.data.eval_results} == {"val.jsonl"}
    assert card.data.to_dict()["hf_lookaround"]["eval_dataset"] == "val.jsonl"  # kept for a push's re-render


def test_glue_output_has_a_text_classification_card(checkpoint, tmp_path):
    out = tmp_path / "glue"
    data = FIXTURES / "reviews"
    assert cli.main(["glue", "--model_name_or_path", str(checkpoint), "--train_file", str(data / "train.jsonl"),
                     "--validation_file", str(data / "validation.jsonl"), "--max_train_samples", "16",
                     "--max_eval_samples", "16", "--max_seq_length", "32", "--max_steps", "1", "--do_train",
                     "--do_eval", "--report_to", "none", "--save_strategy", "no", "--use_cpu",
                     "--output_dir", str(out)]) == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-classification" and card.data.base_model == str(checkpoint)
    # named, never by a path of this machine (issue 30, section 4 item 5)
    assert any(r.dataset_name == "reviews/validation.jsonl (local)" for r in card.data.eval_results)


def test_push_dry_run_previews_without_a_hub(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    preview = tmp_path / "preview"
    assert cli.main(["push", str(checkpoint), "me/dar-tiny", "--dry-run", str(preview), "--license", "mit"]) == 0
    out = capsys.readouterr().out
    assert "nothing sent" in out and "README.md" in out and "model.safetensors" in out
    card = ModelCard.load(preview / "README.md")
    assert 'from_pretrained("me/dar-tiny"' in card.text and card.data.license == "mit"
    assert not (checkpoint / "README.md").exists()  # the checkpoint is not modified


def test_push_refuses_a_link_out_of_the_checkpoint(checkpoint, tmp_path, capsys):
    secret = tmp_path / "elsewhere.json"
    secret.write_text("{}")
    os.symlink(secret, checkpoint / "extra.json")
    assert cli.main(["push", str(checkpoint), "me/dar-tiny", "--dry-run", str(tmp_path / "preview")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hf-lookaround push")]
    assert len(err) == 1 and "extra.json" in err[0] and "symbolic link" in err[0], err
