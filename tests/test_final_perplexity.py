"""The end-of-run perplexity of `pretrain` (`final_perplexity`): the masked protocol shows progress and by default
costs about what a short training did (issue 23, item 9): the per-prefix protocol scores a few evenly spaced prefix
lengths of each window."""

import json
import random

import pytest
import torch

from hf_lookaround import LookAroundConfig, LookAroundForPreTraining, cli
from hf_lookaround.evaluation.perplexity import masked_perplexity
from conftest import HUNG_CHILD_SECONDS, WORDS  # a guard against a hung child, not a speed test


@pytest.fixture(scope="module")
def mlm_model(tok):
    torch.manual_seed(0)
    config = LookAroundConfig.from_preset(
        "tiny", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, mask_token_id=tok.mask_token_id, objective="mlm", plan_params={"mask_ratio": 0.15})
    return LookAroundForPreTraining(config).eval()


def test_a_sample_of_prefix_lengths_costs_fewer_rows_and_keeps_every_bucket(mlm_model, tok, texts):
    rows = []
    forward = mlm_model.forward
    mlm_model.forward = lambda *a, **k: (rows.append(k["input_ids"].shape[0]), forward(*a, **k))[1]
    try:
        full = masked_perplexity(mlm_model, tok, texts[:3], max_length=32, stride=16, batch_size=64, progress=False)
        full_rows = sum(rows)
        rows.clear()
        sample = masked_perplexity(mlm_model, tok, texts[:3], max_length=32, stride=16, batch_size=64,
                                   positions_per_window=4, progress=False)
    finally:
        del mlm_model.forward
    assert sample.extra["masked_mode"] == "two_stream_prefix"
    assert sum(rows) < full_rows / 3 and sample.num_tokens == sum(rows)
    assert sample.extra["num_scorable_tokens"] == full.num_tokens
    # short and long prefixes are both still there
    assert sample.prefix_lengths.min() == full.prefix_lengths.min()
    assert sample.prefix_lengths.max() == full.prefix_lengths.max()
    # bits per byte of a sample stand for the whole text: the same order as the full figure
    assert 0.5 < sample.bits_per_byte / full.bits_per_byte < 2
    # enough positions per window: the full protocol
    every = masked_perplexity(mlm_model, tok, texts[:3], max_length=32, stride=16, batch_size=64,
                              positions_per_window=1000, progress=False)
    assert every.perplexity == full.perplexity and every.bits_per_byte == full.bits_per_byte


def test_pretrain_mlm_says_how_it_samples_and_shows_progress(tok, texts, tmp_path, caplog, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok.save_pretrained(tmp_path / "tok")
    argv = ["pretrain", "--train_files", str(data), "--tokenizer_name", str(tmp_path / "tok"), "--preset", "tiny",
            "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
            "--block_size", "32", "--objective", "mlm", "--do_train", "--do_eval", "--max_steps", "1",
            "--per_device_train_batch_size", "2", "--max_eval_samples", "4", "--validation_split_percentage", "20",
            "--perplexity_max_documents", "2", "--perplexity_positions_per_window", "4", "--report_to", "none",
            "--use_cpu", "true", "--output_dir", str(tmp_path / "out")]
    with caplog.at_level("INFO", logger="hf_lookaround.training.pretraining"):
        assert cli.main(argv) == 0
    logs = " ".join(r.getMessage() for r in caplog.records)
    assert "4 evenly spaced prefix lengths" in logs and "--perplexity_positions_per_window" in logs
    assert "masked perplexity, one row per position" in capsys.readouterr().err  # the tqdm bar
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert results["eval_masked_perplexity"] > 1


# a trained tokenizer's model_max_length (the block size) does not flood the end-of-run perplexity with warnings
def test_end_of_run_perplexity_with_a_trained_tokenizer_warns_nothing(tmp_path):
    import os
    import subprocess
    import sys

    rng = random.Random(0)
    words = WORDS[:11]  # river .. music
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(200))}) + "\n"
                            for _ in range(20)))
    argv = ["pretrain", "--train_files", str(data), "--train_tokenizer", "--tokenizer_vocab_size", "300",
            "--preset", "tiny", "--config_overrides",
            "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64", "--block_size", "16",
            "--objective", "ar", "--do_train", "--do_eval", "--max_steps", "1", "--per_device_train_batch_size", "2",
            "--max_eval_samples", "2", "--validation_split_percentage", "20", "--perplexity_max_documents", "3",
            "--report_to", "none", "--disable_tqdm", "true", "--use_cpu", "true", "--output_dir", str(tmp_path / "o")]
    # a process of its own: transformers' warnings go to the stderr its logging was set up with
    proc = subprocess.run([sys.executable, "-m", "hf_lookaround.cli", *argv], capture_output=True, text=True,
                          timeout=HUNG_CHILD_SECONDS, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval_ar_perplexity" in proc.stdout + proc.stderr
    assert "Token indices sequence length is longer" not in proc.stderr + proc.stdout
