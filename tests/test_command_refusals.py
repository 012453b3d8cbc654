"""What the commands refuse instead of giving a silent wrong result (issue 30, section 3): a resume without
optimizer, scheduler or RNG state, damaged final weights kept by a rerun, a tokenizer overwritten, flags that trained
or scored nothing.

One tiny finished run (conftest's `finished_run`: 4 steps, checkpoints 2 and 4) is made once; each test damages a
copy of it (`copy`)."""

import json

import pytest

from hf_lookaround import cli
from hf_lookaround.cli.pretrain import parse_args
from hf_lookaround.training import checkpointing
from hf_lookaround.training.pretraining import run
from conftest import one_line_error




def remove_with_marker_entry(checkpoint, name) -> None:
    """Delete a file of a complete checkpoint and its entry in the marker: the checkpoint still looks intact."""
    (checkpoint / name).unlink()
    marker = checkpoint / checkpointing.COMPLETE_MARKER
    manifest = json.loads(marker.read_text())
    for key in ("files", "samples"):
        manifest[key].pop(name, None)
    marker.write_text(json.dumps(manifest))
    assert checkpointing.checkpoint_problems(checkpoint) == []


# ---------------------------------------------------------------------------------------------
# 1. a resume that cannot restore optimizer, scheduler or RNG state is refused
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_resuming_without_a_state_file_is_refused(copy, make_args, capsys, name):
    remove_with_marker_entry(copy / "checkpoint-4", name)
    line = one_line_error(capsys, ["pretrain", *make_args(copy, "--resume_from_checkpoint", "last", max_steps=6)])
    assert line.startswith("hf-lookaround pretrain: error: ")
    assert "checkpoint-4" in line and name in line and "--resume_weights_only" in line
    assert not (copy / "checkpoint-6").exists()


def test_a_save_only_model_checkpoint_resumes_only_with_resume_weights_only(make_args, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    run(*parse_args(make_args(out, "--save_only_model", "true", max_steps=2)))
    line = one_line_error(capsys, ["pretrain", *make_args(out, "--save_only_model", "true", "--resume_from_checkpoint",
                                                      "last")])
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert name in line
    assert not (out / "checkpoint-4").exists()
    with caplog.at_level("WARNING", logger="hf_lookaround.training.pretraining"):
        assert cli.main(["pretrain", *make_args(out, "--save_only_model", "true", "--resume_from_checkpoint", "last",
                                                "--resume_weights_only", "true")]) == 0
    warned = [r.getMessage() for r in caplog.records if "--resume_weights_only" in r.getMessage()]
    assert len(warned) == 1 and "optimizer.pt" in warned[0] and "checkpoint-2" in warned[0]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4  # went on from step 2


def test_resume_weights_only_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["pretrain", "--help"])
    assert "--resume_weights_only" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 2. damaged final weights are written again from the last checkpoint
