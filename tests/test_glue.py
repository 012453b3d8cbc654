"""GLUE harness: the offline metric module, LoRA target discovery and reload, run_glue end to end, errors."""

import json
import os
from pathlib import Path

import evaluate
import numpy as np
import pytest
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, LookAroundForSequenceClassification
from hf_lookaround.evaluation.glue import (
    find_lora_target_modules,
    glue_metric_path,
    head_module_names,
    load_glue_metric,
)
from hf_lookaround.cli.glue import main
from hf_lookaround.data.tokenization import train_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # reviews (binary, label names), review_scores (regression)
BBC_TOPICS = ["business", "entertainment", "politics", "sports", "tech"]


# ---------------------------------------------------------------------------------------------
# metric module
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli", "accuracy", "regression"])
def test_metric_matches_sklearn_and_scipy(task):
    rng = np.random.default_rng(hash(task) % 2**32)
    metric = load_glue_metric(task)
    if task in ("stsb", "regression"):
        refs = rng.uniform(0, 5, 200)
        preds = refs + rng.normal(0, 1.5, 200)
        out = metric.compute(predictions=preds, references=refs)
        assert out["pearson"] == pytest.approx(pearsonr(preds, refs)[0], abs=1e-6)
        assert out["spearmanr"] == pytest.approx(spearmanr(preds, refs)[0], abs=1e-6)
        if task == "regression":
            assert out["mse"] == pytest.approx(np.mean((preds.astype(np.float32) - refs.astype(np.float32)) ** 2), rel=1e-5)
        return
    classes = 3 if task == "mnli" else 2
    refs, preds = rng.integers(0, classes, 300), rng.integers(0, classes, 300)
    out = metric.compute(predictions=preds, references=refs)
    if task == "cola":
        assert out == {"matthews_correlation": pytest.approx(matthews_corrcoef(refs, preds))}
    elif task in ("mrpc", "qqp"):
        assert out == {"accuracy": pytest.approx(accuracy_score(refs, preds)), "f1": pytest.approx(f1_score(refs, preds))}
    else:
        assert out == {"accuracy": pytest.approx(accuracy_score(refs, preds))}


def test_metric_loads_with_no_network(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)  # any attempt to reach the Hub fails loudly
    monkeypatch.setattr(socket, "create_connection", refuse)
    for path in (glue_metric_path(), os.path.join(glue_metric_path(), "glue_lookaround.py")):
        out = evaluate.load(path, "mrpc").compute(predictions=[1, 0, 1, 1], references=[1, 0, 0, 1])
        assert out == {"accuracy": 0.75, "f1": pytest.approx(0.8)}
    with pytest.raises(KeyError, match="unknown configuration"):
        load_glue_metric("squad")


# ---------------------------------------------------------------------------------------------
# LoRA targets
# ---------------------------------------------------------------------------------------------


