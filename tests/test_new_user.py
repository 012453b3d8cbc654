"""What a new user hit in their first hours (issue 30, section 4): each test fails on the code before its fix."""

import json
import logging
import random

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundModel, cli
from hf_lookaround.data.tokenization import train_tokenizer

WORDS = "river stone light window garden morning paper story market winter music number table city road".split()


@pytest.fixture(scope="module")
def texts():
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(30)]


@pytest.fixture(scope="module")
def tok(texts):
    return train_tokenizer(texts, vocab_size=300, min_frequency=1)


# ---------------------------------------------------------------------------------------------
# item 1: every cut split is a seeded random sample, with a warning when it leaves a class out
# ---------------------------------------------------------------------------------------------
def _label_sorted_task(folder, n_per_label):
    """Two labels, each split sorted by label (all the 0s first): a tweets file as a user found it."""
    folder.mkdir()
    rng = random.Random(1)
    for split, n in n_per_label.items():
        rows = [{"sentence": " ".join(rng.choice(WORDS) for _ in range(6)), "label": label}
                for label in (0, 1) for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_probe_samples_its_test_split_instead_of_taking_the_first_rows(tok, tmp_path, monkeypatch, caplog):
    from hf_lookaround.cli import probe

    torch.manual_seed(0)
    config = LookAroundConfig.from_preset("tiny", vocab_size=len(tok), hidden_size=32, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=32,
                                          pad_token_id=tok.pad_token_id)
    LookAroundModel(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = _label_sorted_task(tmp_path / "tweets", {"train": 30, "validation": 30, "test": 300})
    seen = {}

    def spy(x_train, y_train, x_val, y_val, x_test, y_test, **kwargs):
        seen.update(train=set(y_train.tolist()), validation=set(y_val.tolist()), test=set(y_test.tolist()))
        return real(x_train, y_train, x_val, y_val, x_test, y_test, **kwargs)

    real = probe.linear_probe
    monkeypatch.setattr(probe, "linear_probe", spy)
    argv = ["--model_name_or_path", str(tmp_path / "model"), "--dataset", str(data), "--max_train_samples", "20",
            "--max_eval_samples", "20", "--output_dir", str(tmp_path / "out")]
    with caplog.at_level("INFO"):
        assert probe.main(argv) == 0
    # the first 20 rows of each split hold label 0 only; a seeded sample holds both
    assert seen == {"train": {0, 1}, "validation": {0, 1}, "test": {0, 1}}
    assert "using 20 of 600 test examples (--max_eval_samples), drawn at random with seed 42" in caplog.text
    assert "hold no example" not in caplog.text


def test_a_cut_that_leaves_a_class_out_is_warned(caplog):
    import datasets

    from hf_lookaround.data.subsets import seeded_sample

    rows = datasets.Dataset.from_dict({"sentence": ["x"] * 100, "label": [0] * 99 + [1]})
    with caplog.at_level("INFO"):
        cut = seeded_sample(rows, 3, seed=0, what="test examples", flag="--max_eval_samples", label_column="label")
    assert len(cut) == 3 and set(cut["label"]) == {0}
    assert "test examples: the 3 of 100 kept by --max_eval_samples hold no example of the class(es) [1]" in caplog.text
    # the sample glue took before (shuffle(seed).select(range(n))): the same rows, so recorded numbers stand
    assert seeded_sample(rows, 10, 5, what="x", flag="f")["label"] == rows.shuffle(seed=5).select(range(10))["label"]
