"""Small behaviours of the commands (issue 30, section 4: what a new user hit in their first hours): each test fails
on the code before its fix."""

import json
import logging
import random

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundModel, cli
from conftest import WORDS


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


# ---------------------------------------------------------------------------------------------
# item 3: the end-of-run masked perplexity costs about what the training did
# ---------------------------------------------------------------------------------------------
def _pretrain_argv(tok, texts, tmp_path, *extra):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok.save_pretrained(tmp_path / "tok")
    return ["pretrain", "--train_files", str(data), "--tokenizer_name", str(tmp_path / "tok"), "--preset", "tiny",
            "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
            "--block_size", "32", "--objective", "mlm", "--do_train", "--max_steps", "1",
            "--per_device_train_batch_size", "2", "--validation_split_percentage", "20",
            "--perplexity_positions_per_window", "4", "--report_to", "none", "--use_cpu", "true",
            "--output_dir", str(tmp_path / "out"), *extra]


def test_end_of_run_perplexity_is_bounded_by_the_training_cost(tok, texts, tmp_path, caplog):
    # 1 step of 2 blocks: 6 forward rows; a window of 4 prefix lengths costs 4, so 1 window (16 tokens) is scored
    # of the 6 held-out documents of 80 words, where it scored all 6 (~120 windows, 20x the training) before
    argv = _pretrain_argv(tok, texts, tmp_path, "--do_eval")
    with caplog.at_level("INFO", logger="hf_lookaround.training.pretraining"):
        assert cli.main(argv) == 0
    assert ("end-of-run perplexity: 1 of 6 validation document(s), at most 16 tokens (about the cost of the 1 "
            "training steps; --perplexity_max_tokens sets it)") in caplog.text
    caplog.clear()
    # --max_eval_samples bounds it as well, and --perplexity_max_tokens overrides both
    argv = _pretrain_argv(tok, texts, tmp_path, "--do_eval", "--perplexity_max_tokens", "200",
                          "--overwrite_output_dir", "true")
    with caplog.at_level("INFO", logger="hf_lookaround.training.pretraining"):
        assert cli.main(argv) == 0
    assert "at most 200 tokens (--perplexity_max_tokens" in caplog.text


def test_the_option_is_in_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    out = capsys.readouterr().out
    assert "--perplexity_max_tokens" in out and "about what the training cost" in " ".join(out.split())


# ---------------------------------------------------------------------------------------------
# item 2: the final model is written as a unit, marker last, before the end-of-run scoring
# ---------------------------------------------------------------------------------------------
def test_final_model_is_complete_before_the_end_of_run_scoring(tok, texts, tmp_path, monkeypatch):
    from hf_lookaround.hub.remote_code import HEADS
    from hf_lookaround.training import checkpointing, pretraining

    out = tmp_path / "out"
    seen = {}
    real = pretraining.final_perplexity

    def look(*args, **kwargs):  # the folder as a user loading it during the scoring finds it
        config = json.loads((out / "config.json").read_text())
        seen.update(auto_map=set(config.get("auto_map", {})), card=(out / "README.md").is_file(),
                    marker=(out / checkpointing.FINAL_MARKER).is_file(), problem=checkpointing.unfinished_run(out))
        return real(*args, **kwargs)

    monkeypatch.setattr(pretraining, "final_perplexity", look)
    assert cli.main(_pretrain_argv(tok, texts, tmp_path, "--do_eval", "--perplexity_max_tokens", "16")) == 0
    assert seen["card"] and seen["marker"] and seen["problem"] is None
    assert {HEADS[h][0] for h in ("masked-lm", "causal-lm")} <= seen["auto_map"]