def test_lora_targets_are_found_by_name():
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification

    look = LookAroundForSequenceClassification(LookAroundConfig.from_preset("tiny", vocab_size=300, num_labels=3))
    assert head_module_names(look) == ["score"]
    assert find_lora_target_modules(look) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    bert = BertForSequenceClassification(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=37))
    assert head_module_names(bert) == ["classifier"]
    assert find_lora_target_modules(bert) == ["dense", "key", "query", "value"]
    gpt2 = GPT2ForSequenceClassification(GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=2))
    assert head_module_names(gpt2) == ["score"] and find_lora_target_modules(gpt2) == ["c_attn", "c_fc", "c_proj"]


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, bbc_topics_dir):
    """A tiny pretrained-style checkpoint (LookAroundForPreTraining, no classification head) and its tokenizer."""
    path = tmp_path_factory.mktemp("ckpt")
    lines = [json.loads(l)["sentence"] for folder in (FIXTURES / "reviews", bbc_topics_dir)
             for l in open(folder / "train.jsonl")]
    tok = train_tokenizer(lines, vocab_size=400, min_frequency=1)
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id,
    )
    LookAroundForPreTraining(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _argv(checkpoint, out, data=FIXTURES / "reviews", *extra):
    return [
        "--model_name_or_path", str(checkpoint),
        "--train_file", str(data / "train.jsonl"),
        "--validation_file", str(data / "validation.jsonl"),
        "--max_train_samples", "64", "--max_eval_samples", "32", "--max_seq_length", "64",
        "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32", "--max_steps", "4",
        "--learning_rate", "1e-3", "--do_train", "--do_eval", "--report_to", "none", "--save_strategy", "no",
        "--use_cpu", "--output_dir", str(out), *extra,
    ]


def _pipeline_labels(output_dir, texts):
    """What a user gets: the text-classification pipeline on the output folder, nothing else."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(output_dir), device="cpu")
    return classify(texts), classify.model


@pytest.mark.parametrize("task,key", [("reviews", "eval_accuracy"), ("review_scores", "eval_pearson")])
def test_full_fine_tuning_writes_all_results(checkpoint, tmp_path, task, key):
    assert main(_argv(checkpoint, tmp_path, FIXTURES / task)) == 0
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert {"train_loss", "train_runtime", "eval_loss", key, "eval_samples"} <= set(results)
    assert results["eval_samples"] == 32 and np.isfinite(results["train_loss"])
    config = json.loads((tmp_path / "config.json").read_text())
    if task == "reviews":
        # the data's label_name column names the labels
        assert 0.0 <= results[key] <= 1.0 and config["id2label"] == {"0": "negative", "1": "positive"}
        predictions, model = _pipeline_labels(tmp_path, ["A superb film.", "The plot was dull."])
        assert model.config.num_labels == 2 and {p["label"] for p in predictions} <= {"negative", "positive"}
    else:
        assert -1.0 <= results[key] <= 1.0 and len(config["id2label"]) == 1 and config["problem_type"] == "regression"


def test_lora_output_loads_with_the_pipeline_and_the_adapter_reloads(checkpoint, tmp_path, bbc_topics_dir):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    assert main(_argv(checkpoint, tmp_path, bbc_topics_dir, "--use_lora", "--lora_r", "4", "--lora_alpha", "8",
                      "--learning_rate", "5e-2")) == 0
    adapter = tmp_path / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert set(saved["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert "score" in saved["modules_to_save"]
    assert not (tmp_path / "adapter_config.json").exists()  # the root holds the merged model, not an adapter

    texts = ["Shares fall as profits slump", "Minister faces vote on new bill"]
    tok = AutoTokenizer.from_pretrained(tmp_path)
    batch = tok(texts, padding=True, return_tensors="pt")
    # 1. what users do: the pipeline and the Auto class on the output folder, 5 named labels, no new weights
    predictions, piped = _pipeline_labels(tmp_path, texts)
    assert piped.config.num_labels == 5 and list(piped.config.id2label.values()) == BBC_TOPICS
    assert {p["label"] for p in predictions} <= set(BBC_TOPICS)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.id2label == piped.config.id2label
    # 2. the adapter reloads on the pretrained base, and equals the merged model that was saved
    config = AutoConfig.from_pretrained(checkpoint, num_labels=5)
    base = AutoModelForSequenceClassification.from_pretrained(checkpoint, config=config)
    with torch.no_grad():
        before = base(**batch).logits.clone()
        reloaded = PeftModel.from_pretrained(base, adapter).eval()
        after = reloaded(**batch).logits
        assert not torch.allclose(before, after)  # the adapter and the trained head changed the model
        torch.testing.assert_close(loaded(**batch).logits, after, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(piped(**batch).logits, after, rtol=1e-4, atol=1e-5)
    results = json.loads((tmp_path / "all_results.json").read_text())
    assert "eval_accuracy" in results


def test_lora_reload_matches_the_trained_model(checkpoint, tmp_path):
    """Logits of the in-memory trained PeftModel equal those of the saved, reloaded adapter."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, TrainingArguments

    from hf_lookaround.evaluation.glue import DataTrainingArguments, ModelArguments, apply_lora

    config = AutoConfig.from_pretrained(checkpoint, num_labels=2)
    model = apply_lora(AutoModelForSequenceClassification.from_pretrained(checkpoint, config=config),
                       ModelArguments(str(checkpoint), lora_r=4))
    with torch.no_grad():  # stand in for training: move every trainable weight
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    model.eval().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    batch = tok(["a charming film", "dull"], padding=True, return_tensors="pt")
    base = AutoModelForSequenceClassification.from_pretrained(checkpoint, config=config)
    reloaded = PeftModel.from_pretrained(base, tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits)


def test_local_data_columns_and_label_names(bbc_topics_dir):
    from hf_lookaround.evaluation.tasks import detect_sentence_columns, label_info, load_labeled_splits

    raw = load_labeled_splits(dataset=str(bbc_topics_dir))
    assert set(raw) == {"train", "validation", "test"} and len(raw["train"]) == 200
    assert detect_sentence_columns(raw["train"]) == ("sentence", None)  # label_name is not an input
    info = label_info(raw)
    assert not info.is_regression and info.values == list(range(5))
    assert info.names == BBC_TOPICS
    assert label_info(load_labeled_splits(dataset=str(FIXTURES / "review_scores"))).is_regression


def test_sentence_pair_columns_are_detected(tmp_path):
    from hf_lookaround.evaluation.tasks import detect_sentence_columns, load_labeled_splits

    rows = [{"idx": i, "premise": "a b", "hypothesis": "c", "label": i % 2} for i in range(4)]
    (tmp_path / "train.csv").write_text("idx,premise,hypothesis,label\n" + "".join(f"{r['idx']},{r['premise']},{r['hypothesis']},{r['label']}\n" for r in rows))
    raw = load_labeled_splits(train_file=str(tmp_path / "train.csv"))
    assert detect_sentence_columns(raw["train"]) == ("premise", "hypothesis")
    assert detect_sentence_columns(raw["train"], task_name="mnli") == ("premise", "hypothesis")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_glue_task_without_network_says_what_to_pass(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    argv = ["--model_name_or_path", str(checkpoint), "--task_name", "sst2", "--do_train", "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="no data for GLUE task 'sst2'.*--train_file"):
        main(argv)
    with pytest.raises(ValueError, match="unknown GLUE task 'sst3'"):
        main(argv[:2] + ["--task_name", "sst3", "--output_dir", str(tmp_path)])


def test_missing_label_column_is_an_error(checkpoint, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"sentence": s, "target": i % 2}) + "\n" for i, s in enumerate(["a", "b", "c"])))
    argv = ["--model_name_or_path", str(checkpoint), "--train_file", str(data), "--do_train", "--output_dir", str(tmp_path / "o")]
    with pytest.raises(ValueError, match="no label column 'label'.*--label_column"):
        main(argv)


def test_label_count_must_match_the_checkpoint_head(checkpoint, tmp_path):
    three = tmp_path / "three_labels"
    LookAroundForSequenceClassification.from_pretrained(checkpoint, num_labels=3).save_pretrained(three)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (three / f).write_bytes((checkpoint / f).read_bytes())
    with pytest.raises(ValueError, match="head has 3 labels but the data has 2.*--ignore_mismatched_sizes"):
        main(_argv(three, tmp_path / "a"))
    argv = _argv(three, tmp_path / "b", FIXTURES / "reviews", "--ignore_mismatched_sizes", "--max_steps", "1")
    assert main(argv) == 0
    assert len(json.loads((tmp_path / "b" / "config.json").read_text())["id2label"]) == 2