# ---------------------------------------------------------------------------------------------
def tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("damage", ["cut to a third", "cut to a third, no marker", "rewritten at the same size"])
def test_a_damaged_final_model_is_written_again_from_the_last_checkpoint(copy, make_args, caplog, damage):
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    if damage.startswith("cut"):
        weights.write_bytes(data[: len(data) // 3])
    else:
        weights.write_bytes(data[:-64] + bytes(64))
    if damage.endswith("no marker"):  # a final model saved before the marker existed
        (copy / checkpointing.FINAL_MARKER).unlink(missing_ok=True)
    with caplog.at_level("WARNING", logger="hf_lookaround.training.pretraining"):
        assert cli.main(["pretrain", *make_args(copy, "--resume_from_checkpoint", "last")]) == 0
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and "model.safetensors" in warned[0] and "checkpoint-4" in warned[0]
    assert checkpointing.final_model_problems(copy) == []
    final, last = tensors(weights), tensors(copy / "checkpoint-4" / "model.safetensors")
    assert final.keys() == last.keys() and all((final[k] == last[k]).all() for k in final)
    assert [p.name for p in checkpointing.list_checkpoints(copy)] == ["checkpoint-2", "checkpoint-4"]
    # and the run is finished again: a second rerun changes nothing
    before = weights.read_bytes()
    assert cli.main(["pretrain", *make_args(copy, "--resume_from_checkpoint", "last")]) == 0
    assert weights.read_bytes() == before


# ---------------------------------------------------------------------------------------------
# 3. train-tokenizer does not overwrite a tokenizer silently
# ---------------------------------------------------------------------------------------------
def test_train_tokenizer_refuses_a_folder_that_holds_a_tokenizer_unless_overwrite(bbc_text_dir, tmp_path, capsys):
    out = tmp_path / "tok"
    argv = ["train-tokenizer", str(bbc_text_dir / "train.jsonl.gz"), "-o", str(out), "--vocab_size", "300"]
    assert cli.main(argv) == 0
    before = (out / "tokenizer.json").read_bytes()
    line = one_line_error(capsys, [*argv[:-1], "400"])
    assert line.startswith("hf-lookaround train-tokenizer: error: ") and str(out) in line and "--overwrite" in line
    assert (out / "tokenizer.json").read_bytes() == before
    assert cli.main([*argv[:-1], "400", "--overwrite"]) == 0
    assert (out / "tokenizer.json").read_bytes() != before
    # a folder without a tokenizer (say, empty, made beforehand) is fine
    (tmp_path / "empty").mkdir()
    assert cli.main([*argv[:3], str(tmp_path / "empty"), *argv[4:]]) == 0


# ---------------------------------------------------------------------------------------------
# 4. flags and data that trained or scored nothing, or something else, without a word
# ---------------------------------------------------------------------------------------------
def test_pretrain_with_nothing_to_train_is_refused(make_args, tmp_path, capsys):
    out = tmp_path / "run"
    argv = make_args(out, "--num_train_epochs", "0")
    argv[argv.index("--max_steps") + 1] = "-5"
    line = one_line_error(capsys, ["pretrain", *argv])
    assert "nothing to train" in line and "--max_steps -5" in line and "--num_train_epochs 0" in line
    assert not (out / "model.safetensors").exists()


@pytest.mark.parametrize("flag", ["--max_length", "--stride"])
def test_perplexity_refuses_a_zero_window(finished_run, bbc_text_dir, tmp_path, capsys, flag):
    # before: 0 was read as "not given", and the default window scored the documents with rc 0
    line = one_line_error(capsys, ["perplexity", "--model_name_or_path", str(finished_run), "--dataset", str(bbc_text_dir),
                               "--protocol", "masked", "--max_documents", "1", "--positions_per_window", "2",
                               "--device", "cpu", "--output_dir", str(tmp_path / "out"), flag, "0"])
    assert line.startswith("hf-lookaround perplexity: error: ") and f"{flag} 0" in line
    assert not (tmp_path / "out").exists()


def test_generate_refuses_zero_samples(finished_run, capsys):
    # before: one sample, rc 0
    line = one_line_error(capsys, ["generate", str(finished_run), "--num_tokens", "3", "--num_samples", "0",
                               "--device", "cpu"])
    assert line.startswith("hf-lookaround generate: error: ") and "--num_samples 0" in line


def test_jsonl_records_without_text_are_refused(make_args, bbc_text_dir, tmp_path, capsys):
    import gzip

    records = [json.loads(line) for line in gzip.open(bbc_text_dir / "train.jsonl.gz", "rt")]
    for i in (2, 5, 6, 9, 11, 13, 20):  # lines 3, 6, 7, 10, 12, 14, 21 hold no text
        records[i] = {"title": "no text here"} if i % 2 else {"text": None}
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = make_args(tmp_path / "run")
    argv[argv.index("--train_files") + 1] = str(data)
    line = one_line_error(capsys, ["pretrain", *argv])
    assert str(data) in line and "7 record(s)" in line and "lines 3, 6, 7, 10, 12, ..." in line
    assert not (tmp_path / "run" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# 5. a file-size limit during a save (torch: "unexpected pos", safetensors: "File too large")
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("save", ["checkpoint-4", "final save"])
def test_a_file_size_limit_during_a_save_is_one_line_and_leaves_nothing_that_looks_complete(make_args, tmp_path, save):
    import resource

    from transformers import TrainerCallback

    # model.safetensors is ~136 kB and optimizer.pt ~286 kB. After checkpoint-2, a 200 kB limit stops checkpoint-4 at
    # optimizer.pt (torch's RuntimeError "unexpected pos"); after checkpoint-4, a 100 kB limit stops the final
    # model.safetensors (safetensors' "File too large")
    out = tmp_path / "run"
    after_step, limit, folder = (2, 200_000, out / "checkpoint-4") if save == "checkpoint-4" else (4, 100_000, out)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    class FileSizeLimit(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == after_step:  # Python ignores SIGXFSZ: a write past the limit fails (EFBIG)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))

    try:
        with pytest.raises(OSError) as err:
            run(*parse_args(make_args(out)), callbacks=[FileSizeLimit()])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(err.value) == (  # the CLI prints it as one line
        f"saving into {folder} failed: a file could not be written whole (file too large: a file-size limit such as "
        "`ulimit -f`, or the largest file of this file system); raise the limit or give an --output_dir on another "
        "file system, then rerun with --resume_from_checkpoint last (with --overwrite_output_dir instead if no "
        "checkpoint was complete yet)")
    assert not (out / checkpointing.FINAL_MARKER).exists()
    assert (out / "checkpoint-4" / checkpointing.COMPLETE_MARKER).exists() == (save == "final save")
    # the limit lifted, the command the message gives finishes the run
    assert cli.main(["pretrain", *make_args(out, "--resume_from_checkpoint", "last")]) == 0
    assert checkpointing.final_model_problems(out) == []


# ---------------------------------------------------------------------------------------------
# 6. a state file that would run code when loaded (a malicious pickle) is refused in one line
# ---------------------------------------------------------------------------------------------
class RunsCode:
    """A pickle that calls ``os.system`` when loaded without ``weights_only``."""

    def __init__(self, witness):
        self.witness = witness

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.witness}",)


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt"])
def test_a_malicious_pickle_in_a_checkpoint_is_refused_in_one_line(copy, make_args, tmp_path, capsys, name):
    import torch

    # before: torch's UnpicklingError traceback (refused safely, but suggesting weights_only=False)
    witness = tmp_path / "code_ran"
    checkpoint = copy / "checkpoint-4"
    torch.save(RunsCode(witness), checkpoint / name)
    checkpointing.mark_complete(checkpoint, 4, 1, {"block_size": 32})  # the marker agrees: it looks intact
    line = one_line_error(capsys, ["pretrain", *make_args(copy, "--resume_from_checkpoint", "last", max_steps=6)])
    assert line.startswith("hf-lookaround pretrain: error: ") and str(checkpoint) in line
    assert "would run code, so it was refused" in line and "posix.system" in line and "another checkpoint" in line
    assert not witness.exists() and not (copy / "checkpoint-6").exists()


# ---------------------------------------------------------------------------------------------
# 7. messages: a non-UTF-8 file, a tokenizer folder without tokenizer.json, an empty or garbled lock file
# ---------------------------------------------------------------------------------------------
def test_a_non_utf8_jsonl_is_named_with_its_line_by_probe_and_perplexity(finished_run, tmp_path, capsys):
    # before: "'utf-8' codec can't decode byte 0xe9 in position 3: invalid continuation byte", no file
    data = tmp_path / "data"
    data.mkdir()
    rows = b'{"sentence": "fine", "label": 0, "text": "fine"}\n{"sentence": "caf\xe9", "label": 1, "text": "caf\xe9"}\n'
    for split in ("train", "validation", "test"):
        (data / f"{split}.jsonl").write_bytes(rows)
    line = one_line_error(capsys, ["probe", "--model_name_or_path", str(finished_run), "--dataset", str(data),
                               "--device", "cpu", "--output_dir", str(tmp_path / "probe")])
    assert f"{data / 'train.jsonl'}:2: not UTF-8 text" in line and "iconv" in line
    line = one_line_error(capsys, ["perplexity", "--model_name_or_path", str(finished_run), "--dataset",
                               str(data / "test.jsonl"), "--device", "cpu", "--output_dir", str(tmp_path / "ppl")])
    assert f"{data / 'test.jsonl'}:2: not UTF-8 text" in line


def test_a_tokenizer_folder_without_tokenizer_json_says_so(finished_run, tmp_path, capsys):
    # before: "Couldn't instantiate the backend tokenizer ... You need to have sentencepiece or tiktoken installed"
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text((finished_run / "tokenizer_config.json").read_text())
    line = one_line_error(capsys, ["generate", str(finished_run), "--tokenizer", str(folder), "--num_tokens", "3",
                               "--device", "cpu"])
    assert f"{folder} holds no tokenizer: tokenizer.json is missing (found tokenizer_config.json)" in line
    assert "sentencepiece" not in line


@pytest.mark.parametrize("content", ["", "garbled{"])
def test_an_empty_or_garbled_lock_is_taken_over_when_old_and_explained_when_new(tmp_path, caplog, content):
    import os
    import time

    lock = checkpointing.OutputDirLock(tmp_path)
    lock.path.write_text(content)
    # new: a run may be writing its record this moment; before: "pid None on host None"
    with pytest.raises(ValueError, match="is empty or not a lock record") as err:
        lock.acquire()
    assert "None" not in str(err.value) and f"delete {lock.path}" in str(err.value)
    old = time.time() - checkpointing.STALE_UNREADABLE_LOCK_S - 1
    os.utime(lock.path, (old, old))
    with caplog.at_level("WARNING", logger="hf_lookaround.training.checkpointing"):
        lock.acquire()
    assert lock.held and json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert any("empty or not a lock record" in r.getMessage() for r in caplog.records)
    lock.release()
    assert not lock.path.exists()
