"""The model cards of real checkpoints and `push` (hub/cards.py, hub/push.py) tell the truth (issue 23, item 14): no
placeholder repo id, no license or language nobody chose, results named with the data they were measured on, a card
for GLUE outputs, a dry run of `push`, and no push of files that only link out of the checkpoint folder."""

import json
import os

import pytest
import torch
from huggingface_hub import ModelCard

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, cli
from hf_lookaround.hub import cards, remote_code
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
    """The card of a `glue` (LoRA) run describes the fine-tune (issue 43): its base model by Hub id or "local",
    the classification accuracy and loss filed as the fine-tune's, on validation and test data."""
    out = tmp_path / "glue"
    data = FIXTURES / "reviews"
    assert cli.main(["glue", "--model_name_or_path", str(checkpoint), "--train_file", str(data / "train.jsonl"),
                     "--validation_file", str(data / "validation.jsonl"), "--test_file", str(data / "test.jsonl"),
                     "--max_train_samples", "16", "--max_eval_samples", "16", "--max_predict_samples", "16",
                     "--max_seq_length", "32", "--max_steps", "1", "--do_train", "--do_eval", "--do_predict",
                     "--use_lora", "--report_to", "none", "--save_strategy", "no", "--use_cpu",
                     "--output_dir", str(out)]) == 0
    card = ModelCard.load(out / "README.md")
    assert card.data.pipeline_tag == "text-classification"
    # a local base model is no Hub link: named "local", never by its path
    assert card.data.base_model is None and str(checkpoint) not in str(card)
    text = " ".join(card.text.split())
    assert "from the base model a local checkpoint (not on the Hub)" in text
    assert card.data.to_dict()["hf_lookaround"]["base_model"] == "local"
    assert "fine-tuned with LoRA (r=8, alpha=16)" in text and "pretrained with the **diversity-enhanced" in text
    assert "A LookAround **text classifier**" in text and "classifier" in card.data.tags
    measured = json.loads((out / "all_results.json").read_text())
    got = {(r.task_name, r.dataset_split, r.metric_name): r.metric_value for r in card.data.eval_results}
    assert got == {
        ("Fine-tuning (text classification)", "validation", "validation accuracy"): measured["eval_accuracy"],
        ("Fine-tuning (text classification)", "validation", "classification loss (cross-entropy)"):
            measured["eval_loss"],
        ("Fine-tuning (text classification)", "test", "test accuracy"): measured["predict_accuracy"],
        ("Fine-tuning (text classification)", "test", "classification loss (cross-entropy)"):
            measured["predict_loss"],
    }
    assert "Pretraining data" not in card.text and "pretraining objective" not in str(card.data.eval_results)
    # named, never by a path of this machine (issue 30, section 4 item 5)
    assert {(r.dataset_split, r.dataset_name) for r in card.data.eval_results} == {
        ("validation", "reviews/validation.jsonl (local)"), ("test", "reviews/test.jsonl (local)")}
    assert "read from `all_results.json` next to the checkpoint" in text


def test_a_hub_base_model_is_named_by_its_id(checkpoint, tmp_path, monkeypatch):
    card = ModelCard.load(cards.write_model_card(checkpoint, base_model="me/dar-tiny", fine_tune={"task": "sst2"}))
    assert card.data.base_model == "me/dar-tiny" and "[`me/dar-tiny`](https://huggingface.co/me/dar-tiny)" in card.text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "ar800").mkdir(parents=True)  # a relative folder that looks like a Hub id
    assert cards.public_model_id("runs/ar800") == "local" and cards.public_model_id(str(checkpoint)) == "local"
    assert cards.public_model_id("gpt2") == "gpt2"


# the four text forms: pretrain's flags, the card's words for it, its form tag, what its card says of decoding
FORMS = {
    "two-stream dar": (["--objective", "dar", "--group_size", "2"], "two-stream text model", "two-stream",
                       "decode through it"),
    "one-stream dar": (["--objective", "dar", "--dar_form", "single_stream", "--group_size", "2"],
                       "one-stream semi-autoregressive text model (SAT, block-causal, t = 2)", "one-stream",
                       "`generate()` decodes 2 tokens per forward"),
    "one-stream mixture": (["--objective", "mixture", "--mixture", "dar=0.5", "vmlm=0.5", "--group_size", "2",
                            "--dar_form", "single_stream", "--masked_form", "single_stream"],
                           "one-stream mixture text model", "one-stream",
                           "`generate()` decodes 2 tokens per forward"),
    "masked one-stream": (["--objective", "vmlm", "--masked_form", "single_stream"],
                          "one-stream masked text model", "one-stream", "read its bidirectional content stream"),
}


