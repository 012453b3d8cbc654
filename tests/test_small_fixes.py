"""Smaller things of issue 23, item 15: TrainingArguments' `--debug VALUE` reaches the Trainer commands, and a
trained tokenizer's model_max_length (the block size) no longer floods the end-of-run perplexity with warnings.
(One data summary per multi-process run: tests/test_distributed_cpu.py; push errors: tests/test_hub.py.)"""

import json
import random

import pytest

from hf_lookaround import cli
from conftest import HUNG_CHILD_SECONDS, WORDS  # a guard against a hung child, not a speed test


def test_trainer_commands_keep_debug_with_a_value(monkeypatch, tmp_path):
    from hf_lookaround.cli import pretrain

    seen = {}
    monkeypatch.setattr(pretrain, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    assert cli.main(["pretrain", "--output_dir", str(tmp_path), "--debug", "underflow_overflow"]) == 0
    assert seen["argv"][-2:] == ["--debug", "underflow_overflow"]
    from hf_lookaround.cli.pretrain import parse_args

    *_, training_args = parse_args(["--output_dir", str(tmp_path), "--debug", "underflow_overflow"])
    assert [d.value for d in training_args.debug] == ["underflow_overflow"]


def test_the_cli_traceback_flag_still_works(tmp_path):
    for flag in ("--traceback", "--debug"):
        with pytest.raises(ValueError, match="nothing to do"):
            cli.main(["pretrain", "--train_files", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                      "--do_eval", "false", flag])


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
