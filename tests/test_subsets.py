"""Seeded subsets (data/subsets.py): a first-N slice of sorted data is not a sample of it (issue 23, item 10): `glue
--max_train_samples N` on a label-sorted file and `vision --num_train N` on a class-sorted image folder draw their N
at random (seeded)."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

FIXTURES = __import__("pathlib").Path(__file__).resolve().parent / "fixtures"


def test_glue_max_train_samples_of_a_label_sorted_file_holds_every_label(tmp_path, monkeypatch):
    from transformers import Trainer

    from hf_lookaround import LookAroundConfig, LookAroundForPreTraining
    from hf_lookaround.data.tokenization import train_tokenizer
    from hf_lookaround.cli.glue import main

    rows = [json.loads(line) for line in open(FIXTURES / "reviews" / "train.jsonl")]
    rows.sort(key=lambda r: r["label"])  # every negative review first
    assert rows[0]["label"] != rows[-1]["label"]
    data = tmp_path / "sorted"
    data.mkdir()
    for split in ("train", "validation"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = train_tokenizer([r["sentence"] for r in rows], vocab_size=300, min_frequency=1)
    config = LookAroundConfig.from_preset("tiny", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                          eos_token_id=tok.eos_token_id)
    LookAroundForPreTraining(config).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")

    seen = {}

    def train(self, *args, **kwargs):  # what the fine-tuning would train on; no need to train
        seen["train"] = list(self.train_dataset["label"])
        seen["eval"] = list(self.eval_dataset["label"])
        raise SystemExit(0)

    monkeypatch.setattr(Trainer, "train", train)
    with pytest.raises(SystemExit):
        main(["--model_name_or_path", str(tmp_path / "ckpt"), "--train_file", str(data / "train.jsonl"),
              "--validation_file", str(data / "validation.jsonl"), "--max_train_samples", "16",
              "--max_eval_samples", "16", "--max_seq_length", "32", "--do_train", "--do_eval", "--report_to", "none",
              "--use_cpu", "--output_dir", str(tmp_path / "out")])
    assert len(seen["train"]) == 16 and set(seen["train"]) == {0, 1}, seen
    assert set(seen["eval"]) == {0, 1}, seen


def test_vision_num_train_of_a_class_sorted_folder_probes_every_class(tmp_path):
    from hf_lookaround.cli.vision import main

    rng = np.random.default_rng(0)
    folder = tmp_path / "shapes"
    for split, n in (("train", 40), ("test", 10)):
        for label in range(3):  # an image folder is read class by class
            (folder / split / f"class{label}").mkdir(parents=True)
            for i in range(n):
                pixels = np.full((8, 8), 40 + 80 * label, np.uint8) + rng.integers(0, 20, (8, 8), dtype=np.uint8)
                Image.fromarray(pixels, "L").save(folder / split / f"class{label}" / f"{i}.png")
    out = tmp_path / "out"
    argv = ["--dataset", str(folder), "--output_dir", str(out), "--objective", "gvp", "--num_groups", "4",
            "--image_size", "8", "--patch_size", "2", "--hidden_size", "32", "--num_hidden_layers", "1",
            "--num_attention_heads", "2", "--intermediate_size", "64", "--num_train", "20", "--num_probe_train", "30",
            "--max_steps", "1", "--batch_size", "8", "--finetune_steps", "1", "--no_baselines",
            "--probe_backend", "sklearn_path"]
    torch.manual_seed(0)
    assert main(argv) == 0
    probe = json.loads((out / "vision_results.json").read_text())["linear_probe"]["pretrained"]
    accuracy = probe["accuracy"] if isinstance(probe, dict) else probe
    # three classes of distinct brightness: a probe that saw them all separates them; the first 20 + 30 train
    # images would hold classes 0 and 1 only, and every test image of class 2 would be missed (accuracy <= 2/3)
    assert accuracy > 0.9, probe
    assert (out / "README.md").is_file() and (out / "classifier" / "README.md").is_file()  # item 14: cards
