"""`torchrun --standalone --nproc_per_node 2 -m hf_lookaround.cli pretrain ...` on a machine without a GPU, as
docs/distributed.md shows it (no --use_cpu): one world of 2 processes (gloo), not two worlds of 1 racing for the
output folder (issue 23, item 6)."""

import json
import os
import random
import subprocess
import sys

from hf_lookaround.training import checkpointing
from conftest import HUNG_CHILD_SECONDS, PLAN_WORDS  # a guard against a hung child, not a speed test


def test_torchrun_on_a_cpu_machine_makes_one_world_of_two(tmp_path, tokenizer_dir):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(PLAN_WORDS) for _ in range(60)) for _ in range(40)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "run"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "hf_lookaround.cli", "pretrain", "--train_files", str(tmp_path / "train.jsonl"),
           "--tokenizer_name", str(tokenizer_dir), "--preset", "tiny",
           "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64",
           "--block_size", "16", "--do_train", "--max_steps", "2", "--save_steps", "2",
           "--per_device_train_batch_size", "2", "--validation_split_percentage", "0", "--report_to", "none",
           "--disable_tqdm", "true", "--output_dir", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HUNG_CHILD_SECONDS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    marker = json.loads((out / "checkpoint-2" / checkpointing.COMPLETE_MARKER).read_text())
    assert marker["world_size"] == 2, marker
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["train_batch_size"] == 2
    assert "gloo" in proc.stderr and "--use_cpu true" in proc.stderr  # it says what it chose
    # the data summary is logged by the main process only (issue 23, item 15)
    assert proc.stderr.count("training blocks of 16 tokens") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("training data: ") == 1, proc.stderr[-3000:]