def test_loaders_refuse_a_run_folder_whose_final_model_is_unfinished(tok, texts, tmp_path):
    from hf_lookaround.hub.load import load_pretrained
    from hf_lookaround.hub.weights import check_local_checkpoint
    from hf_lookaround.training import checkpointing

    out = tmp_path / "out"
    assert cli.main(_pretrain_argv(tok, texts, tmp_path)) == 0
    def check_local_weights(folder):  # what every command runs before it loads a folder
        check_local_checkpoint(folder, "hf-lookaround generate")

    check_local_weights(out)  # finished: loads
    # as during the final save: the run's lock is there, the marker (written last) is not
    (out / checkpointing.FINAL_MARKER).unlink()
    (out / checkpointing.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    for load in (check_local_weights, load_pretrained):
        with pytest.raises(ValueError, match="pretrain run that has not finished .* load one of its complete"):
            load(out)


# ---------------------------------------------------------------------------------------------
# item 4: the demo says what it does from the start, and its bar names the objective and the seed
# ---------------------------------------------------------------------------------------------
def test_demo_says_what_it_does_and_names_its_bars(tmp_path, capsys):
    from hf_lookaround.cli.demo import main as demo_main

    rng = random.Random(0)
    for label in ("sport", "music"):
        (tmp_path / "corpus" / label).mkdir(parents=True)
        for i in range(12):
            words = WORDS[:8] if label == "sport" else WORDS[7:]
            (tmp_path / "corpus" / label / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(60)))
    assert demo_main(["--corpus-dir", str(tmp_path / "corpus"), "--objectives", "ar", "--tokens-per-objective", "512",
                      "--batch-size", "4", "--block-size", "32", "--vocab-size", "300", "--perplexity-documents", "2",
                      "--output-dir", str(tmp_path / "demo"), "--seeds", "3", "--no-baseline"]) == 0
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("[demo]")]
    assert lines[1].startswith("[demo] training a 300-token tokenizer on the 14 pretraining articles")
    assert "[demo] seed 3, ar: pretraining 4 steps" in lines
    assert any(line.startswith("[demo] seed 3, ar: held-out perplexity on 2 test articles") for line in lines)
    assert "seed 3, ar:" in captured.err  # Trainer's tqdm bar, with its name


# ---------------------------------------------------------------------------------------------
# item 5: a card names its data sets, never a path of the user's machine, and has no YAML anchors
# ---------------------------------------------------------------------------------------------
def test_push_dry_run_card_has_no_local_paths_and_no_yaml_anchors(tok, texts, tmp_path):
    import yaml

    assert cli.main(_pretrain_argv(tok, texts, tmp_path, "--do_eval", "--perplexity_max_tokens", "16")) == 0
    preview = tmp_path / "preview"
    assert cli.main(["push", str(tmp_path / "out"), "me/tiny", "--dry-run", str(preview), "--language", "en", "fr",
                     "--dataset", str(tmp_path / "train.jsonl")]) == 0
    card = (preview / "README.md").read_text()
    front = card.split("---")[1]
    assert str(tmp_path) not in card and "&id" not in front and "*id" not in front
    meta = yaml.safe_load(front)
    assert meta["language"] == ["en", "fr"] and "datasets" not in meta  # a local file is no Hub data set
    data = meta["model-index"][0]["results"][0]["dataset"]
    assert data["name"] == data["type"] == (f"the last 20 % of the documents of {tmp_path.name}/train.jsonl (local) "
                                            "(held out from training)")


# ---------------------------------------------------------------------------------------------
# item 6: no test has a wall-clock limit that a slow or loaded machine reaches
# ---------------------------------------------------------------------------------------------
def test_no_test_sets_a_tight_wall_clock_limit():
    import re
    from pathlib import Path

    from conftest import HUNG_CHILD_SECONDS

    assert HUNG_CHILD_SECONDS >= 3600
    tight = [f"{path.name}:{n}: {line.strip()}" for path in sorted(Path(__file__).parent.glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"timeout\s*=\s*\d", line)]  # a number: every limit goes through HUNG_CHILD_SECONDS
    assert not tight, tight