@pytest.mark.parametrize("form", FORMS)
def test_the_card_pretrain_writes_says_what_the_checkpoint_is_with_its_results(form, make_args, tmp_path):
    """Issue 43: each form is named as what it is (a one-stream checkpoint is no "two-stream text model"), and the
    README.md written at the end lists the end-of-run scores of all_results.json, naming only files that exist."""
    from hf_lookaround.training import checkpointing

    flags, name, tag, decoding = FORMS[form]
    out = tmp_path / "run"
    assert cli.main(["pretrain", *make_args(out, "--do_eval", "--perplexity_max_tokens", "64", *flags,
                                            max_steps=1)]) == 0
    card = ModelCard.load(out / "README.md")
    text = " ".join(card.text.split())
    assert f"A LookAround **{name}" in text and decoding in text
    assert tag in card.data.tags and ({"one-stream", "two-stream"} - {tag}).isdisjoint(card.data.tags)
    assert card.data.to_dict()["hf_lookaround"]["family"] != "two-stream"
    if tag == "one-stream":
        assert "two-stream text model" not in text and "two-stream masked" not in text
    measured = json.loads((out / "all_results.json").read_text())
    got = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert got["held-out loss of the pretraining objective"] == measured["eval_loss"]
    assert got["bits per byte"] == measured["eval_bits_per_byte"]
    assert "No evaluation results" not in text and "read from `all_results.json` next to the checkpoint" in text
    assert "probe_results.json" not in text.split("## Results")[1].split("## How to load")[0]
    assert checkpointing.final_model_problems(out) == []  # the card rewritten after the marker breaks nothing


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


def _python_blocks(text: str) -> list[str]:
    return [block.split("```")[0] for block in text.split("```python\n")[1:]]


@pytest.mark.parametrize("kind", ["bd3lm-one-stream", "mdlm-two-stream", "vmlm"])
def test_a_masked_cards_snippets_run_without_the_package(kind, tmp_path, run_without_package):
    """A diffusion checkpoint's card shows how to decode it (`AutoModelForCausalLM(...).generate(diffusion_threshold=
    ...)`); BD3-LM's one-stream form reads x_t ⊕ x_0 only, so its card drops the fill-mask snippet (its forward on
    `[MASK]` inputs is refused) and its widget tag is text-generation. Every snippet the card shows runs, as remote
    code, in a process without the package."""
    from hf_lookaround import LookAroundForMaskedLM
    from hf_lookaround.data.tokenization import train_tokenizer
    from hf_lookaround.objectives import bd3lm, mdlm

    lines = [json.loads(line)["sentence"] for line in open(FIXTURES / "reviews" / "train.jsonl")]
    tok = train_tokenizer(lines, vocab_size=300, min_frequency=1)
    fields = {"bd3lm-one-stream": dict(objective="bd3lm", plan_params={"diffusion_block": 4}, prediction_stream="content",
                                       **bd3lm.Params(diffusion_block=4, masked_form="single_stream").config_fields()),
              "mdlm-two-stream": dict(objective="mdlm", **mdlm.Params().config_fields()),
              "vmlm": dict(objective="vmlm", default_attention="bidirectional")}[kind]
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset("tiny", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id, **fields)
    folder = tmp_path / "ckpt"
    # the heads pretraining saves: the one-stream form's masked LM, the two-stream pretraining model
    (LookAroundForMaskedLM if kind == "bd3lm-one-stream" else LookAroundForPreTraining)(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    remote_code.ensure_remote_code(folder)  # what pretraining and push write: every Auto class as remote code
    card = cards.build_model_card(folder)
    blocks = [b for b in _python_blocks(card.text) if "trust_remote_code=True" in b]
    fill_mask = ["fill" for b in blocks if "AutoModelForMaskedLM" in b]
    decode = ["decode" for b in blocks if "diffusion_threshold" in b]
    assert fill_mask + decode == {"bd3lm-one-stream": ["decode"], "mdlm-two-stream": ["fill", "decode"],
                                  "vmlm": ["fill"]}[kind]
    assert card.data.pipeline_tag == ("text-generation" if kind == "bd3lm-one-stream" else "fill-mask")
    for block in blocks:
        done = run_without_package(block + "\nimport sys\nassert not any(m.startswith('hf_lookaround') for m in "
                                            "sys.modules)\nprint('RAN')\n")
        assert "RAN" in done.stdout, (block, done.stderr[-3000:])
