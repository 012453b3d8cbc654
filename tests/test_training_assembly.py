"""One training assembly: ``hf-lookaround pretrain``, the demo and both study workers build their Trainer with
``pretraining.build_trainer`` (config -> model -> collators -> unread-content policy -> Trainer), and none builds
its own. Each caller is stopped right after the assembly returns: nothing is trained."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_lookaround.training import pretraining
from hf_lookaround.training.unread_content import DropUnreadContent

TINY = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64"
BLOCK = 32


class Built(Exception):
    """Raised once the assembly has returned: the caller's Trainer is built, and that is all the test needs."""


@pytest.fixture
def assembled(monkeypatch):
    """Every Trainer the package's assembly builds, in order (the caller stops right after)."""
    trainers = []
    real = pretraining.build_trainer

    def recording(*args, **kwargs):
        trainers.append(real(*args, **kwargs))
        raise Built

    monkeypatch.setattr(pretraining, "build_trainer", recording)
    # a caller that built its own Trainer would get past the assembly: stop it there too
    monkeypatch.setattr(pretraining.LookAroundTrainer, "train", lambda self, *a, **k: pytest.fail(
        "a Trainer built outside build_trainer was trained"))
    return trainers


@pytest.fixture(scope="module")
def blocks_dir(tmp_path_factory, bbc_text_dir, tokenizer):
    from hf_lookaround.data.text import chunk_into_blocks, load_texts

    out = tmp_path_factory.mktemp("blocks")
    blocks = chunk_into_blocks(load_texts(bbc_text_dir / "train.jsonl.gz")[:4], tokenizer, BLOCK)
    blocks.save_to_disk(str(out / "train"))
    return out


def test_the_command_builds_its_trainer_with_the_assembly(assembled, tmp_path, bbc_text_dir, tokenizer_dir):
    from hf_lookaround.cli.pretrain import parse_args

    argv = ["--objective", "mlm", "--train_files", str(bbc_text_dir / "train.jsonl.gz"), "--tokenizer_name",
            str(tokenizer_dir), "--preset", "tiny", "--config_overrides", TINY, "--block_size", str(BLOCK),
            "--output_dir", str(tmp_path / "out"), "--do_train", "--max_steps", "1", "--report_to", "none",
            "--use_cpu", "true", "--seed", "3"]
    with pytest.raises(Built):
        pretraining.run(*parse_args(argv))
    (trainer,) = assembled
    assert isinstance(trainer, pretraining.LookAroundTrainer)
    assert isinstance(trainer.data_collator, DropUnreadContent)  # mlm's default policy
    # what a resume must match (issue 43: a new learning rate or schedule is refused, not silently kept)
    assert trainer.run_settings == {"block_size": BLOCK, "learning_rate": trainer.args.learning_rate,
                                    "lr_scheduler_type": "linear"}
    assert trainer.args.prediction_loss_only


def test_the_demo_builds_its_trainer_with_the_assembly(assembled, tmp_path, tokenizer, blocks_dir):
    import datasets

    from hf_lookaround.demo import pretrain_one

    blocks = datasets.load_from_disk(str(blocks_dir / "train"))
    args = SimpleNamespace(preset="tiny", block_size=BLOCK, output_dir=str(tmp_path), seed=0, batch_size=2,
                           learning_rate=1e-3, device="cpu", quiet=True)
    with pytest.raises(Built):
        pretrain_one("mlm-0.15", args, tokenizer, blocks, blocks, steps=1)
    (trainer,) = assembled
    # the demo now applies the command's unread-content policy (mlm: on)
    assert isinstance(trainer.data_collator, DropUnreadContent)
    assert trainer.eval_data_collator is not None and trainer.args.prediction_loss_only


def _study_spec(tmp_path, blocks_dir, **settings):
    return {"settings": dict(preset="tiny", block_size=BLOCK, batch_size=2, steps=1, warmup_fraction=0.1,
                             **settings),
            "prep": {"train_blocks": str(blocks_dir / "train"), "val_blocks": str(blocks_dir / "train")},
            "seed": 1, "learning_rate": 1e-3, "objective": "mlm-0.15", "pretrain_args": ["--objective", "mlm"],
            "checkpoint_steps": [2], "warmup_fraction": 0.1, "cell_dir": str(tmp_path), "device": "cpu",
            "deadline_unix": time.time() + 3600}


def test_the_study_workers_build_their_trainer_with_the_assembly(assembled, tmp_path, tokenizer, blocks_dir):
    import study_cell
    import study_curves_cell

    with pytest.raises(Built):
        study_cell.pretrain(_study_spec(tmp_path, blocks_dir), tokenizer, log=print, save_model=False)
    with pytest.raises(Built):
        study_curves_cell.build_trainer(_study_spec(tmp_path, blocks_dir), tokenizer, target_step=1)
    # a cell that asks for the unread-content policy gets it
    with pytest.raises(Built):
        study_cell.pretrain(_study_spec(tmp_path, blocks_dir, drop_unread_content=True), tokenizer, log=print,
                            save_model=False)
    cell, curves, asked = assembled
    # the recorded study trained every batch whole: without the setting, the policy stays off
    assert not isinstance(cell.data_collator, DropUnreadContent)
    assert not isinstance(curves.data_collator, DropUnreadContent)
    assert isinstance(asked.data_collator, DropUnreadContent)
    assert cell.args.seed == curves.args.seed == 1