# ---------------------------------------------------------------------------------------------
# item 7: generate prints the prompt with its continuation, says when it picks t = 2, fills without double spaces
# ---------------------------------------------------------------------------------------------
def _checkpoint(tok, folder, **overrides):
    from hf_lookaround import LookAroundForPreTraining

    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id, **overrides)
    LookAroundForPreTraining(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_generate_prints_the_prompt_and_says_it_picks_t_2(tok, tmp_path, capsys, caplog):
    model = _checkpoint(tok, tmp_path / "dar", objective="dar", plan_params={"t": 2}, prediction_stream="query")
    with caplog.at_level("INFO", logger="hf_lookaround.cli.generate"):
        assert cli.main(["generate", str(model), "--prompt", "river stone", "--max_new_tokens", "4",
                         "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("river stone")
    assert "no --group_size: decoding t = 2 tokens per forward" in caplog.text
    assert cli.main(["generate", str(model), "--prompt", "river stone", "--max_new_tokens", "4", "--device", "cpu",
                     "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["prompt"] == "river stone" and printed["group_size"] == 2


def test_infilling_leaves_no_double_spaces(tok, tmp_path, capsys):
    from hf_lookaround.decoding.infill import _encode_infill_inputs

    model = _checkpoint(tok, tmp_path / "mlm", objective="mlm", plan_params={"mask_ratio": 0.15})
    assert cli.main(["generate", str(model), "--infill", "river [MASK] [MASK] light window", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("river") and out.endswith(" light window") and "  " not in out, repr(out)
    # a filled word brings its own space ("Ġstone"): the text around a mask token must not add another
    config = LookAroundConfig.from_pretrained(model)
    ids, hidden, _ = _encode_infill_inputs(tok, "river [MASK] [MASK] light", None, None, None, False, config, "cpu")
    word = min(t for t in tok.get_vocab() if t.startswith("Ġ") and len(t) > 2)  # "Ġ" + a word piece
    filled = torch.where(hidden, torch.full_like(ids, tok.convert_tokens_to_ids(word)), ids)
    assert tok.decode(filled[0]) == f"river {word[1:]} {word[1:]} light"


# ---------------------------------------------------------------------------------------------
# item 8: .npz image arrays, train-tokenizer's output, no pin_memory warning on the CPU, transformers' range
# ---------------------------------------------------------------------------------------------
def test_vision_reads_npz_arrays(tmp_path):
    import numpy as np

    from hf_lookaround.data.images import load_image_splits

    rng = np.random.default_rng(0)
    path = tmp_path / "mnist.npz"
    np.savez(path, x_train=rng.integers(0, 256, (40, 8, 8), dtype=np.uint8), y_train=np.arange(40) % 4,
             x_test=rng.random((10, 8, 8, 1)), y_test=np.arange(10) % 4)  # floats 0..1 for the test images
    train, test = load_image_splits(str(path))
    assert (len(train), len(test), train.num_channels, train.image_size) == (40, 10, 1, 8)
    assert test.images.dtype == np.uint8 and train.label_names == ("0", "1", "2", "3")
    np.savez(tmp_path / "only_train.npz", x_train=rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8),
             y_train=np.arange(20) % 2)
    train, test = load_image_splits(str(tmp_path / "only_train.npz"), test_fraction=0.25)
    assert (len(train), len(test), train.num_channels) == (15, 5, 3)
    np.savez(tmp_path / "bad.npz", images=np.zeros((3, 8, 8)))
    with pytest.raises(ValueError, match="expected x_train and y_train"):
        load_image_splits(str(tmp_path / "bad.npz"))


def test_train_tokenizer_prints_no_blank_lines(tmp_path, texts, capfd):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    assert cli.main(["train-tokenizer", str(data), "-o", str(tmp_path / "tok"), "--vocab_size", "300"]) == 0
    out = capfd.readouterr().out  # the file descriptor: tokenizers' Rust code writes there directly
    assert out.splitlines()[-1].startswith("saved a byte-level BPE tokenizer") and "" not in out.splitlines()


def test_no_pin_memory_warning_on_a_cpu_run(tok, texts, tmp_path, monkeypatch):
    import warnings

    # a machine without an accelerator, and no --use_cpu (which makes transformers pin nothing): as a user runs it
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    argv = _pretrain_argv(tok, texts, tmp_path)
    del argv[argv.index("--use_cpu"):argv.index("--use_cpu") + 2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(argv) == 0
    assert not [w for w in caught if "pin_memory" in str(w.message)]


def test_setup_pins_transformers_to_the_verified_minor():
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    assert re.search(r'"transformers>=5\.17,<5\.18"', setup)
